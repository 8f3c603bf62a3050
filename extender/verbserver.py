"""The verbs listener's HTTP/1.1 server: kube-scheduler's calls, parsed by httptools, each answered in one write.

kube-scheduler makes three calls per scheduled pod on one kept-alive connection. Measured in the throughput
benchmark, uvicorn's per-request work (an asyncio task and the ASGI messages per request, the answer written
as two segments, headers then body) was about a third of the extender's CPU; this protocol parses with the
same C parser uvicorn uses (httptools) and hands the body straight to the `VerbLane`, whose worker threads
decide while the event loop serves other connections. What it serves, on loopback only (settings refuse any
other address):

- POST /filter, /prioritize, /bind, /preempt: `VerbLane.answer` (the same code the ASGI app runs in tests);
- GET /healthz and /readyz: as on every listener (`extender.routers.health.readiness`);
- anything else: 404 (405 for a verb path with another method), a JSON `{"Error": ...}` body.

Bodies over `--max-request-bytes` get 413 and the connection is closed, by declared length before any of it
is read, and by counting chunked bodies as they arrive. A request that is not HTTP/1.x gets 400 and the
connection is closed. Requests on one connection are answered in order (pipelined requests wait their
turn; reading pauses while a few are queued).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import httptools
import orjson

from extender.limits import too_large_body
from extender.routers.health import HEALTHY
from extender.routers.scheduler import VERBS, Answer, Verb

if TYPE_CHECKING:
    import socket
    from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("gputopo.extender.http")

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large"}
_REASONS |= {500: b"Internal Server Error", 503: b"Service Unavailable"}
MAX_QUEUED = 8  # pipelined requests held per connection before reading pauses


@dataclass
class _Request:
    method: bytes
    path: str
    body: bytes
    keep_alive: bool


class Lane(Protocol):
    """What the server hands requests to: `extender.routers.scheduler.VerbLane` (or a benchmark's floor)."""

    max_request_bytes: int

    def pool_for(self, verb: str) -> ThreadPoolExecutor:
        """The worker pool `verb` runs on."""
        ...

    def answer(self, verb: str, handler: Verb, body: bytes) -> Answer: ...

    def after(self, verb: str) -> None:
        """Called on the loop once an answer to `verb` is written."""
        ...

    def ready(self, verb: str, body: bytes) -> Answer | None:
        """An answer the loop may send at once, without a worker (None: hand the call to a worker)."""
        ...

    def readiness(self) -> tuple[int, bytes]: ...


def _error(text: str) -> bytes:
    return orjson.dumps({"Error": text})


class VerbProtocol(asyncio.Protocol):
    """One connection. httptools calls the `on_*` methods while `data_received` feeds it."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.limit = lane.max_request_bytes
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()  # made by the server's loop, for the connection it accepted
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[_Request] = collections.deque()
        self.busy = False
        self.paused = False
        self._url = b""
        self._chunks: list[bytes] = []
        self._size = 0
        self._refused = False  # a 413 or 400 is on its way: read nothing more

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not served here")
        except httptools.HttpParserError as e:
            self._refuse(400, f"not an HTTP/1.1 request: {e}")

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._chunks, self._size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-length":
            # A declared length over the limit is refused before any of the body is read.
            try:
                declared = int(value) if len(value) <= 20 else -1
            except ValueError:
                declared = -1
            if declared < 0 or declared > self.limit:
                self._refuse(413, too_large_body(self.limit))
                raise httptools.HttpParserError("body too large")  # stops this feed; nothing more is read
        elif name.lower() == b"expect" and value.lower() == b"100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.limit:
            self._refuse(413, too_large_body(self.limit))
            raise httptools.HttpParserError("body too large")
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        path = httptools.parse_url(self._url).path.decode("latin-1")
        self.queue.append(_Request(self.parser.get_method(), path, body, self.parser.should_keep_alive()))
        if len(self.queue) >= MAX_QUEUED and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._next()

    # ------------------------------------------------------------------ answering

    def _next(self) -> None:
        if self.busy or not self.queue or self.transport is None:
            return
        req = self.queue.popleft()
        if self.paused and len(self.queue) < MAX_QUEUED // 2:
            self.paused = False
            self.transport.resume_reading()
        verb = VERBS.get(req.path)
        if verb is None:
            status, data = self._direct(req)
            self._send(req, status, data)
            return
        if req.method != b"POST":
            self._send(req, 405, _error(f"{req.path} takes POST"))
            return
        name, handler = verb
        ready = self.lane.ready(name, req.body)
        if ready is not None:
            self._send(req, *ready)
            return
        self.busy = True
        try:
            future = self.lane.pool_for(name).submit(self.lane.answer, name, handler, req.body)
        except RuntimeError:  # the pools are shut down: the server is stopping
            self.busy = False
            self._send(req, 503, _error("gputopo-extender is shutting down"))
            return
        # The worker hands the finished future straight back to the loop: no asyncio Future chained to it
        # (run_in_executor's wrapping was a tenth of the loop's time in the throughput benchmark).
        loop = self.loop

        def finished(f: Future[Answer]) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the server stopped, nobody waits for it
                loop.call_soon_threadsafe(self._done, req, name, f)

        future.add_done_callback(finished)

    def _done(self, req: _Request, verb: str, future: Future[Answer]) -> None:
        self.busy = False
        if future.cancelled():
            status, data = 503, _error("gputopo-extender is shutting down")
        elif (exc := future.exception()) is not None:  # `answer` catches everything; this is the last resort
            log.error("unhandled error", extra={"path": req.path, "error": repr(exc)})
            status, data = 500, _error(f"internal: {type(exc).__name__}: {exc}")
        else:
            status, data = future.result()
        # `after` runs once the answer is written and before anything else is read: a later callback could
        # run after the next request, which may be the very prioritize it prepares.
        self._send(req, status, data, after=verb if status == 200 else "")

    def _direct(self, req: _Request) -> tuple[int, bytes]:
        if req.method == b"GET" and req.path == "/healthz":
            return 200, HEALTHY
        if req.method == b"GET" and req.path == "/readyz":
            return self.lane.readiness()
        return 404, _error(f"{req.path} is not served on this listener")

    def _send(self, req: _Request, status: int, data: bytes, *, close: bool = False, after: str = "") -> None:
        """Write the answer; then `lane.after(after)` when `after` names a verb; then the next request."""
        transport = self.transport
        if transport is None:
            return
        close = close or not req.keep_alive
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
            status,
            _REASONS.get(status, b"Unknown"),
            len(data),
            b"connection: close\r\n" if close else b"",
        )
        transport.write(head + data)  # one write: one segment for a small answer
        if after:
            self.lane.after(after)
        if close:
            transport.close()
            self.transport = None
            return
        self._next()

    def _refuse(self, status: int, text: str) -> None:
        """Answer now and close: the rest of what the client sends is never read."""
        if self._refused:
            return
        self._refused = True
        self.queue.clear()
        self._send(_Request(b"", "", b"", False), status, _error(text), close=True)


class VerbServer:
    """The verbs listener on an already bound socket, with uvicorn.Server's surface that `serve` uses."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.should_exit = False
        self.started = False

    async def serve(self, sockets: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(lambda: VerbProtocol(self.lane), sock=s, backlog=2048) for s in sockets]
        self.started = True
        try:
            while not self.should_exit:
                await asyncio.sleep(0.1)
        finally:
            for server in servers:
                server.close()
