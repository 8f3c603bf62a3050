"""The verbs server's request framing (`gputopo.extender.http.verbserver`): httptools' callbacks, fed through the
`HeadMeter` (which caps the head before httptools copies it), the body counted against `--max-request-bytes`,
each whole request handed to the connection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httptools
import orjson

from gputopo.extender.http.bodylimit import too_large_body
from gputopo.extender.http.dispatch import Entry
from gputopo.extender.http.heads import BodyBudget, budget_full
from gputopo.extender.http.refusals import HeadMeter


@dataclass
class Request:
    method: bytes
    path: str
    body: bytes
    keep_alive: bool
    refusal: bytes | None = None  # a whole answer that closes the connection, sent in this request's turn
    held: int = 0  # bytes of the listener's BodyBudget this request holds until it is answered


class Sink(Protocol):
    """What the reader tells its connection."""

    def refuse(self, status: int, text: str) -> None: ...

    def begun(self) -> None:
        """A request's first byte was parsed."""
        ...

    def continue_asked(self) -> None:
        """The head asked for a 100 Continue that is wanted (`RequestReader.expect_continue`)."""
        ...

    def received(self, request: Request) -> None: ...


class RequestReader:
    """One connection's parser and the request it is reading."""

    def __init__(self, door: Entry, max_header_bytes: int, sink: Sink, budget: BodyBudget | None = None) -> None:
        self.door = door
        self.budget = budget  # the listener's, shared by its connections
        self.taken = 0  # of it, what the request being read holds
        self.limit = door.max_request_bytes
        self.sink = sink
        self.parser = httptools.HttpRequestParser(self)
        self.meter = HeadMeter(max_header_bytes)
        self.in_request = False  # between a request's first byte and its end
        self.expect_continue = False  # a 100 Continue is owed once every earlier answer is written
        self._url: list[bytes] = []
        self._chunks: list[bytes] = []
        self._size = 0
        self._has_body = False  # the head declares a body (a length over 0, or chunked)
        self._declared = 0
        self._chunked = False

    def feed(self, data: bytes) -> tuple[int, str] | None:
        """Parse `data`; the refusal to send when it cannot be served (`HeadMeter.read`)."""
        return self.meter.read(self.parser, data)

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._chunks, self._size, self.expect_continue = [], [], 0, False
        self._has_body, self._declared, self._chunked = False, 0, False
        self.in_request = True
        self.sink.begun()

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
                self.sink.refuse(413, too_large_body(self.limit))
                raise httptools.HttpParserError("body too large")  # stops this feed; nothing more is read
            self._has_body = self._has_body or declared > 0
            self._declared = declared
        elif name.lower() == b"transfer-encoding":
            self._has_body = self._chunked = True
        elif name.lower() == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True

    def on_headers_complete(self) -> None:
        self.meter.head_done()
        if not (self.expect_continue or self._has_body):
            return
        path = httptools.parse_url(b"".join(self._url)).path.decode("latin-1")
        method = self.parser.get_method()
        verb = self.door.route(method, path)
        wanted = isinstance(verb, str) and self.door.reads_body(verb)
        if self._has_body and not wanted:
            # A body no verb reads is refused from the head, unread: the route's own 404 or 405, else 413.
            if isinstance(verb, str):
                self.sink.refuse(413, f"{method.decode('latin-1')[:16]} {path} takes no request body")
            else:
                self.sink.refuse(verb[0], str(orjson.loads(verb[1])["Error"]))
            raise httptools.HttpParserError("a body no verb reads")
        if self._has_body and not self._take(self._declared):
            raise httptools.HttpParserError("over the body budget")
        if self.expect_continue:
            # Only a verb's body is wanted, and only from an HTTP/1.1 client.
            self.expect_continue = wanted and self.parser.get_http_version() == "1.1"
            self.sink.continue_asked()

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.limit:
            self.sink.refuse(413, too_large_body(self.limit))
            raise httptools.HttpParserError("body too large")
        if self._chunked and not self._take(len(body)):
            raise httptools.HttpParserError("over the body budget")
        self._chunks.append(body)

    def _take(self, size: int) -> bool:
        """Hold `size` more bytes of the listener's budget for this request; refuse it (503) when they do
        not fit."""
        if self.budget is None or size == 0:
            return True
        if not self.budget.take(size):
            self.sink.refuse(503, budget_full(self.budget.limit))
            return False
        self.taken += size
        return True

    def give_back(self, size: int) -> None:
        if self.budget is not None:
            self.budget.give(size)

    def on_message_complete(self) -> None:
        self.meter.message_done()
        self.expect_continue = False
        self.in_request = False
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        path = httptools.parse_url(url).path.decode("latin-1")
        held, self.taken = self.taken, 0
        self.sink.received(Request(self.parser.get_method(), path, body, self.parser.should_keep_alive(), held=held))
