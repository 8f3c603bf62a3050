"""The verbs server's pipelining (`gputopo.extender.http.verbserver`): the requests read on one connection, answered one
at a time and in order, refusals included; reading pauses while a few are queued or while the client does not read
its answers; a 100 Continue goes out only once every earlier answer is written."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Protocol

from gputopo.extender.http.dispatch import SHUTTING_DOWN, Answer, Dispatch
from gputopo.extender.http.framing import Request, RequestReader
from gputopo.extender.http.timers import Deadlines

if TYPE_CHECKING:
    from concurrent.futures import Future

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large"}
_REASONS |= {500: b"Internal Server Error", 503: b"Service Unavailable"}
MAX_QUEUED = 8  # pipelined requests held per connection before reading pauses


class Connection(Protocol):
    """What the pipeline uses of its connection (`gputopo.extender.http.verbserver.VerbProtocol`)."""

    transport: asyncio.Transport | None  # None once closed
    refused: bool  # a refusal is queued: read nothing more
    clock: Deadlines

    def close(self) -> None: ...

    def rearm(self) -> None: ...


class Pipeline:
    """The connection's queue of requests and the one being answered."""

    def __init__(self, conn: Connection, reader: RequestReader, dispatch: Dispatch) -> None:
        self.conn = conn
        self.reader = reader
        self.dispatch = dispatch
        self.queue: collections.deque[Request] = collections.deque()
        self.busy = False  # a worker has the request being answered
        self.reading = True
        self.writing = True  # False while the transport's write buffer is over its high-water mark

    @property
    def answering(self) -> bool:
        return self.busy or bool(self.queue)

    def receive(self, req: Request) -> None:
        self.queue.append(req)
        self.update_reading()
        self.next()

    def update_reading(self) -> None:
        """Read while fewer than MAX_QUEUED requests wait (resuming below half of it) and answers can be
        written; never after a refusal."""
        transport = self.conn.transport
        if transport is None:
            return
        refused = self.conn.refused
        if self.reading and (refused or not self.writing or len(self.queue) >= MAX_QUEUED):
            self.reading = False
            transport.pause_reading()
        elif not self.reading and not refused and self.writing and len(self.queue) < MAX_QUEUED // 2:
            self.reading = True
            transport.resume_reading()

    def next(self) -> None:
        if self.busy or not self.queue or self.conn.transport is None or not self.writing:
            return
        req = self.queue.popleft()
        self.update_reading()
        if req.refusal is not None:
            self.write(req.refusal, close=True)
            return
        name, pool, answer = self.dispatch.plan(req.method, req.path, req.body)
        if answer is not None:
            self.send(req, *answer)
            return
        assert pool is not None  # `plan` answers at once whatever has no pool
        self.busy = True
        if not self.dispatch.submit(pool, name, req.body, lambda f: self._done(req, name, f)):
            self.busy = False
            self.send(req, *SHUTTING_DOWN)

    def _done(self, req: Request, verb: str, future: Future[Answer]) -> None:
        self.busy = False
        status, data = self.dispatch.outcome(req.path, future)
        # `after` runs once the answer is written and before anything else is read: a later callback could
        # run after the next request, which may be the very prioritize it prepares.
        self.send(req, status, data, after=verb if status == 200 else "")

    def send(self, req: Request, status: int, data: bytes, *, after: str = "") -> None:
        """Write the answer (no body to a HEAD); then `door.after(after)` when `after` names a verb; then
        the next request. The request's body budget is given back first, answered or not."""
        self.reader.give_back(req.held)
        req.held = 0
        if self.conn.transport is None:  # the client left: nobody to answer, nothing to prepare
            return
        close = not req.keep_alive
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
            status,
            _REASONS.get(status, b"Unknown"),
            len(data),
            b"connection: close\r\n" if close else b"",
        )
        self.write(head if req.method == b"HEAD" else head + data, close=close)  # one write: one segment
        if after:
            self.dispatch.door.after(after)
        if not close:
            self.next()

    def write(self, answer: bytes, *, close: bool) -> None:
        transport = self.conn.transport
        if transport is None:
            return
        transport.write(answer)
        if close:
            self.conn.close()
        elif not self.queue and not self.busy:
            self.owe_continue()
            self.conn.rearm()

    def drop(self) -> None:
        """The connection ended: the budget its unanswered requests hold goes back (the one a worker has
        goes back when its answer comes, in `send`)."""
        for req in self.queue:
            self.reader.give_back(req.held)
        self.queue.clear()
        self.reader.give_back(self.reader.taken)
        self.reader.taken = 0

    def owe_continue(self) -> None:
        """The 100 Continue a request asked for, once every answer before it is written."""
        transport = self.conn.transport
        if self.reader.expect_continue and not self.busy and not self.queue and transport is not None:
            self.reader.expect_continue = False
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.conn.clock.arm("read")  # the body's read deadline starts now
