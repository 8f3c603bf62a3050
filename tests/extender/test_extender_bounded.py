"""The limits every listener holds to (extender/bounded.py), over raw sockets against each of the three
listeners on the server production gives it: the verbs' own server, uvicorn for the webhook (TLS) and the
metrics. Small limits (a 8 KiB head, 1 s timeouts) keep the waits short; every wait is bounded."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from extender.app import Listeners, create_listeners
from extender.bounded import HeadMeter, ListenerLimits
from extender.settings import Settings, describe_error, load_settings
from extender.verbserver import VerbServer
from tests.extender.fake import FakeSource
from tests.extender.harness import (
    NS,
    FakeClock,
    args,
    certificate,
    gputopo_pod,
    lease_obj,
    node_obj,
    pod_obj,
    start_server,
    sync,
)

HEAD_CAP = 8 * 1024
BODY_CAP = 64 * 1024
LIMITS = ListenerLimits(max_header_bytes=HEAD_CAP, read_timeout_s=1.0, idle_timeout_s=1.0, max_connections=64)
LISTENERS = ("verbs", "webhook", "metrics")
FILTER = orjson.dumps(args(gputopo_pod("p", 1), ["h100-a"]))
BIND = orjson.dumps({"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "h100-a"})
REVIEW = orjson.dumps(
    {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": gputopo_pod("p", 1)},
    }
)
# A POST each listener reads the body of (the metrics listener has none).
WANTED = {"verbs": ("/filter", FILTER), "webhook": ("/mutate", REVIEW)}
WAIT_S = 15.0  # the bound on any wait for the server; the limits under test are 1 s


@dataclass
class Servers:
    ports: dict[str, int]
    ca: Path
    servers: dict[str, Any]

    def connections(self, listener: str) -> set[Any]:
        """The connections the listener's server holds (each leaves the set once its socket is closed)."""
        server = self.servers[listener]
        held: set[Any] = server.connections if isinstance(server, VerbServer) else server.server_state.connections
        return set(held)

    def connect(self, listener: str) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.ports[listener]), timeout=WAIT_S)
        if listener == "webhook":
            context = ssl.create_default_context(cafile=str(self.ca))
            conn = context.wrap_socket(conn, server_hostname="127.0.0.1")
        return conn


def _serve(tmp: Path, limits: ListenerLimits) -> Iterator[Servers]:
    ca, crt, key = certificate(tmp)
    source, clock = FakeSource(NS), FakeClock()
    settings = Settings(namespace=NS, max_request_bytes=BODY_CAP, log_level="critical")
    listeners: Listeners = create_listeners(settings, cluster=source, clock=clock, watch=False)
    source.put("nodes", node_obj("h100-a"))
    source.put("leases", lease_obj("h100-a", clock.now))
    source.put("pods", pod_obj("p", 1))
    sync(listeners.cache, source)
    apps = {"verbs": listeners.door, "webhook": listeners.webhook, "metrics": listeners.metrics}
    started = {name: start_server(app, limits, (crt, key) if name == "webhook" else None) for name, app in apps.items()}
    ports = {name: int(url.rsplit(":", 1)[1]) for name, (_, _, url) in started.items()}
    yield Servers(ports, ca, {name: server for name, (server, _, _) in started.items()})
    for server, thread, _ in started.values():
        server.should_exit = True
        thread.join(10)
    listeners.door.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    yield from _serve(tmp_path_factory.mktemp("bounded"), LIMITS)


@pytest.fixture(scope="module")
def two_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Two connections per listener at most, kept alive long enough to hold both."""
    limits = ListenerLimits(max_header_bytes=HEAD_CAP, read_timeout_s=WAIT_S, idle_timeout_s=60, max_connections=2)
    yield from _serve(tmp_path_factory.mktemp("two"), limits)


Answer = tuple[int, dict[str, str], bytes]


class Reader:
    """Answers off one connection, 100 Continue included, in the order they arrive."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def _more(self) -> None:
        chunk = self.conn.recv(65536)
        assert chunk, f"connection closed; unread: {self.buf[:200]!r}"
        self.buf += chunk

    def answer(self, *, head_only: bool = False) -> Answer:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/1.1 "), lines[0]
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if status == 100 or head_only:
            return status, headers, b""
        size = int(headers["content-length"])
        while len(self.buf) < size:
            self._more()
        body, self.buf = self.buf[:size], self.buf[size:]
        return status, headers, body

    def closed(self) -> bool:
        """True once the server closes the connection (within WAIT_S), with nothing more sent."""
        try:
            chunk = self.conn.recv(1)
        except (ConnectionResetError, ssl.SSLError):
            return not self.buf
        except TimeoutError:
            return False
        return chunk == b"" and not self.buf


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        extra,
        len(body),
        body,
    )


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def _first(listener: str) -> bytes:
    """A request that takes its time: a bind on a worker for the verbs, /healthz through the ASGI app else."""
    return post("/bind", BIND) if listener == "verbs" else HEALTHZ


