"""The lean transport (`gputopo.kube.transport`) through `Kube`, against a real HTTPS server on
127.0.0.1 (a CA, a server and a client certificate made by the openssl CLI): kept-alive connections
are reused, one that the server closed while idle costs no call, nothing is retried once an answer
began, status answers become the one error type, tokens are taken fresh per request (a rotating
refresh hook, an exec plugin), client certificates authenticate, timeouts and refused connections
are status 0, idle connections stay bounded, and 8 threads never see each other's answers. Against
a raw loopback socket that answers scripted bytes: the error mapping (table-driven), bounded bodies,
watches that give their connection back, and (hypothesis) no malformed answer raises anything but
`KubeError`. The answer framing and the query encoding are checked on their own, table-driven and
by hypothesis."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.kube import Gone, Kube, KubeError
from gputopo.kube import transport as lean
from gputopo.kube.transport import Answer, query_string, read_answer, unsupported_reason

JSON = dict[str, Any]
WAIT_S = 10.0


# ----------------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_crt: Path
    server_key: Path
    client_crt: Path
    client_key: Path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a serving certificate for 127.0.0.1 and a client certificate for CN=alice."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found: the HTTPS test server needs certificates")
    d = tmp_path_factory.mktemp("pki")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    steps = [
        f"req -x509 {ec} -days 1 -subj /CN=test-ca -keyout ca.key -out ca.crt",
        f"req {ec} -subj /CN=127.0.0.1 -keyout server.key -out server.csr",
        "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out server.crt -extfile server.ext",
        f"req {ec} -subj /CN=alice -keyout client.key -out client.csr",
        "x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out client.crt -extfile client.ext",
    ]
    for step in steps:
        subprocess.run([openssl, *step.split()], check=True, capture_output=True, cwd=d)
    return Certs(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


# ----------------------------------------------------------------------------------- the server


@dataclass
class Act:
    """What the server does with one request: `reply` (a JSON body, or an echo of the request when
    None), `close-after` (reply, then close without saying so), `drop` (read it, close, no answer),
    `partial` (the head and part of the body, then close) or `stall` (wait for `release`, then reply)."""

    kind: str = "reply"
    status: int = 200
    body: Any = None


@dataclass
class Seen:
    conn: int
    method: str
    target: str
    auth: str
    body: Any
    client: str  # the client certificate's CN, when one was presented


@dataclass
class HttpsApiServer:
    certs: Certs
    require_client_cert: bool = False
    script: deque[Act] = field(default_factory=deque)
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    connections: int = 0
    closed: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.certs.server_crt, self.certs.server_key)
        if self.require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.certs.ca)
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            conn_id = 0
            client = ""

            def log_message(self, *_args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                auth = self.headers.get("Authorization") or ""
                with api.cond:
                    api.seen.append(Seen(self.conn_id, self.command, self.path, auth, body, self.client))
                    act = api.script.popleft() if api.script else Act()
                    api.cond.notify_all()
                if act.kind == "drop":
                    self.close_connection = True
                    return
                if act.kind == "partial":
                    self.wfile.write(
                        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a"'
                    )
                    self.close_connection = True
                    return
                if act.kind == "stall":
                    api.release.wait(WAIT_S)
                doc = act.body if act.body is not None else {"method": self.command, "target": self.path, "body": body}
                data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
                self.send_response(act.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if act.kind == "close-after":
                    self.close_connection = True  # and no Connection: close header: the client keeps it

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def finish_request(self, request: Any, client_address: Any) -> None:
                # The TLS handshake in the connection's own thread, and the TLS socket closed here:
                # the server's own shutdown_request only sees the plain socket it accepted.
                with api.cond:
                    api.connections += 1
                    conn_id = api.connections
                try:
                    tls = ctx.wrap_socket(request, server_side=True)
                except OSError:
                    return
                try:
                    peer: Any = tls.getpeercert() or {}
                    subject = {k: v for rdn in peer.get("subject", ()) for k, v in rdn}
                    handler = type(
                        "ConnHandler", (Handler,), {"conn_id": conn_id, "client": subject.get("commonName", "")}
                    )
                    with contextlib.suppress(OSError):
                        handler(tls, client_address, self)
                finally:
                    with contextlib.suppress(OSError):
                        tls.shutdown(socket.SHUT_RDWR)
                    tls.close()
                    with api.cond:
                        api.closed += 1
                        api.cond.notify_all()

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"https://{host!s}:{port}"

    def wait(self, what: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(what, WAIT_S)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def write_kubeconfig(path: Path, server: str, ca: Path, user: JSON) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def server(certs: Certs) -> Iterator[HttpsApiServer]:
    api = HttpsApiServer(certs)
    yield api
    api.close()


@contextlib.contextmanager
def client(server: HttpsApiServer, tmp_path: Path, user: JSON | None = None, **kwargs: Any) -> Iterator[Kube]:
    user = {"token": "t0"} if user is None else user
    kube = Kube(write_kubeconfig(tmp_path / "kubeconfig", server.url, server.certs.ca, user), **kwargs)
    try:
        yield kube
    finally:
        kube.close()


@pytest.fixture
def kube(server: HttpsApiServer, tmp_path: Path) -> Iterator[Kube]:
    with client(server, tmp_path, request_timeout=5.0) as k:
        assert k.transport is not None
        yield k


def status(code: int, reason: str, message: str) -> JSON:
    return {"kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message}


# ----------------------------------------------------------------------------------- keep-alive and retries


def test_one_kept_alive_connection_carries_many_calls(server: HttpsApiServer, kube: Kube) -> None:
    for i in range(20):
        assert kube.create(f"/api/v1/namespaces/ns/events?i={i}", {"i": i})["body"] == {"i": i}
    assert {s.conn for s in server.seen} == {1} and server.connections == 1


def never_closed(_conn: object) -> bool:
    return False


@pytest.mark.parametrize(
    ("script", "idle_check", "requests", "connections"),
    [
        pytest.param([Act("close-after")], True, 2, 2, id="closed-while-idle-seen-before-use"),
        pytest.param([Act("close-after")], False, 2, 2, id="closed-while-idle-met-on-send-retried"),
        pytest.param([Act(), Act("drop")], True, 3, 2, id="closed-before-answering-retried-once"),
    ],
)
def test_a_connection_the_server_closed_does_not_fail_a_call(
    server: HttpsApiServer,
    kube: Kube,
    monkeypatch: pytest.MonkeyPatch,
    script: list[Act],
    idle_check: bool,
    requests: int,
    connections: int,
) -> None:
    if not idle_check:  # the close arrives just after the check: the request goes out on a dead connection
        monkeypatch.setattr(lean.Conn, "idle_closed", never_closed)
    server.script.extend(script)
    kube.get("/api/v1/nodes/n1")
    if script[0].kind == "close-after":
        server.wait(lambda: server.closed == 1)
    assert kube.get("/api/v1/nodes/n2")["target"] == "/api/v1/nodes/n2"
    assert (len(server.seen), server.connections) == (requests, connections)


@pytest.mark.parametrize(
    ("script", "calls_before", "error", "requests"),
    [
        pytest.param([Act(), Act("partial")], 1, "IncompleteRead", 2, id="answer-began-on-a-reused-connection"),
        pytest.param([Act("drop")], 0, "RemoteDisconnected", 1, id="no-answer-on-a-new-connection"),
        pytest.param([Act(), Act("drop"), Act("drop")], 1, "RemoteDisconnected", 3, id="only-one-retry"),
    ],
)
def test_no_retry_after_an_answer_began_or_on_a_new_connection(
    server: HttpsApiServer, kube: Kube, script: list[Act], calls_before: int, error: str, requests: int
) -> None:
    server.script.extend(script)
    for _ in range(calls_before):
        kube.get("/api/v1/nodes/n1")
    with pytest.raises(KubeError) as err:
        kube.create("/api/v1/namespaces/ns/pods/p/binding", {"kind": "Binding"})
    assert (type(err.value), err.value.status, err.value.method) == (KubeError, 0, "POST")
    assert err.value.message.startswith(f"{error}:")
    assert len(server.seen) == requests


# ----------------------------------------------------------------------------------- answers and errors


@pytest.mark.parametrize(
    ("act", "result", "error", "reason", "message"),
    [
        pytest.param(Act(status=201, body={"kind": "Event"}), {"kind": "Event"}, None, "", "", id="created"),
        pytest.param(Act(status=200, body=""), {}, None, "", "", id="empty-body-is-an-empty-dict"),
        pytest.param(
            Act(status=404, body=status(404, "NotFound", 'pods "p" not found')),
            None,
            KubeError,
            "NotFound",
            'pods "p" not found',
            id="not-found-status",
        ),
        pytest.param(
            Act(status=409, body=status(409, "AlreadyExists", "exists")),
            None,
            KubeError,
            "AlreadyExists",
            "exists",
            id="conflict-status",
        ),
        pytest.param(
            Act(status=410, body=status(410, "Expired", "too old")), None, Gone, "Expired", "too old", id="gone"
        ),
        pytest.param(Act(status=500, body="etcd is down"), None, KubeError, "", "etcd is down", id="plain-text-500"),
    ],
)
def test_answers_decode_and_status_answers_become_the_one_error_type(
    server: HttpsApiServer,
    kube: Kube,
    act: Act,
    result: JSON | None,
    error: type[KubeError] | None,
    reason: str,
    message: str,
) -> None:
    server.script.append(act)
    if error is None:
        assert kube.create("/api/v1/namespaces/ns/events", {"kind": "Event"}) == result
        return
    with pytest.raises(KubeError) as err:
        kube.create("/api/v1/namespaces/ns/events", {"kind": "Event"})
    assert type(err.value) is error
    assert (err.value.status, err.value.reason, err.value.message) == (act.status, reason, message)
    assert str(err.value).startswith(f"POST /api/v1/namespaces/ns/events: {act.status}")
    assert kube.get("/api/v1/nodes")["target"] == "/api/v1/nodes"  # the connection still serves
    assert server.connections == 1


def test_a_refused_connection_is_status_zero(server: HttpsApiServer, tmp_path: Path) -> None:
    server.close()  # nothing listens on the port any more
    with client(server, tmp_path, request_timeout=2.0) as kube, pytest.raises(KubeError) as err:
        kube.get("/api/v1/nodes")
    assert (type(err.value), err.value.status) == (KubeError, 0)
    assert err.value.message.startswith("ConnectionRefusedError:")


@pytest.mark.parametrize(
    ("request_timeout", "call_timeout"),
    [
        pytest.param(0.3, None, id="the-clients-request-timeout"),
        pytest.param(30.0, 0.3, id="the-calls-own-timeout"),
        pytest.param(30.0, (5.0, 0.3), id="a-connect-read-pair"),
    ],
)
def test_a_server_that_does_not_answer_in_time_is_status_zero(
    server: HttpsApiServer, tmp_path: Path, request_timeout: float, call_timeout: float | tuple[float, float] | None
) -> None:
    server.script.append(Act("stall"))
    with client(server, tmp_path, request_timeout=request_timeout) as kube:
        with pytest.raises(KubeError) as err:
            kube.request("GET", "/api/v1/nodes", timeout=call_timeout)
        server.release.set()
        assert (err.value.status, err.value.message.split(":")[0]) == (0, "TimeoutError")
        assert kube.get("/api/v1/nodes")["target"] == "/api/v1/nodes"  # a new connection serves the next call


def test_query_and_path_travel_as_given(kube: Kube) -> None:
    query = [("labelSelector", "app in (a,b),tier!=x"), ("fieldSelector", "spec.nodeName=n 1"), ("limit", "500")]
    doc = kube.get("/api/v1/namespaces/ns/pods", query=query)
    assert doc["target"] == "/api/v1/namespaces/ns/pods?" + query_string(query)


# ----------------------------------------------------------------------------------- credentials


def rotating_hook(tokens: list[str]) -> Callable[[Any], None]:
    """A refresh hook as the in-cluster loader's after its refresh period: the next token each time."""
    left = iter(tokens)

    def hook(configuration: Any) -> None:
        configuration.api_key["BearerToken"] = f"Bearer {next(left)}"

    return hook


