"""HTTP/1.1 answer framing for the kube transport (`gputopo.kube.transport`): the status line and headers, and a
body by Content-Length, chunked or up to the close, every part under a bound (the head's size, the body read
whole, a chunk's size line). Kept over `httptools.HttpResponseParser` (`bench/http_framing.py`, docs/benchmarks.md
"Hand-written HTTP, measured"): its response parser cannot tell where an answer ended within what it was fed (a
second answer after it is parsed silently, so bytes beyond an answer could not retire the connection), knows no
HEAD and cannot end a body at the close, and refuses a folded header.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from typing import NamedTuple

# One recv(2) asks for up to this much (a TLS socket hands back at most one 16 KiB record per call);
# each call allocates this much first, so it stays under malloc's mmap threshold.
RECV_BYTES = 65536
# A status line and headers longer than this are no API server's answer.
MAX_HEAD_BYTES = 64 * 1024
# One answer read whole is at most this: a page of 500 objects is a few MiB; more is no API server's.
MAX_BODY_BYTES = 256 * 1024 * 1024


class TooLong(http.client.HTTPException):
    """An answer's body over the limit of the bytes read whole."""


def ascii_digits(text: str) -> bool:
    # str.isdigit() alone also takes '²' (int() then raises ValueError) and '٣' (read as 3).
    return text.isascii() and text.isdigit()


_NO_BODY_STATUSES = frozenset({204, 304})


class Answer(NamedTuple):
    status: int
    body: bytes
    keep_alive: bool  # the connection may carry another request


def keeps_alive(version: str, headers: dict[str, str]) -> bool:
    tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
    return "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens


def read_answer(recv: Callable[[int], bytes], method: str, buf: bytearray, max_body: int = MAX_BODY_BYTES) -> Answer:
    """One HTTP/1.x answer from a connection: `buf` holds what was already received, `recv(n)` gives
    more (b"" at the end of the stream). The body is framed as RFC 9112 section 6.3 says (none for
    HEAD, 1xx, 204 and 304; chunked; Content-Length; else up to the close) and read whole, at most
    `max_body` bytes; interim 1xx answers are skipped. Raises an `http.client.HTTPException` for a
    malformed, cut-off or overlong answer.

    `http.client.HTTPResponse` does the same at 0.1 ms more per answer, a third of a small write's CPU."""
    while True:
        status, version, headers = read_head(recv, buf)
        if not 100 <= status <= 199:
            break
    keep = keeps_alive(version, headers)
    encoding = headers.get("transfer-encoding", "").lower()
    if method == "HEAD" or status in _NO_BODY_STATUSES:
        body = b""
    elif encoding:
        if encoding.rsplit(",", 1)[-1].strip() != "chunked":
            # Not chunked at the end: the body runs to the close (RFC 9112 6.3, item 4).
            return Answer(status, _read_to_close(recv, buf, max_body), False)
        body = _read_chunked(recv, buf, max_body)
    elif "content-length" in headers:
        length = headers["content-length"]
        if not ascii_digits(length):
            raise http.client.HTTPException(f"bad Content-Length {length!r}")
        if int(length) > max_body:
            raise TooLong(f"an answer of {length} bytes is over the limit of {max_body}")
        body = _read_exactly(recv, buf, int(length))
    else:
        return Answer(status, _read_to_close(recv, buf, max_body), False)
    # Bytes beyond the answer (no request was pipelined) mean the framing went wrong: do not reuse.
    return Answer(status, body, keep and not buf)


def _more(recv: Callable[[int], bytes], buf: bytearray) -> None:
    chunk = recv(RECV_BYTES)
    if not chunk:
        raise http.client.IncompleteRead(bytes(buf[:200]))
    buf += chunk