# ---------------------------------------------------------------------------------------------- head cap

BIG_HEADER = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * HEAD_CAP + b"\r\n\r\n"
BIG_URL = b"GET /" + b"a" * HEAD_CAP + b" HTTP/1.1\r\nHost: x\r\n\r\n"
# A head that begins in the read that ends the request before it is counted from the next read (uvloop reads
# 256 KiB at most): this one passes the cap in any case.
PAST_ONE_READ = b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * (HEAD_CAP + 300 * 1024) + b"\r\n\r\n"
TEN_MB_HEADER = b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * (10 * 1024 * 1024) + b"\r\n\r\n"


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("raw", [BIG_HEADER, BIG_URL, TEN_MB_HEADER], ids=["header", "url", "10 MB header"])
def test_a_head_over_the_cap_gets_431_and_the_connection_closes(servers: Servers, listener: str, raw: bytes) -> None:
    with servers.connect(listener) as conn:
        # The server stops reading at the cap; its answer is already on the way.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
            conn.sendall(raw)
        reader = Reader(conn)
        status, headers, body = reader.answer()
        assert status == 431 and headers["connection"] == "close"
        assert "--max-header-bytes" in orjson.loads(body)["Error"]
        assert reader.closed()


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_head_just_under_the_cap_is_served(servers: Servers, listener: str) -> None:
    raw = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_CAP - 100) + b"\r\n\r\n"
    with servers.connect(listener) as conn:
        conn.sendall(raw + HEALTHZ)
        reader = Reader(conn)
        assert [reader.answer()[0], reader.answer()[0]] == [200, 200]


# ---------------------------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize(
    "partial",
    [b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"POST /nothing HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}"],
    ids=["head", "body"],
)
def test_a_request_not_read_within_the_read_timeout_gets_408_and_closes(
    servers: Servers, listener: str, partial: bytes
) -> None:
    with servers.connect(listener) as conn:
        conn.sendall(partial)
        reader = Reader(conn)
        status, headers, body = reader.answer()
        assert status == 408 and headers["connection"] == "close"
        assert "--read-timeout-seconds" in orjson.loads(body)["Error"]
        assert reader.closed()


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_connection_that_sends_nothing_is_closed(servers: Servers, listener: str) -> None:
    with servers.connect(listener) as conn:
        assert Reader(conn).closed()


@pytest.mark.parametrize("listener", LISTENERS)
def test_an_idle_kept_alive_connection_is_closed(servers: Servers, listener: str) -> None:
    with servers.connect(listener) as conn:
        conn.sendall(HEALTHZ)
        reader = Reader(conn)
        status, headers, _ = reader.answer()
        assert status == 200 and "connection" not in headers
        assert reader.closed()


# ---------------------------------------------------------------------------------------------- connections


@pytest.mark.parametrize("listener", LISTENERS)
def test_connections_past_the_cap_get_503_until_one_closes(two_only: Servers, listener: str) -> None:
    held = [two_only.connect(listener) for _ in range(2)]
    try:
        for conn in held:  # both accepted and counted: each has answered
            conn.sendall(HEALTHZ)
            assert Reader(conn).answer()[0] == 200
        with two_only.connect(listener) as extra:
            reader = Reader(extra)
            status, headers, body = reader.answer()
            assert status == 503 and headers["connection"] == "close"
            assert "--max-connections" in orjson.loads(body)["Error"]
            assert reader.closed()
        held.pop().close()
        deadline = time.monotonic() + WAIT_S
        while True:  # the server counts the close when it sees it: poll, bounded
            with two_only.connect(listener) as again:
                again.sendall(HEALTHZ)
                if Reader(again).answer()[0] == 200:
                    break
            assert time.monotonic() < deadline, "a closed connection's slot was never freed"
    finally:
        for conn in held:
            conn.close()


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_client_that_does_not_read_its_answers_is_cut_off(servers: Servers, listener: str) -> None:
    before = servers.connections(listener)
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # before connecting: small buffers on our side
        conn.setsockopt(socket.SOL_SOCKET, option, 4096)
    conn.settimeout(WAIT_S)
    conn.connect(("127.0.0.1", servers.ports[listener]))
    if listener == "webhook":
        context = ssl.create_default_context(cafile=str(servers.ca))
        conn = context.wrap_socket(conn, server_hostname="127.0.0.1")
    with conn:
        conn.sendall(HEALTHZ)
        assert Reader(conn).answer()[0] == 200  # accepted and counted
        ours = servers.connections(listener) - before
        assert ours, "the server never held the connection"
        conn.setblocking(False)
        # The server's kernel buffers take a few MB before its reading matters: 34 MB is past them.
        burst, sent, most = HEALTHZ * 100, 0, 1000 * len(HEALTHZ) * 1000  # a burst fits our send buffer
        deadline = time.monotonic() + WAIT_S
        # Pipeline until the server stops reading (our sends would block): it waits for us to read.
        while time.monotonic() < deadline and sent < most:
            try:
                sent += conn.send(burst)
            except (BlockingIOError, ssl.SSLWantWriteError):
                break
            except (BrokenPipeError, ConnectionResetError):
                break  # cut off already
        assert sent < most, "the server read everything without its answers being read"
        # The server lets go of it (the kernel may still hold its unsent bytes a while: not the process's).
        while ours & servers.connections(listener):
            assert time.monotonic() < deadline, "a client that never reads kept its connection"
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- body limit