EXEC_PLUGIN = """
import json, pathlib, sys
token = pathlib.Path(sys.argv[1]).read_text().strip()
# Already expired: the kubeconfig loader runs the plugin again before the next request.
status = {"token": token, "expirationTimestamp": "2000-01-01T00:00:00Z"}
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential", "status": status}))
"""


@pytest.mark.parametrize("source", ["refresh-hook", "exec-plugin"])
def test_each_request_carries_the_current_token(server: HttpsApiServer, tmp_path: Path, source: str) -> None:
    token_file, plugin = tmp_path / "token", tmp_path / "plugin.py"
    token_file.write_text("t1")
    plugin.write_text(EXEC_PLUGIN)
    exec_user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(plugin), str(token_file)],
        }
    }
    with client(server, tmp_path, exec_user if source == "exec-plugin" else {"token": "t0"}) as kube:
        if source == "refresh-hook":
            kube.configuration.refresh_api_key_hook = rotating_hook(["t1", "t2", "t3"])
        kube.get("/api/v1/nodes")
        token_file.write_text("t2")
        kube.get("/api/v1/nodes")
    assert [s.auth for s in server.seen] == ["Bearer t1", "Bearer t2"]
    assert server.connections == 1


@pytest.mark.parametrize(("with_cert", "client_cn"), [(True, "alice"), (False, None)], ids=["with-cert", "without"])
def test_a_client_certificate_authenticates(
    certs: Certs, tmp_path: Path, with_cert: bool, client_cn: str | None
) -> None:
    api = HttpsApiServer(certs, require_client_cert=True)
    user = {"client-certificate": str(certs.client_crt), "client-key": str(certs.client_key)} if with_cert else {}
    try:
        with client(api, tmp_path, user, request_timeout=5.0) as kube:
            if client_cn is None:
                with pytest.raises(KubeError) as err:
                    kube.get("/api/v1/nodes")
                assert err.value.status == 0
            else:
                kube.get("/api/v1/nodes")
                assert [(s.client, s.auth) for s in api.seen] == [(client_cn, "")]
    finally:
        api.close()


