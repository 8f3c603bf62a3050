"""The extender's webhook and metrics listeners against hostile callers, over real sockets and real TLS, on the
server production runs (`ListenerServer`, `BoundedHttpTools`, `Gate`): what a caller can make them read, hold
and refuse to others.

- Bodies are decided from the request head: a caller the head refuses (no certificate, another name, a path
  that takes no body, a length over the limit) gets its answer with not one byte of the body read
  (`Slots.body_bytes`) and no `100 Continue`.
- The request bodies a listener holds at once are bounded over all its connections (`BodyBudget`), and
  given back when the connections close.
- Addresses that fill a listener (silent, dripping heads) cannot keep a probe from another address out.
- Reviews are parsed on bounded workers, never on the loop that answers the probes.

Every bound is asserted as a count (bytes read, bytes held, probes answered), never as a time; every wait
is bounded by WAIT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputopo.extender.app import create_listeners
from gputopo.extender.http.clientauth import ClientAuth
from gputopo.extender.http.heads import HeadPolicy
from gputopo.extender.http.workers import BoundedWorkers, Busy
from gputopo.extender.main import ListenerServer, _loop_factory, listener_config
from gputopo.extender.settings import ListenerLimits, Settings
from gputopo.extender.webhook import mutation
from tests.extender.harness import certificate, gputopo_pod, start_server

WAIT_S = 15.0
BODY_CAP = 64 * 1024
BUDGET = 4 * BODY_CAP
ALLOWED = "kube-apiserver-webhook-client"
LIMITS = ListenerLimits(
    read_timeout_s=5.0,
    idle_timeout_s=30.0,
    max_connections=32,
    max_connections_per_peer=8,
    handshake_timeout_s=5.0,
    handshakes_per_peer_per_s=0,  # no pace: the floods here open connections as fast as they can
    max_body_bytes_in_flight=BUDGET,
    max_request_bytes=BODY_CAP,  # an address's share of the budget: a quarter, at least one body
)
# One handshake a second over all addresses: a flood of a few connections keeps the queue long.
PACED = replace(LIMITS, handshakes_per_s=1.0)
REVIEW = orjson.dumps(
    {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": gputopo_pod("p", 1)},
    }
)
# A read of the server's: what it may take off the socket before the head is decided (asyncio reads
# 64 KiB, uvloop 256 KiB, TLS records of 16 KiB).
ONE_READ = 256 * 1024


def _openssl(tmp: Path, *args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found")
    subprocess.run([openssl, *args], check=True, capture_output=True, cwd=tmp)


def _client_cert(tmp: Path, ca: tuple[Path, Path], name: str, cn: str) -> tuple[Path, Path]:
    crt, key, csr, ext = (tmp / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    ext.write_text("extendedKeyUsage=clientAuth\n")
    _openssl(tmp, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", str(key), "-out", str(csr))
    _openssl(tmp, "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-out", str(crt), "-extfile", str(ext))  # fmt: skip
    return crt, key


@dataclass
class Served:
    port: int
    server: ListenerServer
    tls: bool
    server_ca: Path | None = None
    certs: dict[str, tuple[Path, Path]] = field(default_factory=dict)

    @property
    def slots(self) -> Any:
        return self.server.slots

    def connect(self, source: str = "127.0.0.1", cert: str | None = None) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S, source_address=(source, 0))
        if self.tls:
            assert self.server_ca is not None
            context = ssl.create_default_context(cafile=str(self.server_ca))
            if cert is not None:
                context.load_cert_chain(*map(str, self.certs[cert]))
            conn = context.wrap_socket(conn, server_hostname="127.0.0.1")
        return conn


def _start(
    app: Any, tls: tuple[Path, Path] | None = None, client_ca: Path | None = None, limits: ListenerLimits = LIMITS
) -> tuple[ListenerServer, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = ListenerServer(listener_config(app, limits, tls, client_ca), limits)

    def run() -> None:  # on uvloop where installed, as `gputopo-extender` runs it
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(server.serve(sockets=[sock]))

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return server, int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """The webhook with client auth (the API server's certificate), the metrics listener, over one cluster."""
    tmp = tmp_path_factory.mktemp("adversarial-listeners")
    server_ca, crt, key = certificate(tmp)
    client_ca = tmp / "client-ca.crt", tmp / "client-ca.key"
    _openssl(tmp, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=client-ca",
             "-keyout", str(client_ca[1]), "-out", str(client_ca[0]))  # fmt: skip
    certs = {
        "api server": _client_cert(tmp, client_ca, "apiserver", ALLOWED),
        "another name": _client_cert(tmp, client_ca, "mallory", "mallory"),
    }
    (tmp / "cluster.yaml").write_text("nodes:\n  - {name: h1, fixture: dgx-h100}\n")
    settings = Settings(
        snapshot=tmp / "cluster.yaml",
        webhook_port=1,  # not bound: the servers below take free ports
        tls_cert_file=crt,
        tls_key_file=key,
        webhook_client_ca_file=client_ca[0],
        webhook_client_names=ALLOWED,
        max_request_bytes=BODY_CAP,
        max_body_bytes_in_flight=BUDGET,
        log_level="critical",
    )
    made = create_listeners(settings)
    hook, hook_port = _start(made.webhook, (crt, key), client_ca[0])
    metrics, metrics_port = _start(made.metrics)
    paced, paced_port = _start(made.webhook, (crt, key), client_ca[0], PACED)
    verbs, verbs_thread, verbs_url = start_server(made.door, LIMITS)
    yield {
        "webhook": Served(hook_port, hook, True, server_ca, certs),
        "paced webhook": Served(paced_port, paced, True, server_ca, certs),
        "metrics": Served(metrics_port, metrics, False),
        "verbs": Served(int(verbs_url.rsplit(":", 1)[1]), verbs, False),  # type: ignore[arg-type]
    }
    hook.should_exit = metrics.should_exit = paced.should_exit = verbs.should_exit = True
    verbs_thread.join(10)
    made.door.close()


def _answer(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The first answer on `conn` (status, lower-cased headers, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        assert chunk, f"closed without an answer: {buf[:200]!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    size = int(headers.get("content-length", "0"))
    while len(rest) < size:
        chunk = conn.recv(65536)
        assert chunk, "closed in the middle of an answer"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:size]


def _closed(conn: socket.socket) -> bool:
    try:
        while chunk := conn.recv(65536):
            del chunk
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    return True


def _eventually(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- from the head

BIG = 8 * 1024 * 1024  # what the flood declared: the default --max-request-bytes


@pytest.mark.parametrize(
    ("listener", "cert", "head", "status", "words"),
    [
        pytest.param(
            "webhook", None, b"POST /mutate", 401, "client certificate", id="forged review, no certificate: 401 unread"
        ),
        pytest.param(
            "webhook", "another name", b"POST /mutate", 403, "mallory", id="the CA's other certificate: 403 unread"
        ),
        pytest.param(
            "webhook",
            "api server",
            b"POST /mutate",
            413,
            "--max-request-bytes",
            id="the API server past the limit: 413 unread",
        ),
        pytest.param(
            "webhook",
            None,
            b"GET /healthz",
            413,
            "takes no request body",
            id="webhook probe path with a body: 413 unread",
        ),
        pytest.param(
            "webhook", None, b"POST /elsewhere", 404, "not served", id="webhook unknown path with a body: 404 unread"
        ),
        pytest.param(
            "webhook",
            "api server",
            b"PUT /mutate",
            405,
            "takes POST",
            id="webhook body path, another method: 405 unread",
        ),
        pytest.param(
            "metrics",
            None,
            b"GET /healthz",
            413,
            "takes no request body",
            id="metrics probe path with a body: 413 unread",
        ),
        pytest.param(
            "metrics", None, b"POST /metrics", 413, "takes no request body", id="metrics path posted: 413 unread"
        ),
        pytest.param("metrics", None, b"POST /mutate", 404, "not served", id="metrics, the webhook's path: 404 unread"),
    ],
)
@pytest.mark.parametrize("continue_", [False, True], ids=["", "Expect: 100-continue"])
def test_a_body_the_head_refuses_is_answered_without_reading_a_byte_of_it(
    listeners: dict[str, Served], listener: str, cert: str | None, head: bytes, status: int, words: str, continue_: bool
) -> None:
    served = listeners[listener]
    body_before, bytes_before = served.slots.body_bytes, served.slots.bytes_received
    expect = b"Expect: 100-continue\r\n" if continue_ else b""
    request = head + b" HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (expect, BIG)
    with served.connect(cert=cert) as conn:
        # What a flood sends at once: the head and the first of its body (the kernel's buffers take it).
        with contextlib.suppress(OSError):
            conn.sendall(request + b"x" * ONE_READ)
        got, headers, answer = _answer(conn)
        assert (got, headers["connection"]) == (status, "close")  # the refusal first: no 100 Continue
        assert words in orjson.loads(answer)["Error"]
        assert _closed(conn)
    assert served.slots.body_bytes == body_before  # not one byte of the body reached the parser
    assert served.slots.bytes_received - bytes_before <= len(request) + ONE_READ


@pytest.mark.parametrize(
    ("listener", "cert", "raw", "status"),
    [
        pytest.param(
            "metrics",
            None,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
            413,
            id="metrics chunked probe: 413",
        ),
        pytest.param(
            "webhook",
            None,
            b"POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
            401,
            id="chunked forged review: 401",
        ),
        pytest.param(
            "webhook",
            None,
            b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
            401,
            id="empty forged review: 401",
        ),
        pytest.param(
            "webhook",
            "api server",
            b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
            400,
            id="negative length: the parser's 400",
        ),
        pytest.param(
            "webhook",
            "api server",
            b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 9" + b"9" * 30 + b"\r\n\r\n",
            400,
            id="length of 31 digits: the parser's 400",
        ),
    ],
)
def test_malformed_and_chunked_bodies_are_refused_from_the_head(
    listeners: dict[str, Served], listener: str, cert: str | None, raw: bytes, status: int
) -> None:
    served = listeners[listener]
    body_before = served.slots.body_bytes
    with served.connect(cert=cert) as conn:
        with contextlib.suppress(OSError):
            conn.sendall(raw + b"4000\r\n" + b"x" * 0x4000 + b"\r\n")
        got, headers, _ = _answer(conn)
        assert (got, headers["connection"]) == (status, "close")
    assert served.slots.body_bytes == body_before


def test_the_api_server_is_answered_and_its_body_read(listeners: dict[str, Served]) -> None:
    served = listeners["webhook"]
    before = served.slots.body_bytes
    with served.connect(cert="api server") as conn:
        conn.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(REVIEW), REVIEW))
        status, _, answer = _answer(conn)
    assert status == 200 and orjson.loads(answer)["response"]["uid"] == "u-1"
    assert served.slots.body_bytes - before == len(REVIEW)


# ---------------------------------------------------------------------------------------------- the budget


BUDGETED = {"webhook": "/mutate", "verbs": "/filter"}  # the listeners that read bodies, and a path of each


def _budget(served: Served) -> Any:
    server: Any = served.server
    return server.budget


@pytest.mark.parametrize("listener", list(BUDGETED))
def test_bodies_held_at_once_stay_within_the_listeners_budget_and_are_given_back_on_close(
    listeners: dict[str, Served], listener: str
) -> None:
    """Connections that declare the largest body and send half of it: they hold the budget until it is
    full, the next is refused 503 from its head, and closing them gives every byte back."""
    served = listeners[listener]
    budget = _budget(served)
    cert = "api server" if listener == "webhook" else None
    _eventually("the budget is idle", lambda: budget.held == 0)
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (BUDGETED[listener].encode(), BODY_CAP)
    held: list[socket.socket] = []
    try:
        for i in range(BUDGET // BODY_CAP):  # from as many addresses: one's share is a quarter (one body)
            conn = served.connect(f"127.0.5.{i + 1}", cert=cert)
            conn.sendall(head + b"{" * (BODY_CAP // 2))
            held.append(conn)
        _eventually("the slow bodies hold the budget", lambda: budget.held == BUDGET)
        with served.connect(cert=cert) as conn:
            conn.sendall(head + b"{" * 1024)
            status, _, answer = _answer(conn)
        assert status == 503 and "--max-body-bytes-in-flight" in orjson.loads(answer)["Error"]
        assert budget.peak <= BUDGET
    finally:
        for conn in held:
            conn.close()
    _eventually("the closed connections' bytes are given back", lambda: budget.held == 0)
    # and the listener reads a body again, giving its bytes back once answered
    body = REVIEW if listener == "webhook" else b"{}"
    with served.connect(cert=cert) as conn:
        conn.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (BUDGETED[listener].encode(), len(body), body)
        )
        assert _answer(conn)[0] in (200, 400)  # the verbs' answer to "{}" names what is missing
    _eventually("an answered body's bytes are given back", lambda: budget.held == 0)


def test_one_address_holds_at_most_its_share_of_the_budget_while_another_is_read(
    listeners: dict[str, Served],
) -> None:
    """The webhook: one address's slow body holds its share (a quarter, one body here); its next is refused
    503 naming the share, and a body from another address is read and answered."""
    served = listeners["webhook"]
    budget = _budget(served)
    _eventually("the budget is idle", lambda: budget.held == 0)
    head = b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BODY_CAP
    with served.connect("127.0.6.1", cert="api server") as slow:
        slow.sendall(head + b"{" * (BODY_CAP // 2))
        _eventually("the slow body holds its share", lambda: budget.by_peer["127.0.6.1"] == BODY_CAP)
        with served.connect("127.0.6.1", cert="api server") as conn:
            conn.sendall(head)
            status, _, answer = _answer(conn)
        assert status == 503 and "127.0.6.1" in orjson.loads(answer)["Error"]
        with served.connect("127.0.6.2", cert="api server") as conn:
            conn.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(REVIEW), REVIEW))
            assert _answer(conn)[0] == 200
    _eventually("the closed connection's bytes are given back", lambda: budget.held == 0 and not budget.by_peer)


@pytest.mark.parametrize(
    ("held", "declared", "fits"),
    [
        pytest.param(0, BUDGET, True, id="the whole budget, idle: fits"),
        pytest.param(BODY_CAP, BUDGET - BODY_CAP, True, id="exactly the rest: fits"),
        pytest.param(BODY_CAP, BUDGET - BODY_CAP + 1, False, id="one byte past the rest: 503"),
    ],
)
def test_the_budget_admits_a_body_only_while_it_fits(held: int, declared: int, fits: bool) -> None:
    from gputopo.extender.http.heads import BodyBudget

    budget = BodyBudget(BUDGET)
    assert budget.take(held)
    assert budget.take(declared) is fits
    assert budget.held == held + (declared if fits else 0)


@pytest.mark.parametrize(
    ("takes", "refused"),
    [
        pytest.param([("a", BODY_CAP), ("b", BODY_CAP)], [], id="two addresses, a share each: both fit"),
        pytest.param([("a", BODY_CAP), ("a", 1)], [1], id="one byte past an address's share: refused"),
        pytest.param([("a", BODY_CAP), ("a", 1), ("b", 1)], [1], id="another address fits meanwhile"),
        pytest.param([(p, BODY_CAP) for p in "abcd"] + [("e", 1)], [4], id="past the whole budget: refused"),
    ],
)
def test_the_budget_holds_each_address_to_its_share(takes: list[tuple[str, int]], refused: list[int]) -> None:
    from gputopo.extender.http.heads import BodyBudget

    budget = BodyBudget(BUDGET, per_peer=BODY_CAP)
    got = [i for i, (peer, size) in enumerate(takes) if not budget.take(size, peer)]
    assert got == refused
    assert budget.held == sum(size for i, (_, size) in enumerate(takes) if i not in refused) <= BUDGET


# ---------------------------------------------------------------------------------------------- the head policy


AUTH = {"/mutate": ClientAuth.of([ALLOWED])}
POLICY = HeadPolicy(
    paths=frozenset({"/mutate", "/healthz"}),
    body_paths=frozenset({"/mutate"}),
    guarded=AUTH,
    max_request_bytes=BODY_CAP,
)


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        pytest.param(b"GET", "/healthz", [], None, id="probe without a body: served"),
        pytest.param(b"GET", "/healthz", [(b"content-length", b"0")], None, id="probe with an empty body: served"),
        pytest.param(b"GET", "/healthz", [(b"content-length", b"1")], 413, id="probe with a body: 413"),
        pytest.param(b"POST", "/mutate", [], 401, id="review without a certificate: 401, whatever its body"),
        pytest.param(b"POST", "/mut%61te", [], 401, id="the guarded path percent-encoded: still 401"),
        pytest.param(b"GET", "/x", [(b"transfer-encoding", b"chunked")], 404, id="chunked body to no path: 404"),
        pytest.param(b"GET", "/x", [], None, id="no body to no path: the app's own 404, connection kept"),
        pytest.param(b"GET", "/healthz", [(b"content-length", b"\xd9\xa4")], 413, id="a length in Arabic digits: 413"),
    ],
)
def test_the_head_policy_decides_from_method_path_length_and_certificate(
    method: bytes, path: str, headers: list[tuple[bytes, bytes]], status: int | None
) -> None:
    decision = POLICY.decide(method, path, headers, None)
    assert (decision.refusal[0] if decision.refusal else None) == status


# ---------------------------------------------------------------------------------------------- many addresses

FLOOD_ADDRESSES = [f"127.0.0.{i}" for i in range(2, 10)]  # 8 addresses x 8 connections: twice the listener
PROBES = 10


def _probe(served: Served, source: str) -> bool:
    """The kubelet's probe: a fresh connection, GET /healthz, closed."""
    try:
        with served.connect(source) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return _answer(conn)[0] == 200
    except (OSError, AssertionError):
        return False


def _flood(served: Served, how: str) -> list[socket.socket]:
    """Every address opens its share of connections (past the listener's size), silent or dripping a head."""
    held = []
    for source in FLOOD_ADDRESSES:
        for _ in range(LIMITS.max_connections_per_peer):
            try:
                conn = served.connect(source)
                if how == "dripping heads":
                    conn.sendall(b"GET /healthz HTTP/1.1\r\nX-Drip: ")
                held.append(conn)
            except (OSError, ssl.SSLError):
                pass
    return held


@pytest.mark.parametrize("listener", ["metrics", "webhook"])
@pytest.mark.parametrize("how", ["silent", "dripping heads"])
def test_addresses_that_fill_the_listener_cannot_keep_a_probe_from_another_address_out(
    listeners: dict[str, Served], listener: str, how: str
) -> None:
    served = listeners[listener]
    evicted = served.slots.evicted
    held = _flood(served, how)
    try:
        _eventually("the flood fills the listener", lambda: served.slots.total >= LIMITS.max_connections)
        answered = sum(_probe(served, f"127.0.1.{i}") for i in range(1, PROBES + 1))
        assert answered == PROBES
        assert served.slots.evicted - evicted >= PROBES  # each probe took a flood connection's place
        assert served.slots.total <= LIMITS.max_connections
        assert max(served.slots.per_peer.values()) <= LIMITS.max_connections_per_peer
    finally:
        for conn in held:
            conn.close()
    _eventually("the flood's slots are given back", lambda: served.slots.total == 0)


def test_the_api_servers_connections_are_never_the_ones_making_room(listeners: dict[str, Served]) -> None:
    """Its kept-alive connections from one address, the listener then flooded from many: each of them still
    answers a review."""
    served = listeners["webhook"]
    mine = [served.connect("127.0.2.1", cert="api server") for _ in range(4)]
    held = _flood(served, "silent")
    try:
        _eventually("the flood fills the listener", lambda: served.slots.total >= LIMITS.max_connections)
        for conn in mine:
            conn.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(REVIEW), REVIEW))
            assert _answer(conn)[0] == 200
    finally:
        for conn in [*mine, *held]:
            conn.close()
    _eventually("the slots are given back", lambda: served.slots.total == 0)