def read_head(recv: Callable[[int], bytes], buf: bytearray) -> tuple[int, str, dict[str, str]]:
    """The status line and headers (names lower-cased); consumes them and the blank line from `buf`."""
    end = _find(recv, buf, b"\r\n\r\n", "the answer's headers")
    lines = buf[:end].decode("latin-1").split("\r\n")
    del buf[: end + 4]
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not (ascii_digits(code) and len(code) == 3) or rest[3:4] not in ("", " "):
        raise http.client.BadStatusLine(lines[0])
    headers: dict[str, str] = {}
    name = ""
    for line in lines[1:]:
        if line[:1] in (" ", "\t") and name:  # an obsolete folded continuation line
            headers[name] += " " + line.strip()
            continue
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        if not sep or not name:
            raise http.client.HTTPException(f"bad header line {line[:100]!r}")
        value = value.strip()
        if name in headers:
            if name == "content-length" and headers[name] != value:
                raise http.client.HTTPException("conflicting Content-Length headers")
            value = headers[name] if name == "content-length" else f"{headers[name]}, {value}"
        headers[name] = value
    return int(code), version, headers


def _read_exactly(recv: Callable[[int], bytes], buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        _more(recv, buf)
    if len(buf) == n:  # the usual end of an answer: one copy, not two
        out = bytes(buf)
        buf.clear()
        return out
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _find(recv: Callable[[int], bytes], buf: bytearray, sep: bytes, what: str) -> int:
    """Where `sep` starts in `buf`, receiving more until it arrives (at most MAX_HEAD_BYTES before it)."""
    start = 0
    while (end := buf.find(sep, start)) < 0:
        if len(buf) > MAX_HEAD_BYTES:
            raise http.client.LineTooLong(what)
        start = max(0, len(buf) - len(sep) + 1)
        _more(recv, buf)
    return end


def _read_line(recv: Callable[[int], bytes], buf: bytearray) -> bytes:
    end = _find(recv, buf, b"\r\n", "a chunk-size or trailer line")
    line = bytes(buf[:end])
    del buf[: end + 2]
    return line


def _chunk_size(line: bytes) -> int:
    size_text = line.split(b";", 1)[0].strip()
    try:
        size = int(size_text, 16)
    except ValueError:
        raise http.client.HTTPException(f"bad chunk size {size_text[:40]!r}") from None
    if size < 0:
        raise http.client.HTTPException(f"bad chunk size {size_text[:40]!r}")
    return size


def pieces(recv: Callable[[int], bytes], buf: bytearray, n: int) -> Iterator[bytes]:
    """The next `n` bytes as they arrive (a streamed body never waits for more than is there)."""
    while n > 0:
        if not buf:
            _more(recv, buf)
        take = min(n, len(buf))
        yield bytes(buf[:take])
        del buf[:take]
        n -= take


def chunked_pieces(recv: Callable[[int], bytes], buf: bytearray) -> Iterator[bytes]:
    """A chunked body as it arrives, trailer fields consumed (a watch's answer)."""
    while size := _chunk_size(_read_line(recv, buf)):
        yield from pieces(recv, buf, size)
        if _read_exactly(recv, buf, 2) != b"\r\n":
            raise http.client.HTTPException("a chunk does not end with CRLF")
    while _read_line(recv, buf):  # trailer fields, up to the blank line
        pass


def _read_chunked(recv: Callable[[int], bytes], buf: bytearray, max_body: int) -> bytes:
    out = bytearray()
    while size := _chunk_size(_read_line(recv, buf)):
        if len(out) + size > max_body:
            raise TooLong(f"an answer over the limit of {max_body} bytes")
        out += _read_exactly(recv, buf, size)
        if _read_exactly(recv, buf, 2) != b"\r\n":
            raise http.client.HTTPException("a chunk does not end with CRLF")
    while _read_line(recv, buf):  # trailer fields, up to the blank line
        pass
    return bytes(out)


def _read_to_close(recv: Callable[[int], bytes], buf: bytearray, max_body: int) -> bytes:
    while chunk := recv(RECV_BYTES):
        buf += chunk
        if len(buf) > max_body:
            raise TooLong(f"an answer over the limit of {max_body} bytes")
    out = bytes(buf)
    buf.clear()
    return out