# ----------------------------------------------------------------------------------- the pool


def test_eight_threads_never_see_each_others_answers(server: HttpsApiServer, kube: Kube) -> None:
    failures: list[str] = []

    def worker(t: int) -> None:
        for i in range(25):
            body = {"thread": t, "call": i, "pad": "x" * (t * 300)}
            doc = kube.create(f"/api/v1/namespaces/ns{t}/events", body)
            if (doc["target"], doc["body"]) != (f"/api/v1/namespaces/ns{t}/events", body):
                failures.append(f"thread {t} call {i} got {doc['target']}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S)
    assert not any(th.is_alive() for th in threads) and failures == []
    assert len(server.seen) == 200 and server.connections <= 8


def test_at_most_pool_size_connections_stay_idle(server: HttpsApiServer, tmp_path: Path) -> None:
    server.script.extend(Act("stall") for _ in range(6))
    with client(server, tmp_path, request_timeout=5.0, pool_size=2) as kube:
        threads = [threading.Thread(target=kube.get, args=("/api/v1/nodes",)) for _ in range(6)]
        for th in threads:
            th.start()
        server.wait(lambda: len(server.seen) == 6)  # six requests in flight at once, on six connections
        server.release.set()
        for th in threads:
            th.join(WAIT_S)
        server.wait(lambda: server.closed == 4)  # the four the pool did not keep
        assert server.connections == 6
        assert kube.transport is not None and len(kube.transport._idle) == 2


# ----------------------------------------------------------------------------------- what stays on the ApiClient


@pytest.mark.parametrize(
    ("settings_", "reason"),
    [
        pytest.param({}, "", id="plain-https"),
        pytest.param({"host": "http://127.0.0.1:8080"}, "", id="plain-http"),
        pytest.param({"proxy": "http://proxy:3128"}, "a proxy", id="a-proxy"),
        pytest.param({"proxy": "http://proxy:3128", "no_proxy": "127.0.0.1"}, "", id="a-proxy-bypassed"),
        pytest.param({"host": "unix:///run/api.sock"}, "scheme 'unix'", id="another-scheme"),
        pytest.param({"assert_hostname": "api.example"}, "assert_hostname names a host", id="assert-hostname-name"),
    ],
)
def test_which_configurations_stay_on_the_api_client(settings_: JSON, reason: str) -> None:
    from kubernetes import client as k8s_client

    cfg: Any = k8s_client.Configuration()
    cfg.host = "https://127.0.0.1:6443"
    for key, value in settings_.items():
        setattr(cfg, key, value)
    assert unsupported_reason(cfg) == reason


# ----------------------------------------------------------------------------------- raw answers


class RawServer:
    """A loopback socket that answers each connection's first request with scripted bytes, then closes
    (or, for `b""`, closes without answering; `None`: reads and never answers)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.answers: deque[bytes | None] = deque()
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            # The answer is taken in accept order; each connection then runs on its own thread, so
            # one that never answers holds up no other.
            answer = self.answers.popleft() if self.answers else b""
            threading.Thread(target=self._answer, args=(conn, answer), daemon=True).start()

    def _answer(self, conn: socket.socket, answer: bytes | None) -> None:
        with conn:
            conn.settimeout(WAIT_S)
            data = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
            if answer is None:
                self.stop.wait(WAIT_S)
                return
            with contextlib.suppress(OSError):
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RawServer, Kube]]:
    """One server and client for the module: each request takes the next scripted answer, which
    leaves nothing behind for the next (the server closes every connection)."""
    tmp_path = tmp_path_factory.mktemp("raw")
    srv = RawServer()
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": srv.url}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "raw-kubeconfig").write_text(json.dumps(doc))
    kube = Kube(tmp_path / "raw-kubeconfig", request_timeout=1.0, max_body_bytes=1000)
    yield srv, kube
    kube.close()
    srv.close()


def answer(status: str, body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode() + body


def framed(status: str, body: bytes) -> bytes:
    return answer(status, body, f"Content-Length: {len(body)}", "Connection: close")


STATUS_404 = json.dumps(status(404, "NotFound", 'nodes "n" not found')).encode()
STATUS_410 = json.dumps(status(410, "Expired", "too old")).encode()
CHUNKED_BIG = answer("200 OK", b"%x\r\n%s\r\n0\r\n\r\n" % (1500, b"x" * 1500), "Transfer-Encoding: chunked")


@pytest.mark.parametrize(
    ("script", "error", "status_code", "reason", "message"),
    [
        pytest.param(
            [framed("404 Not Found", STATUS_404)], KubeError, 404, "NotFound", 'nodes "n" not found', id="404"
        ),
        pytest.param([framed("410 Gone", STATUS_410)], Gone, 410, "Expired", "too old", id="410-is-gone"),
        pytest.param([framed("503 Unavailable", b"etcd is down")], KubeError, 503, "", "etcd is down", id="plain-503"),
        pytest.param([framed("200 OK", b"{nope")], KubeError, 200, "", "the answer is not JSON", id="not-json"),
        pytest.param([framed("200 OK", b"[1, 2]")], KubeError, 200, "", "the answer is JSON list", id="not-an-object"),
        pytest.param([b""], KubeError, 0, "", "RemoteDisconnected", id="closed-unanswered"),
        pytest.param([b"SPDY/3 200 OK\r\n\r\n"], KubeError, 0, "", "BadStatusLine", id="not-http"),
        pytest.param(
            [answer("200 OK", b"{}", "Content-Length: 10")], KubeError, 0, "", "IncompleteRead", id="body-cut-short"
        ),
        pytest.param(
            [answer("200 OK", b"", "Content-Length: 5000")],
            KubeError,
            0,
            "",
            "TooLong: an answer of 5000 bytes",
            id="too-long",
        ),
        pytest.param([CHUNKED_BIG], KubeError, 0, "", "TooLong: an answer over the limit", id="chunked-too-long"),
        pytest.param([None], KubeError, 0, "", "TimeoutError", id="no-answer-in-time"),
    ],
)
def test_each_failure_maps_to_the_one_error_type(
    raw: tuple[RawServer, Kube],
    script: list[bytes | None],
    error: type[KubeError],
    status_code: int,
    reason: str,
    message: str,
) -> None:
    srv, kube = raw
    srv.answers.extend(script)
    with pytest.raises(KubeError) as err:
        kube.get("/api/v1/nodes/n")
    assert (type(err.value), err.value.status, err.value.reason) == (error, status_code, reason)
    assert err.value.message.startswith(message)
    assert (err.value.method, err.value.path) == ("GET", "/api/v1/nodes/n")


def test_a_watch_refused_or_cut_raises_the_one_error_type(raw: tuple[RawServer, Kube]) -> None:
    srv, kube = raw
    srv.answers.extend([framed("410 Gone", STATUS_410), answer("200 OK", b"ff\r\n{", "Transfer-Encoding: chunked")])
    with pytest.raises(Gone):
        list(kube.watch("/api/v1/pods", "1", timeout_seconds=5))
    with pytest.raises(KubeError) as err:
        list(kube.watch("/api/v1/pods", "1", timeout_seconds=5))
    assert err.value.status == 0


HEADS = st.sampled_from(
    [
        "HTTP/1.1 200 OK",
        "HTTP/1.1 404 Not Found",
        "HTTP/1.0 500 x",
        "HTTP/1.1 100 Continue",
        "HTTP/1.1 2xx",
        "HTTP/9 200 OK",
        "",
    ]
)
HEADERS = st.lists(
    st.sampled_from(
        [
            "Content-Length: 2",
            "Content-Length: -1",
            "Content-Length: 999999",
            "Content-Length: x",
            "Transfer-Encoding: chunked",
            "Transfer-Encoding: gzip",
            "Content-Encoding: gzip",
            "Connection: close",
            "no colon",
            " folded",
        ]
    ),
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(head=HEADS, headers=HEADERS, body=st.binary(max_size=300), noise=st.binary(max_size=40))
def test_no_malformed_answer_raises_anything_but_kube_error(
    raw: tuple[RawServer, Kube], head: str, headers: list[str], body: bytes, noise: bytes
) -> None:
    srv, kube = raw
    srv.answers.append(("\r\n".join([head, *headers]) + "\r\n\r\n").encode() + body + noise)
    try:
        doc = kube.get("/api/v1/nodes/n")
    except KubeError:
        return
    assert isinstance(doc, dict)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=400))
def test_no_stream_of_bytes_raises_anything_but_kube_error(raw: tuple[RawServer, Kube], data: bytes) -> None:
    srv, kube = raw
    srv.answers.append(data)
    with contextlib.suppress(KubeError):
        kube.get("/api/v1/nodes/n")


# ----------------------------------------------------------------------------------- watches


def test_a_watch_read_to_its_end_gives_its_connection_back(raw: tuple[RawServer, Kube]) -> None:
    srv, kube = raw
    line = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "a"}}}).encode() + b"\n"
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line)
    srv.answers.extend(
        [
            answer("200 OK", body, "Transfer-Encoding: chunked"),
            answer("200 OK", body[:-5], "Transfer-Encoding: chunked"),
        ]
    )
    events = list(kube.watch("/api/v1/pods", "1", timeout_seconds=5))
    assert [e.object["metadata"]["name"] for e in events] == ["a"]
    assert kube.transport is not None and len(kube.transport._idle) == 1  # the one pool carries the next call
    with pytest.raises(KubeError) as err:  # cut before the last chunk: status 0, and the connection is dropped
        list(kube.watch("/api/v1/pods", "1", timeout_seconds=5))
    assert err.value.status == 0 and err.value.message.startswith("IncompleteRead")


# ----------------------------------------------------------------------------------- framing and encoding


def recv_from(data: bytes, sizes: list[int]) -> Callable[[int], bytes]:
    """A socket's recv over `data`, handing it out in pieces of `sizes` (then the rest at once)."""
    pos = 0
    cuts = iter(sizes)

    def recv(n: int) -> bytes:
        nonlocal pos
        take = min(n, next(cuts, n))
        out = data[pos : pos + max(1, take)]
        pos += len(out)
        return out

    return recv


def parse(raw: bytes, method: str = "GET", sizes: list[int] | None = None) -> Answer:
    return read_answer(recv_from(raw[1:], sizes or []), method, bytearray(raw[:1]))


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nabcd\r\n2\r\nef\r\n0\r\nX-Trailer: 1\r\n\r\n"
)


