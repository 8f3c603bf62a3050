"""The limits every listener holds to (gputopo/extender/http/uvicornprotocol.py), over raw sockets against each of the
three
listeners on the server production gives it: the verbs' own server, uvicorn for the webhook (TLS) and the
metrics. Small limits (a 8 KiB head, 1 s timeouts) keep the waits short; every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
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

from gputopo.extender.app import Listeners, create_listeners
from gputopo.extender.http.refusals import HeadMeter
from gputopo.extender.http.verbserver import VerbServer
from gputopo.extender.main import ListenerServer, listener_config
from gputopo.extender.settings import ListenerLimits, Settings, describe_error, load_settings
from gputopo.listenguard.acceptgate import HandshakePace
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
from tests.paths import REPO

HEAD_CAP = 8 * 1024
BODY_CAP = 64 * 1024
LIMITS = ListenerLimits(
    max_header_bytes=HEAD_CAP, read_timeout_s=1.0, idle_timeout_s=1.0, max_connections=64, handshake_timeout_s=1.0
)
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

    def connect(self, listener: str, source: str = "127.0.0.1") -> socket.socket:
        """A connection from `source` (any loopback address: a peer of its own), TLS on the webhook."""
        conn = self.raw(listener, source)
        if listener == "webhook":
            context = ssl.create_default_context(cafile=str(self.ca))
            conn = context.wrap_socket(conn, server_hostname="127.0.0.1")
        return conn

    def raw(self, listener: str, source: str = "127.0.0.1") -> socket.socket:
        """A plain TCP connection, no TLS even on the webhook."""
        address = ("127.0.0.1", self.ports[listener])
        return socket.create_connection(address, timeout=WAIT_S, source_address=(source, 0))

    def slots(self, listener: str) -> int:
        """The connections the listener counts against its cap (from their accept)."""
        return int(self.servers[listener].slots.total)


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
    limits = ListenerLimits(
        max_header_bytes=HEAD_CAP, read_timeout_s=WAIT_S, idle_timeout_s=60, max_connections=2, handshake_timeout_s=60
    )
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


@pytest.mark.parametrize(
    ("listener", "partial"),
    [
        *[pytest.param(name, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", id=f"head-{name}") for name in LISTENERS],
        # A body only where one is read (any other is refused from its head: tests/adversarial).
        *[
            pytest.param(name, b"POST %s HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}" % path.encode(), id=f"body-{name}")
            for name, (path, _) in WANTED.items()
        ],
    ],
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


def refused(servers: Servers, listener: str, flag: str, source: str = "127.0.0.1") -> bool:
    """Whether a new connection from `source` is refused at once: over plain TCP a 503 naming `flag`, then
    the close; on the webhook the close before the handshake (its handshake fails)."""
    if listener == "webhook":
        try:
            with servers.connect(listener, source):
                return False
        except (ssl.SSLError, OSError):
            return True
    with servers.connect(listener, source) as conn:
        reader = Reader(conn)
        status, headers, body = reader.answer()
        return status == 503 and headers["connection"] == "close" and flag in orjson.loads(body)["Error"]


def served(servers: Servers, listener: str, source: str = "127.0.0.1") -> socket.socket | None:
    """A new connection from `source` that /healthz was answered on (kept alive), or None."""
    try:
        conn = servers.connect(listener, source)
    except (ssl.SSLError, OSError):
        return None
    conn.sendall(HEALTHZ)
    try:
        if Reader(conn).answer()[0] == 200:
            return conn
    except (AssertionError, OSError):
        pass
    conn.close()
    return None


def eventually_served(servers: Servers, listener: str) -> None:
    """The server counts a close when it sees it: poll for a new connection being served, bounded."""
    deadline = time.monotonic() + WAIT_S
    while (conn := served(servers, listener)) is None:
        assert time.monotonic() < deadline, "a closed connection's slot was never freed"
        time.sleep(0.05)
    conn.close()


def counted(servers: Servers, listener: str, expected: int) -> None:
    """Wait, bounded, until the listener counts `expected` connections."""
    deadline = time.monotonic() + WAIT_S
    while (now := servers.slots(listener)) != expected:
        assert time.monotonic() < deadline, f"the {listener} listener counts {now} connections, not {expected}"
        time.sleep(0.02)


@pytest.mark.parametrize("listener", LISTENERS)
def test_connections_past_the_cap_are_refused_until_one_closes(two_only: Servers, listener: str) -> None:
    held = [two_only.connect(listener) for _ in range(2)]
    try:
        for conn in held:  # both accepted and counted: each has answered
            conn.sendall(HEALTHZ)
            assert Reader(conn).answer()[0] == 200
        assert refused(two_only, listener, "--max-connections")
        held.pop().close()
        eventually_served(two_only, listener)
    finally:
        for conn in held:
            conn.close()


def client_hello(conn: socket.socket) -> None:
    """Send a TLS ClientHello on `conn` and go no further with the handshake."""
    context = ssl.create_default_context()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    conn.sendall(outgoing.read())


UNFINISHED = {"silent": lambda conn: None, "client hello only": client_hello}


@pytest.mark.parametrize("kind", UNFINISHED)
def test_connections_count_against_the_cap_before_their_handshake(two_only: Servers, kind: str) -> None:
    held = [two_only.raw("webhook") for _ in range(2)]
    try:
        for conn in held:
            UNFINISHED[kind](conn)
        assert refused(two_only, "webhook", "--max-connections")
        held.pop().close()
        eventually_served(two_only, "webhook")
    finally:
        for conn in held:
            conn.close()


@pytest.mark.parametrize("kind", UNFINISHED)
def test_a_connection_that_never_finishes_its_handshake_is_closed(servers: Servers, kind: str) -> None:
    with servers.raw("webhook") as conn:
        UNFINISHED[kind](conn)
        with contextlib.suppress(ConnectionResetError):  # the server's hello, if any, then the close
            while conn.recv(65536):
                pass
    deadline = time.monotonic() + WAIT_S
    while servers.slots("webhook"):  # its slot is free again
        assert time.monotonic() < deadline, "the slot of a closed handshake was never freed"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_per_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Two connections per client address, eight per listener, kept alive long enough to hold them."""
    limits = ListenerLimits(
        max_header_bytes=HEAD_CAP,
        read_timeout_s=WAIT_S,
        idle_timeout_s=60,
        max_connections=8,
        max_connections_per_peer=2,
        handshake_timeout_s=60,
    )
    yield from _serve(tmp_path_factory.mktemp("per-peer"), limits)


