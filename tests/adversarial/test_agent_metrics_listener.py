"""The agent's /metrics listener (gputopo/agent/metricsserver.py) against hostile callers, over real sockets:
connections in all and per address are capped (503 at once, no thread), the listener is shared fairly across
addresses (a scrape from another address takes the place of a flood's oldest connection whose head is not
in), a silent connection is closed after the timeout, a body is never read, and every held connection is
given back. Counts, never times; every wait is bounded by WAIT_S."""

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


def _serve(monkeypatch: pytest.MonkeyPatch, timeout_s: float) -> Iterator[tuple[BoundedMetricsServer, int]]:
    monkeypatch.setattr(BoundedMetricsServer, "max_connections", CAP)
    monkeypatch.setattr(BoundedMetricsServer, "max_per_peer", PER_PEER)
    registry = CollectorRegistry()
    Counter("gputopo_agent_test", "a metric to scrape", registry=registry).inc()
    server, thread = serve_metrics(0, registry, host="127.0.0.1", timeout_s=timeout_s)
    yield server, int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(WAIT_S)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BoundedMetricsServer, int]]:
    yield from _serve(monkeypatch, TIMEOUT_S)


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BoundedMetricsServer, int]]:
    """Silent connections are held for longer than any test waits: only eviction closes them."""
    yield from _serve(monkeypatch, 10 * WAIT_S)


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
        pytest.param(
            [f"127.0.0.{10 + i}" for i in range(CAP)] + ["127.0.0.10"],
            id="past the cap, from an address holding as many as any other: 503",
        ),
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


SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    ("flood", "sent"),
    [
        pytest.param(["127.0.0.2"] * PER_PEER + ["127.0.0.3"] * PER_PEER, b"", id="two addresses, silent"),
        pytest.param(
            ["127.0.0.2"] * PER_PEER + ["127.0.0.3"] * PER_PEER, b"GET /metrics HTTP/1.1\r\nHo", id="two, dripping"
        ),
        pytest.param([f"127.0.0.{10 + i}" for i in range(CAP)], b"", id="one each from as many as the cap"),
    ],
)
def test_a_scrape_from_another_address_takes_a_flood_connections_place(
    patient: tuple[BoundedMetricsServer, int], flood: list[str], sent: bytes
) -> None:
    """The listener full of connections whose head is not in: a scrape from an address holding none is
    answered, the oldest connection of an address holding the most is closed for it, and the caps hold."""
    server, port = patient
    held = []
    for source in flood:
        conn = _connect(port, source)
        conn.sendall(sent)
        held.append(conn)
    try:
        _eventually("the flood fills the listener", lambda: server.held == CAP)
        with _connect(port, "127.0.0.99") as conn:
            conn.sendall(SCRAPE)
            assert _read_all(conn).startswith(b"HTTP/1.0 200")
        assert server.evicted == 1 and server.refused == 0
        assert _read_all(held[0]) == b""  # the oldest of the first address holding the most: closed for it
        assert server.held <= CAP and max(server.per_peer.values()) <= PER_PEER
    finally:
        for conn in held:
            conn.close()
    _eventually("every connection is given back", lambda: server.held == 0 and not server.per_peer)


def test_scrapes_keep_being_answered_while_the_flood_reconnects(patient: tuple[BoundedMetricsServer, int]) -> None:
    """Each address of the flood opens a new silent connection for every one closed; scrapes from another
    address are answered every time."""
    server, port = patient
    sources = ["127.0.0.2", "127.0.0.3"]
    held = [_connect(port, s) for s in sources for _ in range(PER_PEER)]
    try:
        for _ in range(CAP):
            _eventually("the flood fills the listener", lambda: server.held == CAP)
            with _connect(port, "127.0.0.99") as conn:
                conn.sendall(SCRAPE)
                assert _read_all(conn).startswith(b"HTTP/1.0 200")
            _eventually("the scrape's place is given back", lambda: server.held == CAP - 1)
            short = min(sources, key=lambda s: server.per_peer[s])  # the address a connection was taken from
            held.append(_connect(port, short))  # the flood takes its place back
    finally:
        for conn in held:
            conn.close()
    _eventually("every connection is given back", lambda: server.held == 0)


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