@pytest.mark.parametrize(
    ("raw", "method", "expected"),
    [
        pytest.param(
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}", "POST", Answer(201, b"{}", True), id="length"
        ),
        pytest.param(CHUNKED, "GET", Answer(200, b"abcdef", True), id="chunked-with-extension-and-trailer"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the end",
            "GET",
            Answer(200, b"to the end", False),
            id="to-close",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: keep-alive, Close\r\n\r\nx",
            "GET",
            Answer(200, b"x", False),
            id="connection-close-token",
        ),
        pytest.param(
            b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", "GET", Answer(200, b"x", False), id="http-1.0-closes"
        ),
        pytest.param(
            b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\nConnection: keep-alive\r\n\r\nx",
            "GET",
            Answer(200, b"x", True),
            id="http-1.0-keep-alive",
        ),
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", Answer(204, b"", True), id="204-has-no-body"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", "HEAD", Answer(200, b"", True), id="head-has-no-body"
        ),
        pytest.param(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            "POST",
            Answer(200, b"ok", True),
            id="interim-1xx-skipped",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nX-Long: a\r\n  b\r\nContent-Length: 2\r\n\r\nok",
            "GET",
            Answer(200, b"ok", True),
            id="folded-header",
        ),
    ],
)
def test_answers_are_framed_as_http_1_1_says(raw: bytes, method: str, expected: Answer) -> None:
    assert parse(raw, method) == expected
    assert parse(raw, method, [1] * len(raw)) == expected  # one byte per recv