@pytest.mark.parametrize(
    ("listener", "hold"),
    [(listener, hold) for listener in ("webhook", "metrics") for hold in ("served", "silent", "dripping")],
)
def test_one_peer_is_refused_past_its_share_while_another_is_served(
    two_per_peer: Servers, listener: str, hold: str
) -> None:
    # The module's server outlives each case: wait until it has seen the last case's closes, and below
    # until it has counted both held connections (accepts and closes reach it when it runs, not at once).
    counted(two_per_peer, listener, 0)
    held: list[socket.socket] = []
    try:
        for _ in range(2):
            if hold == "served":
                conn = served(two_per_peer, listener)
            elif hold == "silent":
                conn = two_per_peer.raw(listener)
            else:  # a request head begun and never finished
                conn = two_per_peer.connect(listener)
                conn.sendall(b"GET /healthz HTTP/1.1\r\nX-Drip: x\r\n")
            assert conn is not None
            held.append(conn)
        counted(two_per_peer, listener, 2)
        assert refused(two_per_peer, listener, "--max-connections-per-peer")
        other = served(two_per_peer, listener, source="127.0.0.2")
        assert other is not None, "another address was not served"
        other.close()
    finally:
        for conn in held:
            conn.close()


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """One TLS handshake per address, then the next only after 100 s: past the handshake timeout."""
    limits = ListenerLimits(
        max_header_bytes=HEAD_CAP,
        read_timeout_s=WAIT_S,
        idle_timeout_s=60,
        handshake_timeout_s=WAIT_S,
        handshakes_per_peer_per_s=0.01,
    )
    yield from _serve(tmp_path_factory.mktemp("paced"), limits)


