"""The lean transport: every request to one API server, watches included, over kept-alive HTTP/1.1
connections: one pool per `Kube`.

A request is one pre-formatted head and body written with one `sendall` on a pooled socket; an
ordinary answer is framed by `read_answer` (`gputopo.kube.framing`) and read whole (at most
`max_body_bytes`), a watch's is handed out as it arrives (`Stream`); the sockets, their TLS and the
deadlines are `gputopo.kube.connection`'s. Kept over a library by measurement:
one Event or Binding POST to kube-apiserver costs 0.19-0.26 ms of client CPU here, 0.57-0.70 ms
through urllib3's pool, 1.0-1.2 ms through httpx and 0.75-0.91 ms through the `kubernetes`
ApiClient (`bench/kube_writes.py`); the extender makes two per scheduled pod, and its CPU per pod
in `bench/scheduler_throughput.py` went from 4.3 ms (median of 9 rounds) to 5.4 ms on urllib3
(11 rounds, +26%) and 7.6 ms on httpx (3 rounds).
`http.client` parses headers with the email package and writes a request's head and body apart.

What stays the same as through the ApiClient: the configuration's host (with any path prefix), its
TLS settings (CA file or data, client certificate, verify_ssl, tls_server_name, assert_hostname),
the Authorization header taken per request from `configuration.auth_settings()` (which runs the
kubeconfig's or in-cluster loader's refresh hook, so rotated tokens and exec plugins keep working;
a few microseconds, so not cached), the query encoding and the bound on idle connections (the
User-Agent is `gputopo`). `unsupported_reason` names the configurations this does not carry (a proxy, another
scheme); those go through the ApiClient instead, every request and watch (still one pool).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from gputopo.kube.connection import (
    DROPPED,
    Conn,
    Timeout,
    past_deadline,
    socket_options,
    split_timeout,
    ssl_context,
    total_seconds,
    unsupported_reason,
    within,
)
from gputopo.kube.errors import KubeError
from gputopo.kube.framing import (
    MAX_BODY_BYTES,
    RECV_BYTES,
    Answer,
    TooLong,
    ascii_digits,
    chunked_pieces,
    keeps_alive,
    pieces,
    read_answer,
    read_head,
)

# What the client and the tests take from here: the transport's whole surface, wherever it is defined.
__all__ = [
    "MAX_BODY_BYTES",
    "RECV_BYTES",
    "Answer",
    "Conn",
    "Stream",
    "Timeout",
    "TooLong",
    "Transport",
    "past_deadline",
    "query_string",
    "read_answer",
    "total_seconds",
    "unsupported_reason",
]

# Methods whose requests carry a body even when empty; http.client sends Content-Length: 0 for them too.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Anything outside printable ASCII (or a space) in a request target would break the request line.
_UNSAFE_TARGET = re.compile(r"[^\x21-\x7e]")
_TARGET_SAFE = "/:@!$&'()*+,;=-._~%?"


def _header_value(value: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError("a header value holds a line break")
    return value


class _Dropped(Exception):
    """The server closed the connection before any byte of an answer."""


def query_string(pairs: Sequence[tuple[str, str]]) -> str:
    """The query as the `kubernetes` ApiClient encodes it: keys as given, values percent-quoted."""
    return "&".join(f"{k}={quote(v)}" for k, v in pairs)


class Transport:
    """Every request to one API server, watches included, over one thread-safe pool of kept-alive
    connections: ordinary answers are read whole (`request`), watches streamed (`stream`).

    A request takes an idle connection (the most recent first) or opens one; afterwards the
    connection goes back unless the server said it closes, at most `pool_size` stay idle and the
    rest are closed. A connection that died while idle is dropped before use; one that fails as
    the request is sent or before any byte of the answer arrives is retried once, on a new
    connection, when it was a reused one (the server closed it just as the request went out; a
    server that read the request and then died unanswered would see it twice). Once an answer has
    begun nothing is retried."""

    def __init__(
        self, configuration: Any, *, pool_size: int, user_agent: str, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        self.configuration = configuration
        self.max_body_bytes = max_body_bytes
        parts = urlsplit(str(configuration.host))
        self.tls = parts.scheme == "https"
        self.hostname = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.server_hostname = getattr(configuration, "tls_server_name", None) or self.hostname
        # Built at the first connection, once: a missing or bad CA or client-certificate file then
        # fails that request as KubeError, as it did through urllib3, rather than the constructor.
        self._context: ssl.SSLContext | None = None
        self.socket_options = socket_options(configuration)
        self.pool_size = max(1, pool_size)
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        netloc = parts.netloc.rpartition("@")[2]
        self._head_tail = f"Host: {netloc}\r\nUser-Agent: {user_agent}\r\nAccept: application/json\r\n"

    # ------------------------------------------------------------------ connections

    def _connect(self, timeout: float | None) -> Conn:
        sock = socket.create_connection((self.hostname, self.port), timeout)
        try:
            # Each request is one write answered by one read: Nagle's algorithm would only delay it.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for level, option, value in self.socket_options:
                sock.setsockopt(level, option, value)
            if self.tls:
                sock = self.context().wrap_socket(sock, server_hostname=self.server_hostname)
        except BaseException:
            sock.close()
            raise
        return Conn(sock, timeout)

    def context(self) -> ssl.SSLContext:
        """The TLS settings of every connection."""
        if self._context is None:
            with self._lock:
                if self._context is None:
                    self._context = ssl_context(self.configuration)
        return self._context

    def _checkout(self) -> Conn | None:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or not conn.idle_closed():
                return conn
            conn.close()

    def _checkin(self, conn: Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; ones in use are closed when their request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------------ requests

    def _head(self, method: str, target: str, body: bytes | None, content_type: str) -> bytes:
        lines = [f"{method} {target} HTTP/1.1\r\n", self._head_tail]
        auth = self.configuration.auth_settings().get("BearerToken")
        value = str(auth.get("value") or "") if auth else ""
        if value:
            lines.append(f"Authorization: {_header_value(value)}\r\n")
        if body is not None:
            lines.append(f"Content-Type: {_header_value(content_type)}\r\nContent-Length: {len(body)}\r\n")
        elif method in _BODY_METHODS:
            lines.append("Content-Length: 0\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def _target(self, method: str, path: str, query: Sequence[tuple[str, str]], body: bytes | None, ct: str) -> bytes:
        try:
            target = self.prefix + path + (f"?{query_string(query)}" if query else "")
            if _UNSAFE_TARGET.search(target):
                target = quote(target, safe=_TARGET_SAFE)
            data = self._head(method, target, body, ct)
        except (ValueError, UnicodeError) as e:
            raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None
        return data + body if body else data

    def _begin(
        self, method: str, path: str, data: bytes, timeout: Timeout, deadline: float | None, seconds: float | None
    ) -> tuple[Conn, bytearray, Callable[[int], bytes]]:
        """Send the request; the connection, the answer's first bytes and the `recv` for the rest, all
        before `deadline` (when one is given: `seconds` after the request began). A reused connection
        that the server closed before any byte of an answer is replaced once; raises `KubeError`
        status 0."""
        connect_timeout, read_timeout = split_timeout(timeout)
        retried = False
        while True:
            conn = None if retried else self._checkout()
            reused = conn is not None
            try:
                if conn is None:
                    conn = self._connect(within(connect_timeout, deadline, seconds))
                conn.set_timeout(within(read_timeout, deadline, seconds))
                recv = conn.receiver(deadline, seconds)
                try:
                    conn.sock.sendall(data)  # one timeout for the whole send (Python >= 3.5)
                    first = recv(RECV_BYTES)
                except DROPPED as e:
                    raise _Dropped() from e
                if not first:
                    raise _Dropped() from http.client.RemoteDisconnected(
                        "Remote end closed connection without response"
                    )
                return conn, bytearray(first), recv
            except _Dropped as e:
                if conn is not None:
                    conn.close()
                if reused and not retried:
                    retried = True
                    continue
                cause = e.__cause__ or e
                raise KubeError(0, f"{type(cause).__name__}: {cause}", method=method, path=path) from None
            except (OSError, ValueError) as e:
                if conn is not None:
                    conn.close()
                raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None

    def request(
        self,
        method: str,
        path: str,
        query: Sequence[tuple[str, str]],
        body: bytes | None,
        content_type: str,
        timeout: Timeout,
    ) -> tuple[int, bytes]:
        """One request: the answer's status and whole body, within `total_seconds(timeout)` from
        connecting to the body's last byte. Raises `KubeError` status 0 when no answer came in time
        (refused, TLS, timeout, a connection that broke, a body over `max_body_bytes`).
        Once an answer has begun nothing is retried."""
        seconds = total_seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        data = self._target(method, path, query, body, content_type)
        conn, buf, recv = self._begin(method, path, data, timeout, deadline, seconds)
        done = False
        try:
            answer = read_answer(recv, method, buf, self.max_body_bytes)
            done = answer.keep_alive
            return answer.status, answer.body
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None
        finally:
            if done:
                self._checkin(conn)
            else:
                conn.close()

    def stream(
        self, method: str, path: str, query: Sequence[tuple[str, str]], timeout: Timeout, total_s: float | None = None
    ) -> Stream:
        """A request whose answer's body is read as it arrives (a watch), on a pooled connection:
        `timeout` bounds each socket operation (a stalled stream) and `total_s`, when given, the
        whole stream (one that never stops dripping)."""
        deadline = None if total_s is None else time.monotonic() + total_s
        data = self._target(method, path, query, None, "")
        conn, buf, recv = self._begin(method, path, data, timeout, deadline, total_s)
        try:
            while True:
                status, version, headers = read_head(recv, buf)
                if not 100 <= status <= 199:
                    break
        except (OSError, http.client.HTTPException, ValueError) as e:
            conn.close()
            raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None
        head = AnswerHead(status, headers, keeps_alive(version, headers))
        return Stream(self, conn, buf, head, method, path, recv)


@dataclass(frozen=True)
class AnswerHead:
    """What an answer's head says: its status, its headers (names lower-cased), and whether the server
    keeps the connection open after it."""

    status: int
    headers: dict[str, str]
    keep_alive: bool


class Stream:
    """A streamed answer (a watch): its status, its body as it arrives, and `abort()` from any thread."""

    def __init__(
        self,
        transport: Transport,
        conn: Conn,
        buf: bytearray,
        head: AnswerHead,
        method: str,
        path: str,
        recv: Callable[[int], bytes] | None = None,
    ) -> None:
        self._transport, self._conn, self._buf = transport, conn, buf
        self.status, self._keep_alive, self._headers = head.status, head.keep_alive, head.headers
        self.method, self.path = method, path
        self._ended = False  # the body was read to its end: the connection may carry another request
        self._recv = recv or conn.sock.recv  # bounded by the stream's deadline when it has one

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives, in pieces of at most RECV_BYTES; raises `KubeError` status 0 when
        the stream breaks or `abort()` ends it."""
        recv, buf = self._recv, self._buf
        try:
            encoding = self._headers.get("transfer-encoding", "").lower()
            if encoding.rsplit(",", 1)[-1].strip() == "chunked":
                yield from chunked_pieces(recv, buf)
            elif not encoding and ascii_digits(self._headers.get("content-length", "")):
                yield from pieces(recv, buf, int(self._headers["content-length"]))
            else:  # the body runs to the close
                self._keep_alive = False
                if buf:
                    yield bytes(buf)
                    buf.clear()
                while chunk := recv(RECV_BYTES):
                    yield chunk
            self._ended = not buf
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise KubeError(0, f"{type(e).__name__}: {e}", method=self.method, path=self.path) from None

    def read(self, limit: int) -> bytes:
        """At most `limit` bytes of the body (an error answer's Status)."""
        out = bytearray()
        for piece in self.chunks():
            out += piece
            if len(out) >= limit:
                self._ended = False
                return bytes(out[:limit])
        return bytes(out)

    def abort(self) -> None:
        """Wake a thread blocked reading this stream (it then raises `KubeError` status 0)."""
        # The plain socket's shutdown, under TLS too: it wakes a recv blocked in another thread.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._conn.sock, socket.SHUT_RDWR)

    def close(self, finished: bool) -> None:
        """Give the connection back when the answer was read to its end and keeps it open; close it
        otherwise (a watch left mid-stream still carries the rest of its answer)."""
        if finished and self._ended and self._keep_alive:
            self._transport._checkin(self._conn)
        else:
            self._conn.close()
