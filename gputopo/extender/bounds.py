"""Limits every listener holds to (docs/extender.md, "Listeners"): what they are (`ListenerLimits`), the refusals
that enforce them, and `HeadMeter`, which counts a request head's bytes before the parser sees them: httptools
joins a header's pieces itself, so a cap checked in its callbacks comes after it has copied the whole header (a
220 MB header took the process from 54 to 615 MiB). The verbs server (`gputopo.extender.verbserver`) and
`gputopo.extender.bounded.BoundedHttpTools` feed through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httptools
import orjson

from gputopo.extender.limits import DEFAULT_MAX_REQUEST_BYTES

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
# Request bodies one listener holds at once, over all its connections: four of the largest the verbs take
# (--max-request-bytes, 8 MiB). Parsed, a body costs a few times its size: 32 MiB of them stays well inside
# the chart's 1 GiB memory limit, while the API server's reviews (a pod, at most etcd's 1.5 MiB, twice) fit
# many at once.
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 32 * 1024 * 1024

REASONS = {400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed"}
REASONS |= {408: b"Request Timeout", 413: b"Payload Too Large"}
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
    max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT  # request bodies held at once, all connections
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # one body (an address's share of the above is at least this)

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
            max_body_bytes_in_flight=settings.max_body_bytes_in_flight,
            max_request_bytes=settings.max_request_bytes,
        )

    @property
    def body_bytes_per_peer(self) -> int:
        """One client address's share of `max_body_bytes_in_flight` on the webhook: a quarter, and at least
        one body of `max_request_bytes`."""
        return min(self.max_body_bytes_in_flight, max(self.max_body_bytes_in_flight // 4, self.max_request_bytes))


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
