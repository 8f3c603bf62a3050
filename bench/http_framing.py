"""The kube client's hand-written HTTP/1.1 response framing against one built on `httptools.HttpResponseParser`.

The same recorded answers go through both, from the same `recv` (pieces as a socket hands them over): a small
JSON GET (one piece), a 1 MiB list (Content-Length, 16 KiB pieces: one TLS record each) and a watch of 1,000
events (chunked, one piece per event, as the API server flushes them). Printed: CPU µs per answer (per event for
the watch) for each, their ratio, and the lines of code of each framing (without blank lines, comments and
docstrings).

The httptools framing keeps the bounds ours holds: the head is fed at most MAX_HEAD_BYTES + 1 bytes at a time and
refused past it, the body is counted in `on_body` and refused past `max_body`, a malformed chunk size is the
parser's error, and an answer cut short is `IncompleteRead`. What it does not do, and ours does: skip interim 1xx
answers, see bytes beyond an answer (llhttp parses a second answer after the first silently), accept a folded
header (llhttp refuses it), name a bad status line `BadStatusLine`; a body that runs to the close (llhttp's finish
is not exposed) and HEAD's Content-Length without a body (the parser does not know the method) are framed by our
code around it, which the line count includes.

    .venv/bin/python bench/http_framing.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import http.client
import inspect
import io
import time
import tokenize
from collections.abc import Callable, Iterator
from typing import Any

import httptools
import orjson

from gputopo.kube import framing
from gputopo.kube.framing import MAX_BODY_BYTES, MAX_HEAD_BYTES, RECV_BYTES, Answer, TooLong, read_answer

# ------------------------------------------------------------------------------------------ the candidate


class _Framer:
    """httptools' callbacks for one answer: status, headers (lower-cased), body, whether it is complete."""

    def __init__(self, max_body: int, stream: bool) -> None:
        self.max_body, self.stream = max_body, stream
        self.headers: dict[str, str] = {}
        self.head_done = self.done = False
        self.size = 0
        self.pieces: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body and not self.stream:
            raise TooLong(f"an answer over the limit of {self.max_body} bytes")
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def _feed(parser: Any, framer: _Framer, data: bytes | bytearray, head: list[int]) -> None:
    """Feed `data`, a head's bytes at most MAX_HEAD_BYTES + 1 at a time (httptools copies a header whole)."""
    view = memoryview(data)
    while view:
        if framer.head_done:
            parser.feed_data(view)
            return
        cut = MAX_HEAD_BYTES - head[0] + 1
        piece, view = view[:cut], view[cut:]
        try:
            parser.feed_data(piece)
        except httptools.HttpParserError as e:
            raise http.client.HTTPException(str(e)) from None
        if not framer.head_done:
            head[0] += len(piece)
            if head[0] > MAX_HEAD_BYTES:
                raise http.client.LineTooLong("the answer's headers")


def read_answer_httptools(
    recv: Callable[[int], bytes], method: str, buf: bytearray, max_body: int = MAX_BODY_BYTES
) -> Answer:
    framer = _Framer(max_body, stream=False)
    parser = httptools.HttpResponseParser(framer)
    head = [0]
    _feed(parser, framer, buf, head)
    buf.clear()
    while not framer.done:
        if framer.head_done and (method == "HEAD" or ("content-length" not in framer.headers and not _chunked(framer))):
            if method == "HEAD":
                return Answer(parser.get_status_code(), b"", parser.should_keep_alive())
            rest = bytearray(b"".join(framer.pieces))
            return Answer(parser.get_status_code(), framing._read_to_close(recv, rest, max_body), False)
        chunk = recv(RECV_BYTES)
        if not chunk:
            raise http.client.IncompleteRead(b"".join(framer.pieces)[:200])
        _feed(parser, framer, chunk, head)
    return Answer(parser.get_status_code(), b"".join(framer.pieces), parser.should_keep_alive())


def _chunked(framer: _Framer) -> bool:
    return framer.headers.get("transfer-encoding", "").lower().rsplit(",", 1)[-1].strip() == "chunked"


def stream_httptools(recv: Callable[[int], bytes], buf: bytearray) -> Iterator[bytes]:
    framer = _Framer(MAX_BODY_BYTES, stream=True)
    parser = httptools.HttpResponseParser(framer)
    head = [0]
    _feed(parser, framer, buf, head)
    buf.clear()
    while True:
        yield from framer.pieces
        framer.pieces.clear()
        if framer.done:
            return
        chunk = recv(RECV_BYTES)
        if not chunk:
            raise http.client.IncompleteRead(b"")
        _feed(parser, framer, chunk, head)


def stream_ours(recv: Callable[[int], bytes], buf: bytearray) -> Iterator[bytes]:
    """The chunked branch of `Stream.chunks`, head included (what a watch's answer goes through)."""
    framing.read_head(recv, buf)
    yield from framing.chunked_pieces(recv, buf)


