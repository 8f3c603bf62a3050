"""Limits every listener holds to (docs/extender.md, "Listeners"): a request-head cap, a read deadline per
request, a keep-alive idle timeout, a cap on open connections and a stalled-write timeout.

- `HeadMeter` counts a request head's bytes before the parser sees them: httptools joins a header's pieces
  itself, so a cap checked in its callbacks comes after it has copied the whole header (a 220 MB header took
  the process from 54 to 615 MiB). The verbs server (`extender.verbserver`) and `BoundedHttpTools` feed
  through it.
- `BoundedHttpTools` is uvicorn's httptools protocol with those limits, for the webhook and metrics
  listeners. uvicorn arms its keep-alive timer only after an answer, so a connection that sent nothing was
  held forever; it has no head cap; and its 400 on a bad request overtook a pipelined answer in progress.
  Refusals here wait for the answers before them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from extender.settings import Settings

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# Longer than the 90 s that Go's HTTP clients (kube-scheduler's, the API server's) keep an idle connection:
# the server then never closes one the client is about to reuse.
DEFAULT_IDLE_TIMEOUT_S = 120.0
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 256

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Payload Too Large"}
REASONS |= {431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


@dataclass(frozen=True)
class ListenerLimits:
    """What one listener allows (the settings of the same names, docs/configuration.md)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # head and body of one request, from its first byte
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # a kept-alive connection with nothing to do
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once, per listener

    @classmethod
    def of(cls, settings: Settings) -> ListenerLimits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            read_timeout_s=settings.read_timeout_seconds,
            idle_timeout_s=settings.idle_timeout_seconds,
            max_connections=settings.max_connections,
        )


def head_too_large(limit: int) -> str:
    return f"request head is larger than {limit} bytes (--max-header-bytes)"


def read_too_slow(seconds: float) -> str:
    return f"request not received within {seconds:g} s (--read-timeout-seconds)"


TOO_MANY = "too many open connections on this listener (--max-connections)"


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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, TOO_MANY)
            return
        # The first request's head and body from the moment the connection is accepted: one that sends
        # nothing is closed then.
        self._read.start(self.limits.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._read.cancel()
        self._stall.cancel()
        super().connection_lost(exc)

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


def bounded_protocol(limits: ListenerLimits, body_paths: frozenset[str] = frozenset()) -> type[BoundedHttpTools]:
    """The protocol class for one listener (uvicorn's `Config(http=...)`); `body_paths`: the POST paths
    whose body the listener reads."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"limits": limits, "body_paths": body_paths})