def test_a_handshake_flood_from_many_addresses_waits_its_turns_while_the_api_server_connects_at_once(
    listeners: dict[str, Served],
) -> None:
    """The listener starts one handshake a second over all addresses: 8 addresses' silent connections wait
    their turns, round-robin, while the API server's address (known from its first connection, which took
    the one turn free) opens new connections whose handshakes start at once and whose reviews are answered,
    far more of them than the flood's turns would allow within the handshake timeout."""
    served = listeners["paced webhook"]
    gate: Any = served.server.servers[0]

    def review(conn: socket.socket) -> int:
        conn.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(REVIEW), REVIEW))
        return _answer(conn)[0]

    with served.connect("127.0.3.1", cert="api server") as first:
        assert review(first) == 200
    held = [
        socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S, source_address=(source, 0))
        for source in FLOOD_ADDRESSES[:4]
        for _ in range(2)
    ]
    try:
        _eventually("the flood waits for its turns", lambda: len(gate.turns.waiting) >= 3)
        for _ in range(2 * int(LIMITS.handshake_timeout_s)):  # more than the turns within a handshake timeout
            with served.connect("127.0.3.1", cert="api server") as conn:
                assert review(conn) == 200
    finally:
        for conn in held:
            conn.close()
    _eventually("the flood's slots are given back", lambda: served.slots.total == 0)


