"""Limits every listener holds to (docs/extender.md, "Listeners"): a request-head cap, a read deadline per
request, a keep-alive idle timeout, a cap on open connections and a stalled-write timeout.

- `HeadMeter` counts a request head's bytes before the parser sees them: httptools joins a header's pieces
  itself, so a cap checked in its callbacks comes after it has copied the whole header (a 220 MB header took
  the process from 54 to 615 MiB). The verbs server (`gputopo.extender.verbserver`) and `BoundedHttpTools` feed
  through it.
- `BoundedHttpTools` is uvicorn's httptools protocol with those limits, for the webhook and metrics
  listeners. uvicorn arms its keep-alive timer only after an answer, so a connection that sent nothing was
  held forever; it has no head cap; and its 400 on a bad request overtook a pipelined answer in progress.
  Refusals here wait for the answers before them.
- `Gate` takes every connection of the webhook and metrics listeners at accept, before any byte is read:
  it counts it against `--max-connections` and `--max-connections-per-peer` (`Slots`) and, on the webhook,
  runs the TLS handshake itself under `--handshake-timeout-seconds`. asyncio's own server-side TLS counted
  a connection only once its handshake was done and gave the handshake 60 s, so silent connections held
  file descriptors and memory past every bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from gputopo.extender.settings import Settings

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# Longer than the 90 s that Go's HTTP clients (kube-scheduler's, the API server's) keep an idle connection:
# the server then never closes one the client is about to reuse.
DEFAULT_IDLE_TIMEOUT_S = 120.0
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 256
# Near the read timeout: a handshake on the pod network takes milliseconds, and until it is done the
# connection holds a slot that nobody can be answered on.
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
# A quarter of the default cap: one address (an attacker's, or one misbehaving client's) holds at most a
# quarter of a listener, while the API server's few addresses (one per replica) still find room.
DEFAULT_MAX_CONNECTIONS_PER_PEER = DEFAULT_MAX_CONNECTIONS // 4
# New TLS handshakes one address may start per second (and as a burst): the API server keeps its
# connections alive and opens a few per replica, while a flood of handshakes from one address is CPU the
# verbs listener shares (on two cores 400 handshakes a second took its p99 to 3.3x idle).
DEFAULT_HANDSHAKES_PER_PEER_PER_S = 20.0
# Addresses whose handshake pace is remembered; past this, the ones back at a full burst are forgotten.
_MAX_PACED_PEERS = 4096

log = logging.getLogger("gputopo.extender.http")

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Payload Too Large"}
REASONS |= {431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


@dataclass(frozen=True)
class ListenerLimits:
    """What one listener allows (the settings of the same names, docs/configuration.md)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # head and body of one request, from its first byte
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # a kept-alive connection with nothing to do
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once, per listener, counted from the accept
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S  # TLS handshake, from the accept
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER  # of one client address (webhook, metrics)
    handshakes_per_peer_per_s: float = DEFAULT_HANDSHAKES_PER_PEER_PER_S  # TLS handshakes one address starts; 0: any

    @classmethod
    def of(cls, settings: Settings) -> ListenerLimits:
        per_peer = settings.max_connections_per_peer
        return cls(
            max_header_bytes=settings.max_header_bytes,
            read_timeout_s=settings.read_timeout_seconds,
            idle_timeout_s=settings.idle_timeout_seconds,
            max_connections=settings.max_connections,
            handshake_timeout_s=settings.handshake_timeout_seconds,
            max_connections_per_peer=max(1, settings.max_connections // 4) if per_peer is None else per_peer,
            handshakes_per_peer_per_s=settings.handshakes_per_peer_per_second,
        )


def head_too_large(limit: int) -> str:
    return f"request head is larger than {limit} bytes (--max-header-bytes)"


def read_too_slow(seconds: float) -> str:
    return f"request not received within {seconds:g} s (--read-timeout-seconds)"


TOO_MANY = "too many open connections on this listener (--max-connections)"
TOO_MANY_FROM_PEER = "too many open connections from this address (--max-connections-per-peer)"


def refusal(status: int, text: str) -> bytes:
    """A whole answer that closes the connection, JSON body as on every listener."""
    body = orjson.dumps({"Error": text})
    reason = REASONS.get(status, b"Error")
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % (status, reason, len(body)) + body


class _Parser(Protocol):
    def feed_data(self, data: memoryview) -> None: ...


class HeadMeter:
    """Counts the bytes of the request head being read; the protocol calls `head_done` from the parser's
    on_headers_complete and `message_done` from on_message_complete.

    A head that begins in the middle of a read (after a pipelined request's body) is counted from the next
    read on: the cap holds within one read's size (uvloop reads 256 KiB at most)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reading = True  # the next byte belongs to a request head
        self.size = 0
        self._messages = 0

    @property
    def idle(self) -> bool:
        """No part of a request has been read since the last one ended."""
        return self.reading and self.size == 0

    def head_done(self) -> None:
        self.reading, self.size = False, 0

    def message_done(self) -> None:
        self.reading, self.size = True, 0
        self._messages += 1

    def feed(self, parser: _Parser, data: bytes) -> bool:
        """Feed `data` to `parser`, a head's bytes at most limit + 1 at a time; False (the rest unfed) once
        a head passes the limit. The parser's own exceptions pass through."""
        view = memoryview(data)
        while view:
            if self.reading:
                cut = self.limit - self.size + 1
                piece, view = view[:cut], view[cut:]
            else:
                piece, view = view, view[len(view) :]
            was, messages = self.reading, self._messages
            parser.feed_data(piece)
            if was and self.reading and messages == self._messages:
                self.size += len(piece)
                if self.size > self.limit:
                    return False
        return True

    def read(self, parser: _Parser, data: bytes) -> tuple[int, str] | None:
        """`feed`, with what to answer when the bytes cannot be served: the status and text of the refusal
        (an upgrade, bytes that are not HTTP/1.1, a head over the limit), or None when all is well."""
        try:
            fits = self.feed(parser, data)
        except httptools.HttpParserUpgrade:
            return 400, "protocol upgrades are not served here"
        except httptools.HttpParserError as e:
            return 400, f"not an HTTP/1.1 request: {e}"
        return None if fits else (431, head_too_large(self.limit))


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
    body_paths: frozenset[str] = frozenset()  # POST paths whose body the app reads: 100 Continue only there

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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # The connection was counted by the `Gate` that handed it over (before its TLS handshake).
        super().connection_made(transport)
        self._tls = tls_extension(transport)
        # The first request's head and body from the moment the connection is handed over: one that sends
        # nothing is closed then.
        self._read.start(self.limits.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._read.cancel()
        self._stall.cancel()
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
        refused = self._meter.read(self.parser, data)
        if refused is not None:
            self._refuse(*refused)

    def on_headers_complete(self) -> None:
        self._meter.head_done()
        if self.expect_100_continue:
            path = httptools.parse_url(self.url).path.decode("latin-1")
            wanted = self.parser.get_method() == b"POST" and path in self.body_paths
            self.expect_100_continue = wanted and self.parser.get_http_version() == "1.1"
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._meter.message_done()
        self._read.cancel()
        super().on_message_complete()

    def on_response_complete(self) -> None:
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
        close_notify for asyncio's 30 s)."""
        self.transport.close()
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


def bounded_protocol(limits: ListenerLimits, body_paths: frozenset[str] = frozenset()) -> type[BoundedHttpTools]:
    """The protocol class for one listener (uvicorn's `Config(http=...)`); `body_paths`: the POST paths
    whose body the listener reads."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"limits": limits, "body_paths": body_paths})


# ---------------------------------------------------------------------------------------------- the gate


class Slots:
    """The connections one listener holds, in all and per client address, each from its accept to its
    close (whether its handshake succeeds, fails or times out)."""

    def __init__(self, limits: ListenerLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_peer: collections.Counter[str] = collections.Counter()
        self.handshakes: set[asyncio.Task[None]] = set()  # held here: the loop keeps only weak references

    def take(self, peer: str) -> str | None:
        """Count a connection from `peer`; or the refusal's text when it does not fit (nothing counted)."""
        if self.total >= self.limits.max_connections:
            return TOO_MANY
        if self.per_peer[peer] >= self.limits.max_connections_per_peer:
            return TOO_MANY_FROM_PEER
        self.total += 1
        self.per_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_peer[peer] -= 1
        if not self.per_peer[peer]:
            del self.per_peer[peer]


class HandshakePace:
    """A token bucket per client address for starting TLS handshakes: `rate` a second, bursts of `rate`
    (at least one).

    `delay(peer)` reserves the address's next start and says how long its connection waits for it (0: at
    once), or None when that wait would not end within `within_s` (the connection is then closed before its
    handshake). A waiting connection keeps its slot and its handshake timeout runs from the accept, so a
    flood from one address is bounded in connections (`Slots`) and in handshake CPU (here), while other
    addresses, the API server's, start theirs at once."""

    def __init__(self, rate: float, within_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.within_s = within_s
        self.clock = clock
        self._peers: dict[str, tuple[float, float]] = {}  # peer -> (tokens, when counted); tokens may go below 0

    def delay(self, peer: str) -> float | None:
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        burst = max(1.0, self.rate)
        tokens, then = self._peers.get(peer, (burst, now))
        tokens = min(burst, tokens + (now - then) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        if wait >= self.within_s:
            self._peers[peer] = (tokens, now)
            return None
        if len(self._peers) >= _MAX_PACED_PEERS and peer not in self._peers:
            self._forget_rested(now)
        self._peers[peer] = (tokens - 1, now)
        return wait

    def _forget_rested(self, now: float) -> None:
        burst = max(1.0, self.rate)
        rested = [p for p, (t, then) in self._peers.items() if t + (now - then) * self.rate >= burst]
        for p in rested:
            del self._peers[p]


class Slot:
    """One connection's place in `Slots`, given back once, however the connection ends."""

    def __init__(self, slots: Slots, peer: str) -> None:
        self.slots = slots
        self.peer = peer
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slots.release(self.peer)


class Gate:
    """The accept loop of the webhook or metrics listener: every connection is counted (`Slots`) as it is
    accepted, before any byte is read.

    One that does not fit is closed at once: over plain TCP after a 503, over TLS before the handshake (an
    answer would cost the very handshake the refusal spares). The others become transports with
    `loop.connect_accepted_socket` (asyncio and uvloop alike), over TLS with the handshake timeout; the
    protocol made by `make()` gives the slot back when the connection ends (`BoundedHttpTools.on_lost`),
    and a handshake that fails or times out gives it back here. A listening socket read by the loop's own
    server would hand a connection over only after its handshake, and the loop would read its ClientHello
    before a `start_tls` could take it."""

    def __init__(self, slots: Slots, make: Callable[[], BoundedHttpTools], tls: ssl.SSLContext | None = None) -> None:
        self.slots = slots
        self.make = make
        self.tls = tls
        self.task: asyncio.Task[None] | None = None
        limits = slots.limits
        self.pace = HandshakePace(limits.handshakes_per_peer_per_s, limits.handshake_timeout_s)

    def start(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.task = asyncio.get_running_loop().create_task(self._accept(sock))

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def wait_closed(self) -> None:
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(sock)
            except OSError as e:  # out of open files: let the connections in hand end first
                log.warning("cannot accept a connection", extra={"error": str(e)})
                await asyncio.sleep(0.1)
                continue
            self._admit(conn, address)

    def _admit(self, conn: socket.socket, address: Any) -> None:
        peer = str(address[0]) if isinstance(address, tuple) and address else "?"
        refused = self.slots.take(peer)
        if refused is not None:
            if self.tls is None:
                with contextlib.suppress(OSError):  # a few hundred bytes: the socket's buffer takes them
                    conn.send(refusal(503, refused))
            conn.close()
            return
        wait = self.pace.delay(peer) if self.tls is not None else 0.0
        if wait is None:  # this address starts handshakes faster than its pace for longer than the timeout
            self.slots.release(peer)
            conn.close()
            return
        slot = Slot(self.slots, peer)
        task = asyncio.get_running_loop().create_task(self._connect(conn, slot, wait))
        self.slots.handshakes.add(task)
        task.add_done_callback(self.slots.handshakes.discard)

    async def _connect(self, conn: socket.socket, slot: Slot, wait: float = 0.0) -> None:
        def protocol() -> BoundedHttpTools:
            made = self.make()
            made.on_lost = slot.release
            return made

        loop = asyncio.get_running_loop()
        timeout = self.slots.limits.handshake_timeout_s - wait if self.tls is not None else None
        try:
            if wait > 0:  # its address's handshake pace (HandshakePace); the timeout runs from the accept
                await asyncio.sleep(wait)
            await loop.connect_accepted_socket(protocol, conn, ssl=self.tls, ssl_handshake_timeout=timeout)
        except BaseException as e:  # timed out, failed, reset, or the server stopping: the slot is free
            conn.close()
            slot.release()
            if not isinstance(e, Exception):
                raise
            log.debug("connection not set up", extra={"peer": slot.peer, "error": repr(e)})