def test_an_address_past_its_handshake_pace_is_closed_before_the_handshake_while_another_is_served(
    paced: Servers,
) -> None:
    first = served(paced, "webhook")
    assert first is not None, "the first handshake of an address starts at once"
    try:
        assert refused(paced, "webhook", "")  # its next turn comes after the handshake timeout
        other = served(paced, "webhook", source="127.0.0.2")
        assert other is not None, "another address's handshake waited for the first's pace"
        other.close()
    finally:
        first.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("rate", "within_s", "steps", "expected"),
    [
        pytest.param(2.0, 10.0, [(0, "a"), (0, "a"), (0, "a")], [0.0, 0.0, 0.5], id="a-burst-of-rate-then-waits"),
        pytest.param(2.0, 10.0, [(0, "a"), (0, "a"), (0, "b")], [0.0, 0.0, 0.0], id="addresses-are-paced-apart"),
        pytest.param(2.0, 10.0, [(0, "a"), (0, "a"), (1, "a")], [0.0, 0.0, 0.0], id="a-second-refills-the-rate"),
        pytest.param(1.0, 1.5, [(0, "a"), (0, "a"), (0, "a")], [0.0, 1.0, None], id="past-the-timeout-is-refused"),
        pytest.param(0.01, 10.0, [(0, "a"), (0, "a")], [0.0, None], id="below-one-a-second-still-one-at-once"),
        pytest.param(0.0, 10.0, [(0, "a")] * 3, [0.0, 0.0, 0.0], id="zero-turns-the-pace-off"),
    ],
)
def test_the_handshake_pace_is_a_token_bucket_per_address(
    rate: float, within_s: float, steps: list[tuple[float, str]], expected: list[float | None]
) -> None:
    clock = _Clock()
    pace = HandshakePace(rate, within_s, clock)
    got = []
    for advance, peer in steps:
        clock.now += advance
        got.append(pace.delay(peer))
    assert got == expected


def test_a_refused_start_reserves_nothing() -> None:
    clock = _Clock()
    pace = HandshakePace(1.0, 1.5, clock)
    assert [pace.delay("a") for _ in range(4)] == [0.0, 1.0, None, None]
    clock.now += 1.0
    assert pace.delay("a") == 1.0  # two reservations stand (the refused ones took none)


def test_a_dripped_head_over_tls_is_cut_at_the_read_deadline_from_its_first_byte(servers: Servers) -> None:
    """One header line at a time, each well within the read timeout: the deadline runs from the head's
    first byte, not from the last line."""
    with servers.connect("webhook") as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\n")
        answer = b""
        deadline = time.monotonic() + WAIT_S
        line = 0
        conn.settimeout(0.2)
        while not answer:
            assert time.monotonic() < deadline, "a dripped head was never cut"
            with contextlib.suppress(ssl.SSLError, OSError):
                conn.sendall(b"X-Drip-%d: x\r\n" % line)
            line += 1
            with contextlib.suppress(TimeoutError):
                answer = conn.recv(4096)
        conn.settimeout(WAIT_S)
        with contextlib.suppress(ssl.SSLError, ConnectionResetError):  # the rest of the answer, then the close
            while chunk := conn.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 ")


CLUSTER = "nodes:\n  - {name: h1, fixture: dgx-h100}\n"
NOFILE = 128  # the extender's open-files limit below: fewer than the connections thrown at its webhook


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthz(port: int) -> int:
    """The status of /healthz on a new connection to the verbs listener (0: no answer)."""
    with contextlib.suppress(OSError, AssertionError), socket.create_connection(("127.0.0.1", port), WAIT_S) as c:
        c.sendall(HEALTHZ)
        return Reader(c).answer()[0]
    return 0


def test_the_verbs_answer_while_the_webhook_is_held_full_before_any_handshake(tmp_path: Path) -> None:
    """The real process, its open files limited: more silent connections than it may open files are thrown
    at the webhook, and a new connection to the verbs is still answered."""
    _, crt, key = certificate(tmp_path)
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    verbs, webhook = _free_port(), _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gputopo.extender.main",
        "--snapshot",
        str(tmp_path / "cluster.yaml"),
        "--port",
        str(verbs),
    ]
    cmd += ["--webhook-host", "127.0.0.1", "--webhook-port", str(webhook), "--metrics-port", "0"]
    cmd += ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--log-level", "critical"]
    # The webhook's whole cap open to one address, and no handshake timeout before the test is done.
    env = {"GPUTOPO_MAX_CONNECTIONS": "16", "GPUTOPO_MAX_CONNECTIONS_PER_PEER": "16"}
    env["GPUTOPO_HANDSHAKE_TIMEOUT_SECONDS"] = "600"

    def nofile() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    root = REPO
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env={**os.environ, **env, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=nofile,
    )
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while _healthz(verbs) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the extender did not start"
            time.sleep(0.1)
        for _ in range(2 * NOFILE):
            held.append(socket.create_connection(("127.0.0.1", webhook), timeout=WAIT_S))
        assert _healthz(verbs) == 200
    finally:
        for conn in held:
            conn.close()
        proc.terminate()
        proc.wait(WAIT_S)