# A path on each listener whose request body is read (the metrics listener reads every body, to refuse it).
BODY_PATHS = {"verbs": "/filter", "webhook": "/mutate", "metrics": "/metrics"}


def _chunked(path: str, chunks: int) -> bytes:
    piece = b" " * 16384
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode()
        + b"%x\r\n%s\r\n" % (len(piece), piece) * chunks
    )


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize(
    "declared", [True, False], ids=["declared length over the limit", "chunked body passing the limit"]
)
def test_a_body_over_the_limit_gets_413_and_the_connection_closes(
    servers: Servers, listener: str, declared: bool
) -> None:
    path = BODY_PATHS[listener]
    # Declared: refused unread (none of the body is sent). Chunked: refused once the count passes the limit,
    # with the request's end never sent.
    raw = (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (path.encode(), BODY_CAP + 1)
        if declared
        else _chunked(path, BODY_CAP // 16384 + 2)
    )
    with servers.connect(listener) as conn:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
            conn.sendall(raw)
        reader = Reader(conn)
        status, headers, body = reader.answer()
        assert status == 413 and headers["connection"] == "close"
        assert "--max-request-bytes" in orjson.loads(body)["Error"]
        assert reader.closed()


# ---------------------------------------------------------------------------------------------- order


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize(
    ("second", "status"),
    [
        (PAST_ONE_READ, 431),
        (b"POST /nothing HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (BODY_CAP + 1), 413),
        (b"this is not http\r\n\r\n", 400),
    ],
    ids=["head over the cap", "body over the limit", "not http"],
)
def test_a_refused_pipelined_request_is_answered_after_the_one_before_it(
    servers: Servers, listener: str, second: bytes, status: int
) -> None:
    with servers.connect(listener) as conn:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
            conn.sendall(_first(listener) + second)
        reader = Reader(conn)
        first, refused = reader.answer(), reader.answer()
        assert first[0] == 200 and "connection" not in first[1]
        if listener == "verbs":
            assert "Error" in orjson.loads(first[2])  # the bind's own answer, whatever it says
        assert refused[0] == status and refused[1]["connection"] == "close"
        assert reader.closed()


@pytest.mark.parametrize("listener", LISTENERS)
def test_head_gets_no_body(servers: Servers, listener: str) -> None:
    with servers.connect(listener) as conn:
        conn.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + HEALTHZ)
        reader = Reader(conn)
        status, headers, _ = reader.answer(head_only=True)
        assert status == 200 and headers["content-length"] == "15"
        # Had the HEAD answer carried its body, these bytes would be it, not the next status line.
        status, _, body = reader.answer()
        assert (status, body) == (200, b'{"status":"ok"}')


@pytest.mark.parametrize(
    ("listener", "path", "body", "statuses"),
    [
        *[
            pytest.param(name, path, body, [100, 200], id=f"{name} {path} wanted")
            for name, (path, body) in WANTED.items()
        ],
        *[pytest.param(name, "/nothing", b"{}", [404], id=f"{name} not wanted") for name in LISTENERS],
    ],
)
def test_100_continue_only_when_the_body_is_wanted(
    servers: Servers, listener: str, path: str, body: bytes, statuses: list[int]
) -> None:
    with servers.connect(listener) as conn:
        conn.sendall(post(path, body, b"Expect: 100-continue\r\n") + HEALTHZ)
        reader = Reader(conn)
        got = [reader.answer()[0] for _ in range(len(statuses) + 1)]
    assert got == [*statuses, 200]  # the /healthz after it: nothing else came in between


@pytest.mark.parametrize(("listener", "path", "body"), [(name, p, b) for name, (p, b) in WANTED.items()])
def test_100_continue_waits_for_the_answers_before_it(servers: Servers, listener: str, path: str, body: bytes) -> None:
    head, _, rest = post(path, body, b"Expect: 100-continue\r\n").partition(b"\r\n\r\n")
    with servers.connect(listener) as conn:
        conn.sendall(_first(listener) + head + b"\r\n\r\n")
        reader = Reader(conn)
        assert reader.answer()[0] == 200  # the earlier request's answer first
        assert reader.answer()[0] == 100
        conn.sendall(rest)
        assert reader.answer()[0] == 200


# ---------------------------------------------------------------------------------------------- the meter


class Recorder:
    """A parser stand-in: records the size of each piece it is fed (a head that never ends)."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def feed_data(self, data: memoryview) -> None:
        self.fed.append(len(data))


@pytest.mark.parametrize(
    ("chunks", "fits", "fed"),
    [
        ([b"a" * 100], True, [100]),
        ([b"a" * 1000, b"a" * 1000, b"a" * 100], False, [1000, 1000, 49]),  # stops at limit + 1
        ([b"a" * 10_000], False, [2049]),  # one read far past the limit: the parser sees limit + 1 of it
    ],
    ids=["small head", "head over several reads", "one huge read"],
)
def test_the_head_meter_stops_feeding_one_byte_past_the_limit(chunks: list[bytes], fits: bool, fed: list[int]) -> None:
    meter = HeadMeter(2048)
    parser = Recorder()
    results = [meter.feed(parser, c) for c in chunks]
    assert results[-1] is fits and all(results[:-1])
    assert parser.fed == fed


# ---------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-header-bytes", "100"),
        ("--read-timeout-seconds", "0"),
        ("--idle-timeout-seconds", "-1"),
        ("--max-connections", "0"),
    ],
)
def test_a_bad_listener_limit_is_refused_naming_its_flag(flag: str, value: str) -> None:
    with pytest.raises(ValidationError) as err:
        load_settings([flag, value])
    assert describe_error(err.value).startswith(f"{flag} (GPUTOPO_{flag[2:].upper().replace('-', '_')}):")


def test_the_limits_come_from_the_settings() -> None:
    settings = load_settings(["--max-header-bytes", "8192", "--read-timeout-seconds", "2.5"])
    limits = ListenerLimits.of(settings)
    assert (limits.max_header_bytes, limits.read_timeout_s) == (8192, 2.5)
    assert (limits.idle_timeout_s, limits.max_connections) == (120.0, 256)


def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    # In a child process: the test run's own limit stays as it is.
    code = (
        "import json, resource; from extender.main import raise_nofile_limit; "
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard)); "
        "print(json.dumps([raise_nofile_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    (before, after), (soft, hard) = orjson.loads(out.stdout)
    assert before <= 256 and after == soft == hard


class _Messages:
    """httptools' callbacks, recording each message's (url, header count, body) and driving the meter."""

    def __init__(self, meter: HeadMeter | None = None) -> None:
        self.meter = meter
        self.done: list[tuple[bytes, int, bytes]] = []
        self._cur = (b"", 0, b"")

    def on_url(self, url: bytes) -> None:
        self._cur = (self._cur[0] + url, self._cur[1], self._cur[2])

    def on_header(self, name: bytes, value: bytes) -> None:
        self._cur = (self._cur[0], self._cur[1] + 1, self._cur[2])

    def on_headers_complete(self) -> None:
        if self.meter is not None:
            self.meter.head_done()

    def on_body(self, body: bytes) -> None:
        self._cur = (self._cur[0], self._cur[1], self._cur[2] + body)

    def on_message_complete(self) -> None:
        if self.meter is not None:
            self.meter.message_done()
        self.done.append(self._cur)
        self._cur = (b"", 0, b"")


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 3000), st.integers(0, 2000)), min_size=1, max_size=6
    ),  # (header value size, body size): every head under the cap
    cuts=st.lists(st.integers(1, 40_000), max_size=8),
)
def test_the_head_meter_never_refuses_heads_under_the_cap_however_the_stream_is_cut(
    requests: list[tuple[int, int]], cuts: list[int]
) -> None:
    stream = b"".join(
        b"POST /r%d HTTP/1.1\r\nX-Pad: %s\r\nContent-Length: %d\r\n\r\n%s" % (i, b"p" * pad, size, b"b" * size)
        for i, (pad, size) in enumerate(requests)
    )
    whole = _Messages()
    httptools.HttpRequestParser(whole).feed_data(stream)
    meter = HeadMeter(4096)
    metered = _Messages(meter)
    parser = httptools.HttpRequestParser(metered)
    at = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        if cut > at:
            assert meter.feed(parser, stream[at:cut])
            at = cut
    assert metered.done == whole.done and len(whole.done) == len(requests)
