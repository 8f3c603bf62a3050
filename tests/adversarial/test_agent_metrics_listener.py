"""The agent's /metrics listener (gputopo/agent/metricsserver.py) against hostile callers, over real sockets:
connections in all and per address are capped (503 at once, no thread), a silent connection is closed after
the timeout, a body is never read, and every held connection is given back. Counts, never times; every
wait is bounded by WAIT_S."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from gputopo.agent.metricsserver import BoundedMetricsServer, serve_metrics

WAIT_S = 15.0
TIMEOUT_S = 0.5
CAP, PER_PEER = 6, 3


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BoundedMetricsServer, int]]:
    monkeypatch.setattr(BoundedMetricsServer, "max_connections", CAP)
    monkeypatch.setattr(BoundedMetricsServer, "max_per_peer", PER_PEER)
    registry = CollectorRegistry()
    Counter("gputopo_agent_test", "a metric to scrape", registry=registry).inc()
    server, thread = serve_metrics(0, registry, host="127.0.0.1", timeout_s=TIMEOUT_S)
    yield server, int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(WAIT_S)


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S, source_address=(source, 0))


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := conn.recv(65536):
            data += chunk
    return data


def _eventually(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_scrape_is_answered(served: tuple[BoundedMetricsServer, int]) -> None:
    _, port = served
    with _connect(port) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_all(conn)
    assert answer.startswith(b"HTTP/1.0 200") and b"gputopo_agent_test_total 1.0" in answer


@pytest.mark.parametrize(
    "sources",
    [
        pytest.param(["127.0.0.2"] * (PER_PEER + 1), id="one address past its share: 503"),
        pytest.param([f"127.0.0.{10 + i}" for i in range(CAP)] + ["127.0.0.99"], id="past the cap: 503"),
    ],
)
def test_silent_connections_past_the_caps_get_503_at_once_and_are_closed_after_the_timeout(
    served: tuple[BoundedMetricsServer, int], sources: list[str]
) -> None:
    server, port = served
    held = [_connect(port, s) for s in sources[:-1]]
    try:
        _eventually("the silent connections are held", lambda: server.held == len(held))
        with _connect(port, sources[-1]) as conn:
            assert _read_all(conn).startswith(b"HTTP/1.1 503")
        assert server.refused == 1
        # Each silent connection is closed by the server once the timeout passes: a read sees the end.
        assert all(_read_all(conn) == b"" for conn in held)
    finally:
        for conn in held:
            conn.close()
    _eventually("every connection is given back", lambda: server.held == 0 and not server.per_peer)


def test_an_address_at_its_share_leaves_the_others_served(served: tuple[BoundedMetricsServer, int]) -> None:
    server, port = served
    held = [_connect(port, "127.0.0.2") for _ in range(PER_PEER)]
    try:
        _eventually("the share is held", lambda: server.per_peer["127.0.0.2"] == PER_PEER)
        with _connect(port, "127.0.0.3") as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_all(conn).startswith(b"HTTP/1.0 200")
    finally:
        for conn in held:
            conn.close()


@pytest.mark.parametrize(
    ("method", "status"),
    [
        pytest.param(b"POST", b"405", id="posted: prometheus_client's 405, from the head"),
        pytest.param(b"GET", b"200", id="a scrape with a body: answered, the body ignored"),
    ],
)
def test_a_body_is_never_read_the_request_is_answered_from_its_head(
    served: tuple[BoundedMetricsServer, int], method: bytes, status: bytes
) -> None:
    """8 MiB declared, 256 KiB sent: answered, the connection closed, and nothing held after it."""
    server, port = served
    with _connect(port) as conn:
        with contextlib.suppress(OSError):
            conn.sendall(b"%s /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (method, 8 << 20))
            conn.sendall(b"x" * (256 << 10))
        assert _read_all(conn).startswith(b"HTTP/1.0 " + status)
    _eventually("the connection is given back", lambda: server.held == 0)