# ------------------------------------------------------------------------------------------ the recordings


def _object(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"pod-{i}", "namespace": "default", "resourceVersion": str(1000 + i), "uid": f"u-{i}"},
        "spec": {"nodeName": f"node-{i % 64}", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"},
    }


_HEAD = (
    b"HTTP/1.1 200 OK\r\nAudit-Id: 4f7a2c51-9b3e-4d6f-8a21-0c5e7d9b1f33\r\nCache-Control: no-cache, private\r\n"
    b"Content-Type: application/json\r\nX-Kubernetes-Pf-Flowschema-Uid: 1a2b3c\r\n"
    b"X-Kubernetes-Pf-Prioritylevel-Uid: 4d5e6f\r\nDate: Thu, 03 Dec 2026 12:00:00 GMT\r\n"
)


def small_get() -> list[bytes]:
    body = orjson.dumps(_object(1))
    return [_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body]


def big_list() -> list[bytes]:
    items: list[dict[str, Any]] = []
    size = 0
    while size < 1 << 20:
        items.append(_object(len(items)))
        size += len(orjson.dumps(items[-1]))
    body = orjson.dumps({"kind": "PodList", "metadata": {"resourceVersion": "9"}, "items": items})
    data = _HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body
    return [data[i : i + 16384] for i in range(0, len(data), 16384)]


def watch(events: int) -> list[bytes]:
    pieces = [_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"]
    for i in range(events):
        line = orjson.dumps({"type": "MODIFIED", "object": _object(i)}) + b"\n"
        pieces.append(b"%x\r\n%s\r\n" % (len(line), line))
    pieces.append(b"0\r\n\r\n")
    return pieces


def _recv(pieces: list[bytes]) -> Callable[[int], bytes]:
    it = iter(pieces)
    return lambda n: next(it, b"")


# ------------------------------------------------------------------------------------------ measuring


def _cpu_us(fn: Callable[[], Any], rounds: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(5):
        start = time.process_time_ns()
        for _ in range(rounds):
            fn()
        best = min(best, (time.process_time_ns() - start) / rounds / 1000)
    return best


def _loc(*objs: Any) -> int:
    """Lines of code: no blank lines, comments or docstrings."""
    total = 0
    for obj in objs:
        source = inspect.getsource(obj)
        lines: set[int] = set()
        prev = tokenize.INDENT
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT):
                prev = tok.type
                continue  # a docstring
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                lines.update(range(tok.start[0], tok.end[0] + 1))
            if tok.type not in (tokenize.NL, tokenize.COMMENT):
                prev = tok.type
        total += len(lines)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    events = 1000
    cases: list[tuple[str, list[bytes], int, int]] = [
        ("small JSON GET", small_get(), args.rounds * 10, 1),
        ("1 MiB list", big_list(), max(1, args.rounds // 10), 1),
        (f"watch, per event ({events})", watch(events), max(1, args.rounds // 50), events),
    ]
    for name, pieces, _, _ in cases:
        whole = b"".join(pieces)
        if name.startswith("watch"):
            a = b"".join(stream_ours(_recv(pieces), bytearray()))
            b = b"".join(stream_httptools(_recv(pieces), bytearray()))
        else:
            a = read_answer(_recv(pieces), "GET", bytearray()).body
            b = read_answer_httptools(_recv(pieces), "GET", bytearray()).body
        assert a == b and a and len(a) < len(whole), name
    print(f"{'answer':28} {'ours µs':>10} {'httptools µs':>13} {'httptools/ours':>15}")
    for name, pieces, rounds, per in cases:
        if name.startswith("watch"):

            def run_ours(p: list[bytes] = pieces) -> None:
                for _ in stream_ours(_recv(p), bytearray()):
                    pass

            def run_ht(p: list[bytes] = pieces) -> None:
                for _ in stream_httptools(_recv(p), bytearray()):
                    pass
        else:

            def run_ours(p: list[bytes] = pieces) -> None:
                read_answer(_recv(p), "GET", bytearray())

            def run_ht(p: list[bytes] = pieces) -> None:
                read_answer_httptools(_recv(p), "GET", bytearray())

        ours, ht = _cpu_us(run_ours, rounds) / per, _cpu_us(run_ht, rounds) / per
        print(f"{name:28} {ours:10.2f} {ht:13.2f} {ht / ours:15.2f}")
    ours_loc = _loc(
        framing.read_answer, framing.read_head, framing.keeps_alive, framing._more, framing._read_exactly,
        framing._find, framing._read_line, framing._chunk_size, framing.pieces, framing._read_chunked,
        framing._read_to_close, framing.chunked_pieces,
    )  # fmt: skip
    ht_loc = _loc(_Framer, _feed, read_answer_httptools, _chunked, stream_httptools, framing._read_to_close)
    print(f"lines of code: ours {ours_loc}, httptools-based {ht_loc}")


if __name__ == "__main__":
    main()
