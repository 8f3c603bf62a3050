"""The refusals that enforce the limits every listener holds to (docs/extender.md, "Listeners"; the limits themselves
are `gputopo.extender.settings.ListenerLimits`), and `HeadMeter`, which counts a request head's bytes before the parser
sees them: httptools joins a header's pieces itself, so a cap checked in its callbacks comes after it has copied the
whole header (a 220 MB header took the process from 54 to 615 MiB). The verbs server
(`gputopo.extender.http.verbserver`) and `gputopo.extender.http.uvicornprotocol.BoundedHttpTools` feed through it.
"""

from __future__ import annotations

from typing import Protocol

import httptools
import orjson

REASONS = {400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed"}
REASONS |= {408: b"Request Timeout", 413: b"Payload Too Large"}
REASONS |= {431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


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