# ---------------------------------------------------------------------------------------------- reviews off the loop


def test_reviews_are_parsed_off_the_loop_so_probes_answer_while_every_worker_is_held(
    listeners: dict[str, Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reviews held inside their parse (the workers busy, as under a burst of pod creations): the listener's
    own probes are still answered, and the API server's reviews past one address's share are queued, not
    refused (a refused review leaves its pod unmutated): every one is answered once the workers are free."""
    served = listeners["webhook"]
    release = threading.Event()
    threads: list[str] = []
    admit = mutation.admit_pod

    def held_admit(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        release.wait(WAIT_S)
        return admit(*a, **kw)

    monkeypatch.setattr(mutation, "admit_pod", held_admit)
    app: Any = served.server.config.app
    app.state.review_workers = BoundedWorkers(per_peer=2)  # the API server's burst passes this share
    reviews = b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(REVIEW), REVIEW)
    burst = LIMITS.max_connections_per_peer - 2  # three times the share, within the connections of one address
    conns: list[socket.socket] = []
    try:
        for i in range(burst):
            conn = served.connect("127.0.3.1", cert="api server")
            conn.sendall(reviews)
            conns.append(conn)
            _eventually("the review is queued", functools.partial(_queued, served, i + 1))
        answered = sum(_probe(served, "127.0.4.1") for _ in range(PROBES))
        assert answered == PROBES
        release.set()
        assert [_answer(conn)[0] for conn in conns] == [200] * burst
    finally:
        release.set()
        for conn in conns:
            conn.close()
        app.state.review_workers = None
    assert threads and all(name.startswith("gputopo-review") for name in threads)


def _queued(served: Served, count: int) -> bool:
    """Whether the webhook app's workers hold `count` reviews (queued or running)."""
    app: Any = served.server.config.app
    workers: BoundedWorkers = app.state.review_workers
    return workers.pending == count


@pytest.mark.parametrize(
    ("queue", "per_peer", "peers", "trusted", "refused"),
    [
        pytest.param(4, 2, ["a", "a", "a"], False, 1, id="one address past its share: refused"),
        pytest.param(4, 2, ["a", "a", "a"], True, 0, id="the API server past one address's share: queued"),
        pytest.param(4, 2, ["a", "a", "b", "b", "c"], False, 1, id="past the whole queue: refused"),
        pytest.param(4, 2, ["a", "a", "a", "a", "a"], True, 1, id="the API server past the whole queue: refused"),
        pytest.param(4, 2, ["a", "b", "c", "d"], False, 0, id="four addresses within both: all queued"),
    ],
)
def test_the_review_queue_is_bounded_in_all_and_per_address(
    queue: int, per_peer: int, peers: list[str], trusted: bool, refused: int
) -> None:
    async def scenario() -> int:
        workers = BoundedWorkers(workers=1, queue=queue, per_peer=per_peer)
        gate = threading.Event()
        outcomes = await asyncio.gather(
            *(workers.run(p, lambda: gate.wait(WAIT_S), trusted=trusted) for p in peers[:-1]),
            _last(workers, peers[-1], gate),
            return_exceptions=True,
        )
        workers.close()
        return sum(isinstance(o, Busy) for o in outcomes)

    async def _last(workers: BoundedWorkers, peer: str, gate: threading.Event) -> bool:
        await asyncio.sleep(0)  # the others are queued first
        try:
            return await workers.run(peer, lambda: True, trusted=trusted)
        finally:
            gate.set()

    assert asyncio.run(scenario()) == refused


@pytest.mark.parametrize(
    ("arrivals", "started"),
    [
        pytest.param("aaaab", "aabaa", id="a backlog of one address: another's call starts second in line"),
        pytest.param("aaabbc", "aabcab", id="three addresses: one call each in turn"),
        pytest.param("abab", "abab", id="alternating arrivals: in arrival order"),
    ],
)
def test_waiting_reviews_start_round_robin_by_address(arrivals: str, started: str) -> None:
    """One worker, held by the first call while the rest queue: the order the others start in."""

    async def scenario() -> str:
        workers = BoundedWorkers(workers=1, queue=64, per_peer=64)
        gate = threading.Event()
        order: list[str] = []

        def call(peer: str) -> None:
            order.append(peer)
            gate.wait(WAIT_S)

        runs = [asyncio.ensure_future(workers.run(p, functools.partial(call, p))) for p in arrivals]
        await asyncio.sleep(0)  # every call queued behind the first, which holds the worker
        gate.set()
        await asyncio.gather(*runs)
        workers.close()
        return "".join(order)

    assert asyncio.run(scenario()) == started


@pytest.mark.parametrize(
    ("cert", "declared", "outcome"),
    [
        pytest.param(None, 10, "unauthenticated", id="no certificate: counted unauthenticated"),
        pytest.param("another name", 10, "forbidden", id="another name: counted forbidden"),
        pytest.param("api server", BODY_CAP + 1, "too_large", id="past the limit: counted too_large"),
    ],
)
def test_reviews_refused_from_the_head_are_counted_as_mutate_decisions(
    listeners: dict[str, Served], cert: str | None, declared: int, outcome: str
) -> None:
    served = listeners["webhook"]
    app: Any = served.server.config.app
    registry = app.state.metrics.registry
    labels = {"verb": "mutate", "outcome": outcome, "reason": ""}

    def count() -> float:
        return registry.get_sample_value("gputopo_extender_decisions_total", labels) or 0.0

    before = count()
    with served.connect(cert=cert) as conn:
        conn.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % declared)
        _answer(conn)
    assert count() == before + 1
