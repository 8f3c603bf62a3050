"""uvicorn's httptools protocol under the listener limits (`gputopo.extender.http.refusals`), for the webhook and
metrics
listeners, which accept through `gputopo.listenguard.acceptgate.Gate`. uvicorn arms its keep-alive timer only after an
answer, so a connection that sent nothing was held forever; it has no head cap; and its 400 on a bad request
overtook a pipelined answer in progress. Refusals here wait for the answers before them.

`BoundedHttpTools` overrides private parts of `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`; the
range of uvicorn in pyproject.toml is the one it was checked against, and a test
(`tests/extender/http/test_uvicorn_compat.py`) says which part is gone when uvicorn changes them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gputopo.extender.http.heads import BodyBudget, HeadPolicy
from gputopo.extender.http.refusals import HeadMeter, read_too_slow, refusal
from gputopo.extender.settings import ListenerLimits

if TYPE_CHECKING:
    from gputopo.listenguard.acceptgate import Slot

TLS_READ_AHEAD_BYTES = 32 * 1024
REFUSED_TLS_LINGER_S = 0.1


class _Timer:
    """One pending call_later, replaced or cancelled as a whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.handle: asyncio.TimerHandle | None = None

    def start(self, seconds: float, fn: Any) -> None:
        self.cancel()
        self.handle = self.loop.call_later(seconds, fn)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol under `ListenerLimits` (see the module doc). `bounded_protocol` makes the
    subclass for one listener; uvicorn instantiates it per connection."""

    limits: ListenerLimits = ListenerLimits()
    policy: HeadPolicy = HeadPolicy()  # what the head alone decides (gputopo/extender/http/heads.py)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.idle_timeout_s  # type: ignore[assignment]  # a float is fine
        self._meter = HeadMeter(self.limits.max_header_bytes)
        self._read = _Timer(self.loop)
        self._stall = _Timer(self.loop)
        self._refusal: bytes | None = None
        self._lost = False
        self._tls: dict[str, Any] | None = None
        self.on_lost: Callable[[], None] | None = None  # the `Gate`'s release of the connection's slot
        self.slot: Slot | None = None  # set by the `Gate`: the listener's shared counts
        self.budget: BodyBudget | None = None  # set by the listener's server: its request bodies, all connections
        self._peer: str | None = None  # the client's address, for its share of the budget
        self._held: collections.deque[int] = collections.deque()  # budget bytes per request, in request order
        self._chunked = False  # the request being read streams a body of unknown length

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # The connection was counted by the `Gate` that handed it over (before its TLS handshake).
        super().connection_made(transport)
        self._tls = tls_extension(transport)
        if self._tls is not None:
            # Encrypted bytes the TLS layer takes off the socket ahead of us: its default (256 KiB) kept
            # reading a refused body, 139 MiB over 256 connections; two records' worth is enough to stream.
            with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
                transport.set_read_buffer_limits(high=TLS_READ_AHEAD_BYTES)  # type: ignore[attr-defined]
        if self.slot is not None:
            self._peer = self.slot.peer
            self.slot.trusted = self.policy.trusted(self._tls)
        # The first request's head and body from the moment the connection is handed over: one that sends
        # nothing is closed then.
        self._read.start(self.limits.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._read.cancel()
        self._stall.cancel()
        self._give_back(len(self._held))
        super().connection_lost(exc)
        if self.on_lost is not None:
            self.on_lost()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._tls is not None:
            self.scope["extensions"] = {"tls": self._tls}  # type: ignore[dict-item]  # uvicorn types it narrowly

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        self._unset_keepalive_if_required()
        if self._meter.idle:
            self._read.start(self.limits.read_timeout_s, self._read_timed_out)
        if self.slot is not None:
            self.slot.slots.bytes_received += len(data)
        refused = self._meter.read(self.parser, data)
        if refused is not None:
            self._refuse(*refused)

    def on_headers_complete(self) -> None:
        self._meter.head_done()
        method = self.parser.get_method()
        path = httptools.parse_url(self.url).path.decode("latin-1")
        decision = self.policy.decide(method, path, self.headers, self._tls)
        refused = decision.refusal
        if refused is None and self.budget is not None:
            full = self.budget.refusal(decision.declared, self._peer)
            refused = None if full is None else (503, full)
        if refused is not None:
            # Answered from the head: no 100 Continue, no byte of the body read (the parser stops here).
            if self.policy.refused is not None:
                self.policy.refused(path, refused[0])
            self._refuse(*refused)
            raise httptools.HttpParserError("refused from its head")
        self._held.append(decision.declared if self.budget is not None else 0)
        self._chunked = decision.chunked
        if self.expect_100_continue:
            wanted = method == b"POST" and path in self.policy.body_paths
            self.expect_100_continue = wanted and self.parser.get_http_version() == "1.1"
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.slot is not None:
            self.slot.slots.body_bytes += len(body)
        if self._chunked and self.budget is not None and self._held:
            full = self.budget.refusal(len(body), self._peer)
            if full is not None:
                self._refuse(503, full)
                raise httptools.HttpParserError("over the body budget")
            self._held[-1] += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._meter.message_done()
        self._read.cancel()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._give_back(1)  # requests are answered in order: the oldest held is this one's
        if self._refusal is not None:
            self._drop_unfinished()
        if self._refusal is not None and not self.pipeline:
            self.server_state.total_requests += 1
            self._write_refusal()
            return
        super().on_response_complete()
        if self._refusal is not None:
            self.transport.pause_reading()

    def pause_writing(self) -> None:
        super().pause_writing()
        # A client that stops reading its answers holds the connection until this passes.
        self._stall.start(self.limits.read_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._stall.cancel()
        super().resume_writing()

    # ------------------------------------------------------------------ the body budget and eviction

    def _give_back(self, requests: int) -> None:
        for _ in range(min(requests, len(self._held))):
            size = self._held.popleft()
            if self.budget is not None:
                self.budget.give(size, self._peer)

    def answering(self) -> bool:
        """A whole request is in and its answer is not yet written out (`gputopo.listenguard.acceptgate.Slot`):
        a connection in this state is not closed to make room for another address."""
        cycle = self.cycle
        busy = cycle is not None and not cycle.more_body and not cycle.response_complete
        return (busy or bool(self.pipeline)) and self.flow.write_paused is False

    def evict(self) -> None:
        """Closed to make room for a connection from an address holding fewer
        (`gputopo.listenguard.acceptgate.Slots`)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    # ------------------------------------------------------------------ refusals, in request order

    def _refuse(self, status: int, text: str) -> None:
        if self._refusal is not None:
            return
        self._refusal = refusal(status, text)
        self._read.cancel()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        self.transport.pause_reading()
        cycle = self.cycle
        unfinished = cycle is not None and cycle.more_body and not cycle.response_complete
        # A request whose body never finished gets the refusal in its place; if its app already waits for
        # that body, nothing is before it.
        if cycle is not None and unfinished and not self._drop_unfinished():
            if not cycle.response_started:
                self._write_refusal()
            else:
                self._close()  # an answer is half written: nothing can follow it
            return
        if self.cycle is None or (self.cycle.response_complete and not self.pipeline):
            self._write_refusal()
        # else: on_response_complete writes it after the answers before it

    def _drop_unfinished(self) -> bool:
        """Take the request whose body is unfinished out of the queue (it is the newest); True if it was."""
        if self.pipeline and self.pipeline[0][0].more_body:
            self.pipeline.popleft()
            return True
        return False

    def _write_refusal(self) -> None:
        if self._refusal is not None and not self.transport.is_closing():
            self.transport.write(self._refusal)
            self._close()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self._close()

    def _close(self) -> None:
        """Close once what is written is flushed; a client that does not read it is cut off after the read
        timeout (a closed transport otherwise waits for the flush forever, and TLS for the client's
        close_notify for asyncio's 30 s). A refusal over TLS is cut at once when it is already out (else
        within REFUSED_TLS_LINGER_S): while the TLS layer waits for the client's close_notify it reads and
        decrypts whatever the client still sends, on this loop (a refused 6 MiB review, whole)."""
        self.transport.close()
        if self._refusal is not None and self._tls is not None:
            if not self.transport.get_write_buffer_size():
                self._cut()
                return
            self.loop.call_later(REFUSED_TLS_LINGER_S, self._cut)
            return
        self.loop.call_later(self.limits.read_timeout_s, self._cut)

    def _cut(self) -> None:
        if not self._lost:
            self.transport.abort()

    def _read_timed_out(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body and cycle.waiting_for_100_continue:
            # The body waits for our 100 Continue (after the answers before it): the client is not late.
            self._read.start(self.limits.read_timeout_s, self._read_timed_out)
            return
        if self._meter.idle and not self.pipeline and (self.cycle is None or self.cycle.response_complete):
            self._close()  # nothing of a request arrived: nobody to answer
        else:
            self._refuse(408, read_too_slow(self.limits.read_timeout_s))

    def _stalled(self) -> None:
        self.transport.abort()


def tls_extension(transport: asyncio.BaseTransport) -> dict[str, Any] | None:
    """The ASGI TLS extension of a connection (None over plain TCP): `client_cert_chain` holds the client's
    certificate (PEM) when it presented one; with a client CA loaded (ssl.CERT_OPTIONAL) a certificate that
    does not verify has already failed the handshake. Python before 3.13 exposes only the leaf."""
    tls = transport.get_extra_info("ssl_object")
    if tls is None:
        return None
    der = tls.getpeercert(binary_form=True)
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": None,
        "client_cert_error": None,
        "tls_version": None,
        "cipher_suite": None,
    }


def bounded_protocol(limits: ListenerLimits, policy: HeadPolicy | None = None) -> type[BoundedHttpTools]:
    """The protocol class for one listener (uvicorn's `Config(http=...)`); `policy`: what its request heads
    decide (the paths it serves, those whose body it reads, who may call them)."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"limits": limits, "policy": policy or HeadPolicy()})
