"""The verbs listener's own HTTP/1.1 server, spoken to over raw sockets: what kube-scheduler's Go client and a
careless or hostile local client can send (pipelining, Expect, HTTP/1.0, wrong methods, garbage)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import orjson
import pytest

from gputopo.extender.app import create_listeners
from gputopo.extender.settings import Settings
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, FakeClock, args, gputopo_pod, lease_obj, node_obj, start_server, sync

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    source, clock = FakeSource(NS), FakeClock()
    listeners = create_listeners(
        Settings(namespace=NS, max_request_bytes=LIMIT, log_level="critical"), cluster=source, clock=clock, watch=False
    )
    source.put("nodes", node_obj("h100-a"))
    source.put("leases", lease_obj("h100-a", clock.now))
    sync(listeners.cache, source)
    server, thread, url = start_server(listeners.door)
    yield "127.0.0.1", int(url.rsplit(":", 1)[1])
    server.should_exit = True
    thread.join(10)
    listeners.door.close()


def _request(path: str, body: bytes, *, extra: str = "", version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
    return head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _read_answers(conn: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` answers read off the connection, in order (status, lower-cased headers, body)."""
    conn.settimeout(20)
    buf = b""
    out: list[tuple[int, dict[str, str], bytes]] = []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            assert chunk, f"connection closed after {len(out)} answers"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status == 100:
            continue
        size = int(headers["content-length"])
        while len(buf) < size:
            chunk = conn.recv(65536)
            assert chunk, "connection closed mid-body"
            buf += chunk
        out.append((status, headers, buf[:size]))
        buf = buf[size:]
    return out


def _closed(conn: socket.socket) -> bool:
    conn.settimeout(20)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


FILTER = orjson.dumps(args(gputopo_pod("p", 1), ["h100-a"]))


def test_pipelined_requests_are_answered_in_order_on_one_connection(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as conn:
        conn.sendall(_request("/filter", FILTER) + _request("/prioritize", FILTER) + b"GET /healthz HTTP/1.1\r\n\r\n")
        (f, p, h) = _read_answers(conn, 3)
    assert f[0] == 200 and orjson.loads(f[2])["NodeNames"] == ["h100-a"]
    assert p[0] == 200 and isinstance(orjson.loads(p[2]), list)
    assert h == (200, {"content-type": "application/json", "content-length": "15"}, b'{"status":"ok"}')


@pytest.mark.parametrize(
    ("raw", "status", "keeps"),
    [
        pytest.param(b"GET /filter HTTP/1.1\r\nHost: x\r\n\r\n", 405, True, id="GET a verb: 405, kept"),
        pytest.param(b"GET /metrics HTTP/1.1\r\n\r\n", 404, True, id="metrics path: 404, kept"),
        pytest.param(b"GET /readyz HTTP/1.1\r\n\r\n", 200, True, id="readyz: 200, kept"),
        # the query is ignored, the body read
        pytest.param(
            b"POST /filter?x=1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 400, True, id="verb with a query: read"
        ),
        # A body no verb reads is refused from its head, unread: the connection then closes.
        pytest.param(b"PUT /bind HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 405, False, id="PUT a verb: 405, closed"),
        pytest.param(
            b"POST /mutate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 404, False, id="webhook path: 404, closed"
        ),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 413, False, id="healthz with a body: 413, closed"
        ),
    ],
)
def test_other_paths_and_methods_get_a_json_answer(
    address: tuple[str, int], raw: bytes, status: int, keeps: bool
) -> None:
    with socket.create_connection(address) as conn:
        conn.sendall(raw + _request("/filter", FILTER))
        first, *again = _read_answers(conn, 2 if keeps else 1)
        if not keeps:
            assert first[1]["connection"] == "close" and conn.recv(65536) == b""
    assert first[0] == status and isinstance(orjson.loads(first[2]), dict)
    assert [a[0] for a in again] == ([200] if keeps else [])


@pytest.mark.parametrize(
    "raw",
    [
        b"this is not http\r\n\r\n",
        b"POST /filter HTTP/1.1\r\nContent-Length: nope\r\n\r\n",
        b"POST /filter HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /filter HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",  # the parser refuses it
    ],
    ids=["garbage", "unreadable length", "broken chunk", "length past 64 bits"],
)
def test_a_broken_request_gets_400_and_the_connection_closes(address: tuple[str, int], raw: bytes) -> None:
    with socket.create_connection(address) as conn:
        conn.sendall(raw)
        ((status, headers, body),) = _read_answers(conn, 1)
        assert status == 400 and headers.get("connection") == "close" and orjson.loads(body)["Error"]
        assert _closed(conn)


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /filter HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1),
        b"POST /filter HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % (LIMIT + 1) + b"x" * (LIMIT + 1),
    ],
    ids=["declared over the limit", "chunked past the limit"],
)
def test_a_body_over_the_limit_gets_413_unread_and_the_connection_closes(address: tuple[str, int], raw: bytes) -> None:
    with socket.create_connection(address) as conn:
        conn.sendall(raw)
        ((status, _, body),) = _read_answers(conn, 1)
        assert status == 413 and "--max-request-bytes" in orjson.loads(body)["Error"]
        assert _closed(conn)


@pytest.mark.parametrize(
    ("version", "extra", "closes"),
    [
        ("1.1", "", False),
        ("1.1", "Connection: close\r\n", True),
        ("1.0", "", True),
        ("1.0", "Connection: keep-alive\r\n", False),
        ("1.1", "Expect: 100-continue\r\n", False),
    ],
    ids=["HTTP/1.1 keeps alive", "Connection: close", "HTTP/1.0 closes", "HTTP/1.0 keep-alive", "Expect 100-continue"],
)
def test_keep_alive_follows_the_request(address: tuple[str, int], version: str, extra: str, closes: bool) -> None:
    with socket.create_connection(address) as conn:
        conn.sendall(_request("/filter", FILTER, extra=extra, version=version))
        ((status, headers, _),) = _read_answers(conn, 1)
        assert status == 200
        assert (headers.get("connection") == "close") is closes
        if closes:
            assert _closed(conn)
        else:
            conn.sendall(_request("/filter", FILTER))
            assert _read_answers(conn, 1)[0][0] == 200
