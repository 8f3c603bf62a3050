"""The verbs listener's HTTP/1.1 server: kube-scheduler's calls, parsed by httptools, each answered in one write.

kube-scheduler makes three calls per scheduled pod on one kept-alive connection. Measured in the throughput
benchmark, uvicorn's per-request work (an asyncio task and the ASGI messages per request, the answer written
as two segments, headers then body) was about a third of the extender's CPU; this protocol parses with the
same C parser uvicorn uses (httptools) and hands the body straight to the one door into the verbs
(`gputopo.extender.door.Door.answer`, the same entry the unit tests call), on the door's worker threads, so the event
loop serves other connections while a decision runs. What it serves, on loopback only (settings refuse any
other address), is what `Door.route` names:

- POST /filter, /prioritize, /bind, /preempt on worker threads; GET (HEAD) /healthz and /readyz on the loop;
- anything else: 404 (405 for a verb path with another method), a JSON `{"Error": ...}` body.

Once a filter's answer is written the server calls `Door.after`, and before handing a prioritize to a worker
`Door.ready`: the prioritize-ahead memory's hooks (`gputopo.extender.ahead`).

Bodies over `--max-request-bytes` get 413 and the connection is closed, by declared length before any of it
is read, and by counting chunked bodies as they arrive. A request that is not HTTP/1.x gets 400 and the
connection is closed. The limits of `gputopo.extender.bounded` hold: a head over `--max-header-bytes` gets 431, a
request not read within `--read-timeout-seconds` 408 (a connection that sent nothing is just closed), an
idle connection is closed after `--idle-timeout-seconds`, connections past `--max-connections` get 503.
Requests on one connection are answered in order, refusals included (pipelined requests wait their turn;
reading pauses while a few are queued or while the client does not read its answers). HEAD gets no body;
`100 Continue` goes out only for a body the door reads, once every earlier answer is written.
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

from gputopo.extender.bounded import TOO_MANY, HeadMeter, ListenerLimits, read_too_slow, refusal
from gputopo.extender.limits import too_large_body

if TYPE_CHECKING:
    import socket
    from concurrent.futures import Executor, Future

Answer = tuple[int, bytes]  # HTTP status, JSON body

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
    refusal: bytes | None = None  # a whole answer that closes the connection, sent in this request's turn


class Entry(Protocol):
    """What the server hands requests to: `gputopo.extender.door.Door` (or a benchmark's floor)."""

    max_request_bytes: int

    def route(self, method: bytes, path: str) -> str | Answer:
        """The verb a request names, or the answer to a request that names none."""
        ...

    def reads_body(self, verb: str) -> bool: ...

    def pool_for(self, verb: str) -> Executor | None:
        """The worker pool `verb` runs on (None: on the loop)."""
        ...

    def answer(self, verb: str, body: bytes) -> Answer: ...

    def after(self, verb: str) -> None:
        """Called on the loop once a 200 answer to `verb` is written."""
        ...

    def ready(self, verb: str, body: bytes) -> Answer | None:
        """An answer the loop may send at once, without a worker (None: hand the call to a worker)."""
        ...


def _error(text: str) -> bytes:
    return orjson.dumps({"Error": text})


class VerbProtocol(asyncio.Protocol):
    """One connection. httptools calls the `on_*` methods while `data_received` feeds it (through the
    `HeadMeter`, which caps the head before httptools copies it)."""

    def __init__(self, door: Entry, limits: ListenerLimits, connections: set[VerbProtocol]) -> None:
        self.door = door
        self.limit = door.max_request_bytes
        self.limits = limits
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()  # made by the server's loop, for the connection it accepted
        self.parser = httptools.HttpRequestParser(self)
        self.meter = HeadMeter(limits.max_header_bytes)
        self.queue: collections.deque[_Request] = collections.deque()
        self.busy = False
        self.reading = True
        self.writing = True  # False while the transport's write buffer is over its high-water mark
        self._url: list[bytes] = []
        self._chunks: list[bytes] = []
        self._size = 0
        self._continue = False  # a 100 Continue is owed once every earlier answer is written
        self._refused = False  # a 431, 413, 408 or 400 is queued: read nothing more
        self._in_request = False  # between a request's first byte and its end
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""  # read | idle | stall
        self._closing: asyncio.Transport | None = None  # closed by us, its answers still flushing

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.connections.add(self)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, TOO_MANY)
            return
        # The first request's head and body from the moment the connection is accepted: a connection that
        # sends nothing is closed then.
        self._arm("read")

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._disarm()
        self.transport = self._closing = None
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        refused = self.meter.read(self.parser, data)
        if refused is not None:
            self._refuse(*refused)

    def pause_writing(self) -> None:
        # Answers wait (and reading stops) until the client reads what is written; one that never does is
        # cut off after the read timeout.
        self.writing = False
        self._update_reading()
        self._arm("stall")

    def resume_writing(self) -> None:
        self.writing = True
        self._disarm()
        self._update_reading()
        self._next()
        self._rearm()

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._chunks, self._size, self._continue = [], [], 0, False
        self._in_request = True
        self._rearm()

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

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
        elif name.lower() == b"expect" and value.lower() == b"100-continue":
            self._continue = True

    def on_headers_complete(self) -> None:
        self.meter.head_done()
        if self._continue:
            # Only a verb's body is wanted, and only from an HTTP/1.1 client; any other request is
            # answered once its body has come anyway (the client sends it after its own wait).
            path = httptools.parse_url(b"".join(self._url)).path.decode("latin-1")
            verb = self.door.route(self.parser.get_method(), path)
            wanted = isinstance(verb, str) and self.door.reads_body(verb)
            self._continue = wanted and self.parser.get_http_version() == "1.1"
            self._owe_continue()

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.limit:
            self._refuse(413, too_large_body(self.limit))
            raise httptools.HttpParserError("body too large")
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self.meter.message_done()
        self._continue = False
        self._in_request = False
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        path = httptools.parse_url(url).path.decode("latin-1")
        self.queue.append(_Request(self.parser.get_method(), path, body, self.parser.should_keep_alive()))
        self._update_reading()
        self._next()
        self._rearm()

    # ------------------------------------------------------------------ answering

    def _update_reading(self) -> None:
        """Read while fewer than MAX_QUEUED requests wait (resuming below half of it) and answers can be
        written; never after a refusal."""
        if self.transport is None:
            return
        if self.reading and (self._refused or not self.writing or len(self.queue) >= MAX_QUEUED):
            self.reading = False
            self.transport.pause_reading()
        elif not self.reading and not self._refused and self.writing and len(self.queue) < MAX_QUEUED // 2:
            self.reading = True
            self.transport.resume_reading()

    def _next(self) -> None:
        if self.busy or not self.queue or self.transport is None or not self.writing:
            return
        req = self.queue.popleft()
        self._update_reading()
        if req.refusal is not None:
            self._write(req.refusal, close=True)
            return
        door = self.door
        name = door.route(req.method, req.path)
        if not isinstance(name, str):  # 404, 405
            self._send(req, *name)
            return
        pool = door.pool_for(name)
        if pool is None:  # healthz, readyz: on the loop, so they answer while every worker decides
            self._send(req, *door.answer(name, req.body))
            return
        ready = door.ready(name, req.body)
        if ready is not None:
            self._send(req, *ready)
            return
        self.busy = True
        try:
            future = pool.submit(door.answer, name, req.body)
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

    def _send(self, req: _Request, status: int, data: bytes, *, after: str = "") -> None:
        """Write the answer (no body to a HEAD); then `door.after(after)` when `after` names a verb; then
        the next request."""
        if self.transport is None:  # the client left: nobody to answer, nothing to prepare
            return
        close = not req.keep_alive
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
            status,
            _REASONS.get(status, b"Unknown"),
            len(data),
            b"connection: close\r\n" if close else b"",
        )
        self._write(head if req.method == b"HEAD" else head + data, close=close)  # one write: one segment
        if after:
            self.door.after(after)
        if not close:
            self._next()

    def _write(self, answer: bytes, *, close: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.write(answer)
        if close:
            self._close()
        elif not self.queue and not self.busy:
            self._owe_continue()
            self._rearm()

    def _owe_continue(self) -> None:
        """The 100 Continue a request asked for, once every answer before it is written."""
        if self._continue and not self.busy and not self.queue and self.transport is not None:
            self._continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._arm("read")  # the body's read deadline starts now

    def _refuse(self, status: int, text: str) -> None:
        """Stop reading; answer `status` in this request's turn, after the answers before it, and close."""
        if self._refused:
            return
        self._refused = True
        self._continue = False
        if self._timer_kind != "stall":
            self._disarm()
        self.queue.append(_Request(b"", "", b"", False, refusal=refusal(status, text)))
        self._update_reading()
        self._next()

    # ------------------------------------------------------------------ timers

    def _rearm(self) -> None:
        """The timer for what the connection does now: a request being read has until its read deadline
        (never restarted by its own bytes), an idle connection until the idle timeout, one that is being
        answered none; a stalled write's timer stays."""
        if self.transport is None or self._refused or self._timer_kind == "stall":
            return
        want = "read" if self._in_request else "" if self.busy or self.queue else "idle"
        if want != self._timer_kind:
            if want:
                self._arm(want)
            else:
                self._disarm()

    def _arm(self, kind: str) -> None:
        self._disarm()
        seconds, fn = {
            "read": (self.limits.read_timeout_s, self._read_timed_out),
            "idle": (self.limits.idle_timeout_s, self._close),
            "stall": (self.limits.read_timeout_s, self._stalled),
        }[kind]
        self._timer, self._timer_kind = self.loop.call_later(seconds, fn), kind

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_kind = None, ""

    def _read_timed_out(self) -> None:
        self._timer, self._timer_kind = None, ""
        if self._continue:  # the body waits for our 100 Continue (after earlier answers): the client is not late
            self._arm("read")
            return
        if not self._in_request and not self.queue and not self.busy:
            self._close()  # nothing of a request arrived: nobody to answer
        else:
            self._refuse(408, read_too_slow(self.limits.read_timeout_s))

    def _stalled(self) -> None:
        self._timer, self._timer_kind = None, ""
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def _close(self) -> None:
        """Close once what is written is flushed; a client that does not read it is cut off after the read
        timeout (a closed transport otherwise waits for the flush forever)."""
        self._disarm()
        transport, self.transport = self.transport, None
        if transport is None:
            return
        transport.close()
        if transport.get_write_buffer_size():  # plain TCP: nothing to wait for once the buffer is empty
            self._closing = transport
            self.loop.call_later(self.limits.read_timeout_s, self._cut)

    def _cut(self) -> None:
        if self._closing is not None:
            self._closing.abort()


class VerbServer:
    """The verbs listener on an already bound socket, with uvicorn.Server's surface that `serve` uses."""

    def __init__(self, door: Entry, limits: ListenerLimits | None = None) -> None:
        self.door = door
        self.limits = limits or ListenerLimits()
        self.connections: set[VerbProtocol] = set()
        self.should_exit = False
        self.started = False

    async def serve(self, sockets: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        servers = [
            await loop.create_server(
                lambda: VerbProtocol(self.door, self.limits, self.connections), sock=s, backlog=2048
            )
            for s in sockets
        ]
        self.started = True
        try:
            while not self.should_exit:
                await asyncio.sleep(0.1)
        finally:
            for server in servers:
                server.close()