def test_bytes_beyond_the_answer_retire_the_connection() -> None:
    # No request was pipelined, so the framing went wrong somewhere: the next answer cannot be trusted.
    assert parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA") == Answer(200, b"ok", False)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        pytest.param(b"SPDY/3 200 OK\r\n\r\n", http.client.BadStatusLine, id="not-http"),
        pytest.param(b"HTTP/1.1 2xx OK\r\n\r\n", http.client.BadStatusLine, id="status-not-a-number"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", http.client.IncompleteRead, id="cut-short"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Len", http.client.IncompleteRead, id="cut-in-the-head"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", http.client.HTTPException, id="chunk-size"
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n0\r\n\r\n",
            http.client.HTTPException,
            id="chunk-longer-than-its-size",
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", http.client.HTTPException, id="negative-length"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            http.client.HTTPException,
            id="conflicting-lengths",
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", http.client.HTTPException, id="header-without-colon"),
        pytest.param(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000, http.client.LineTooLong, id="endless-head"),
    ],
)
def test_malformed_answers_raise(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse(raw)


@st.composite
def framed_answers(draw: st.DrawFn) -> tuple[bytes, Answer, list[int]]:
    status = draw(st.sampled_from([200, 201, 202, 400, 403, 404, 409, 410, 422, 429, 500, 503]))
    body = draw(st.binary(max_size=3000))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    close = framing == "close" or draw(st.booleans())
    head = [f"HTTP/1.1 {status} Whatever", "Content-Type: application/json", "Audit-Id: 1234"]
    if close:
        head.append("Connection: close")
    if framing == "length":
        head.append(f"Content-Length: {len(body)}")
        payload = body
    elif framing == "chunked":
        head.append("Transfer-Encoding: chunked")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        payload = body
    raw = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
    sizes = draw(st.lists(st.integers(1, 700), max_size=20))
    return raw, Answer(status, body, not close), sizes


@settings(max_examples=300, deadline=None)
@given(framed_answers())
def test_any_framing_in_any_pieces_reads_the_same_answer(case: tuple[bytes, Answer, list[int]]) -> None:
    raw, expected, sizes = case
    assert parse(raw, "GET", sizes) == expected


@pytest.fixture(scope="module")
def api_client() -> Any:
    from kubernetes import client as k8s_client

    return k8s_client.ApiClient()


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=30)), max_size=6))
def test_queries_are_encoded_as_the_api_client_encodes_them(api_client: Any, pairs: list[tuple[str, str]]) -> None:
    assert query_string(pairs) == api_client.parameters_to_url_query(pairs, None)