def _client_certificate(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA for client certificates, and a client's certificate and key signed by it."""
    ca_key, ca, key, csr, crt, ext = (tmp / n for n in ("cca.key", "cca.crt", "c.key", "c.csr", "c.crt", "c.ext"))
    ext.write_text("extendedKeyUsage=clientAuth\n")
    for step in (
        f"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=client-ca -keyout {ca_key} -out {ca}",
        f"req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout {key} -out {csr}",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -days 1 -out {crt} -extfile {ext}",
    ):
        subprocess.run(["openssl", *step.split()], check=True, capture_output=True)
    return ca, crt, key


@pytest.mark.parametrize("presents", [True, False], ids=["with a client certificate", "without one"])
def test_the_webhook_app_sees_the_client_certificate_in_the_asgi_tls_extension(tmp_path: Path, presents: bool) -> None:
    ca, crt, key = certificate(tmp_path)
    client_ca, client_crt, client_key = _client_certificate(tmp_path)
    seen: list[Any] = []

    async def app(scope: Any, _receive: Any, send: Any) -> None:
        seen.append(scope.get("extensions", {}).get("tls", {}).get("client_cert_chain"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    limits = ListenerLimits(read_timeout_s=WAIT_S, handshake_timeout_s=WAIT_S)
    server = ListenerServer(listener_config(app, limits, (crt, key), client_ca), limits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        context = ssl.create_default_context(cafile=str(ca))
        if presents:
            context.load_cert_chain(client_crt, client_key)
        raw = socket.create_connection(sock.getsockname(), timeout=WAIT_S)
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            conn.sendall(HEALTHZ)
            assert Reader(conn).answer()[0] == 200
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
    chain = seen[0]
    if presents:
        assert len(chain) == 1
        assert ssl.PEM_cert_to_DER_cert(chain[0]) == ssl.PEM_cert_to_DER_cert(client_crt.read_text())
    else:
        assert chain == []


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

# A path on each listener that takes a POST (the metrics listener's takes no body: refused from the head).
BODY_PATHS = {"verbs": "/filter", "webhook": "/mutate", "metrics": "/metrics"}
TOO_LARGE_WORDS = {"verbs": "--max-request-bytes", "webhook": "--max-request-bytes", "metrics": "takes no request body"}


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
        assert TOO_LARGE_WORDS[listener] in orjson.loads(body)["Error"]
        assert reader.closed()


# ---------------------------------------------------------------------------------------------- order


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize(
    ("second", "status"),
    [
        (PAST_ONE_READ, 431),
        (b"GET /healthz HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (BODY_CAP + 1), 413),
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
        # A body nothing reads: refused from its head, no 100 Continue, and the connection closes.
        *[pytest.param(name, "/nothing", b"{}", [404], id=f"{name} not wanted") for name in LISTENERS],
    ],
)
def test_100_continue_only_when_the_body_is_wanted(
    servers: Servers, listener: str, path: str, body: bytes, statuses: list[int]
) -> None:
    with servers.connect(listener) as conn:
        conn.sendall(post(path, body, b"Expect: 100-continue\r\n") + HEALTHZ)
        reader = Reader(conn)
        got = [reader.answer()[0] for _ in range(len(statuses))]
        if statuses[-1] == 200:
            got.append(reader.answer()[0])  # the /healthz after it: nothing else came in between
        else:
            assert reader.closed()
    assert got == [*statuses, 200] if statuses[-1] == 200 else got == statuses


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
        ("--max-connections-per-peer", "0"),
        ("--handshake-timeout-seconds", "0"),
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
    assert (limits.handshake_timeout_s, limits.max_connections_per_peer) == (10.0, 64)
    assert limits.handshakes_per_peer_per_s == 20.0


@pytest.mark.parametrize(
    ("flags", "per_peer"),
    [
        ([], 64),
        (["--max-connections", "1000"], 250),
        (["--max-connections", "2"], 1),
        (["--max-connections", "1000", "--max-connections-per-peer", "900"], 900),
    ],
)
def test_one_address_gets_a_quarter_of_the_connections_unless_set(flags: list[str], per_peer: int) -> None:
    assert ListenerLimits.of(load_settings(flags)).max_connections_per_peer == per_peer


def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    # In a child process: the test run's own limit stays as it is.
    code = (
        "import json, resource; from gputopo.extender.main import raise_nofile_limit; "
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
