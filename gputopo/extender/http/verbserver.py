"""The verbs listener's HTTP/1.1 server: kube-scheduler's calls, parsed by httptools, each answered in one write.

kube-scheduler makes three calls per scheduled pod on one kept-alive connection. Measured in the throughput benchmark,
uvicorn's per-request work (an asyncio task and the ASGI messages per request, the answer written as two segments,
headers then body) was about a third of the extender's CPU; this protocol parses with the same C parser uvicorn uses
(httptools) and hands the body straight to the one door into the verbs (`gputopo.extender.verbs.door.Door.answer`, the
same entry the unit tests call), on the door's worker threads, so the event loop serves other connections while a
decision runs. What it serves, on loopback only (settings refuse any other address), is what `Door.route` names:

- POST /filter, /prioritize, /bind, /preempt on worker threads; GET (HEAD) /healthz and /readyz on the loop;
- anything else: 404 (405 for a verb path with another method), a JSON `{"Error": ...}` body.

Once a filter's answer is written the server calls `Door.after`, and before handing a prioritize to a worker
`Door.ready`: the prioritize-ahead memory's hooks (`gputopo.extender.verbs.ahead`).

Bodies over `--max-request-bytes` get 413 and the connection is closed, by declared length before any of it is read, and
by counting chunked bodies as they arrive; a body to a path no verb reads is refused from its head (404, 405, 413),
unread; the bodies held at once over all connections stay within `--max-body-bytes-in-flight` (`BodyBudget`: a request
holds its declared length from its head until it is answered; past it 503). A request that is not HTTP/1.x gets 400 and
the connection is closed. The limits of `gputopo.extender.http.uvicornprotocol` hold: a head over `--max-header-bytes`
gets 431, a request not read within `--read-timeout-seconds` 408 (a connection that sent nothing is just closed), an
idle connection is closed after `--idle-timeout-seconds`, connections past `--max-connections` get 503. Requests on one
connection are answered in order, refusals included (pipelined requests wait their turn; reading pauses while a few are
queued or while the client does not read its answers). HEAD gets no body; `100 Continue` goes out only for a body the
door reads, once every earlier answer is written.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

from gputopo.extender.http.dispatch import Answer, Dispatch, Entry
from gputopo.extender.http.framing import Request, RequestReader
from gputopo.extender.http.heads import BodyBudget
from gputopo.extender.http.pipeline import Pipeline
from gputopo.extender.http.refusals import TOO_MANY, read_too_slow, refusal
from gputopo.extender.http.timers import Deadlines
from gputopo.extender.settings import ListenerLimits

if TYPE_CHECKING:
    import socket

__all__ = ["Answer", "Entry", "VerbProtocol", "VerbServer"]


class VerbProtocol(asyncio.Protocol):
    """One connection: its framing (`RequestReader`), its answers in order (`Pipeline`, door calls through
    `Dispatch`) and its one deadline (`Deadlines`); it holds what they share: the transport and the refusal."""

    def __init__(
        self, door: Entry, limits: ListenerLimits, connections: set[VerbProtocol], budget: BodyBudget | None = None
    ) -> None:
        self.limits = limits
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()  # made by the server's loop, for the connection it accepted
        self.refused = False  # a 431, 413, 408 or 400 is queued: read nothing more
        self._closing: asyncio.Transport | None = None  # closed by us, its answers still flushing
        self.reader = RequestReader(door, limits.max_header_bytes, self, budget)
        self.clock = Deadlines(self.loop, limits, read=self._read_timed_out, idle=self.close, stall=self._stalled)
        self.answers = Pipeline(self, self.reader, Dispatch(door, self.loop))

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.connections.add(self)
        if len(self.connections) > self.limits.max_connections:
            self.refuse(503, TOO_MANY)
            return
        # The first request's head and body from the moment the connection is accepted: a connection that
        # sends nothing is closed then.
        self.clock.arm("read")

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self.clock.disarm()
        self.transport = self._closing = None
        self.answers.drop()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        refused = self.reader.feed(data)
        if refused is not None:
            self.refuse(*refused)

    def pause_writing(self) -> None:
        # Answers wait (and reading stops) until the client reads what is written; one that never does is
        # cut off after the read timeout.
        self.answers.writing = False
        self.answers.update_reading()
        self.clock.arm("stall")

    def resume_writing(self) -> None:
        self.answers.writing = True
        self.clock.disarm()
        self.answers.update_reading()
        self.answers.next()
        self.rearm()

    # ------------------------------------------------------------------ what the reader tells

    def begun(self) -> None:
        self.rearm()

    def continue_asked(self) -> None:
        self.answers.owe_continue()

    def received(self, request: Request) -> None:
        self.answers.receive(request)
        self.rearm()

    def refuse(self, status: int, text: str) -> None:
        """Stop reading; answer `status` in this request's turn, after the answers before it, and close."""
        if self.refused:
            return
        self.refused = True
        self.reader.expect_continue = False
        if self.clock.kind != "stall":
            self.clock.disarm()
        self.answers.receive(Request(b"", "", b"", False, refusal=refusal(status, text)))

    # ------------------------------------------------------------------ deadlines and the close

    def rearm(self) -> None:
        """The deadline for what the connection does now (`Deadlines.follow`); none after a refusal."""
        if self.transport is None or self.refused:
            return
        self.clock.follow(self.reader.in_request, self.answers.answering)

    def _read_timed_out(self) -> None:
        if self.reader.expect_continue:  # the body waits for our 100 Continue (after earlier answers): not late
            self.clock.arm("read")
            return
        if not self.reader.in_request and not self.answers.answering:
            self.close()  # nothing of a request arrived: nobody to answer
        else:
            self.refuse(408, read_too_slow(self.limits.read_timeout_s))

    def _stalled(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def close(self) -> None:
        """Close once what is written is flushed; a client that does not read it is cut off after the read
        timeout (a closed transport otherwise waits for the flush forever)."""
        self.clock.disarm()
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
        self.budget = BodyBudget(self.limits.max_body_bytes_in_flight)  # request bodies held, all connections
        self.should_exit = False
        self.started = False

    async def serve(self, sockets: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        servers = [
            await loop.create_server(
                lambda: VerbProtocol(self.door, self.limits, self.connections, self.budget), sock=s, backlog=2048
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
