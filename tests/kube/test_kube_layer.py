"""gputopo.kube against a small real HTTP server on 127.0.0.1 that speaks the API server's JSON:
Status bodies become one error type, lists page, watches stream chunked lines (bookmarks, 410 Gone,
overlong and non-JSON lines), retries back off, the list+watch loop relists on 410, and the typed
writes send what the API server expects."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from gputopo.kube import (
    Backoff,
    Gone,
    Kube,
    KubeError,
    Pacing,
    WatchEvent,
    find_kubeconfig,
    iter_lines,
    retry,
    run_list_watch,
)

JSON = dict[str, Any]


@dataclass
class Reply:
    """One scripted answer: a JSON body, or `chunks` streamed with chunked encoding; `hold` keeps the
    stream open afterwards until the server closes (a watch blocked in a read)."""

    status: int = 200
    body: Any = None
    chunks: list[bytes] = field(default_factory=list)
    hold: bool = False


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any


class FakeApiServer:
    """Answers each request with the next scripted Reply (an empty 200 list when none is left)."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.seen: list[Seen] = []
        self.release = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _answer(self) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                ctype = self.headers.get("Content-Type") or ""
                api.seen.append(Seen(self.command, url.path, parse_qs(url.query), ctype, json.loads(raw or b"null")))
                reply = api.replies.pop(0) if api.replies else Reply(body={"items": [], "metadata": {}})
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                if reply.chunks or reply.hold:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in reply.chunks:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    if reply.hold:
                        api.release.wait(10)
                        self.close_connection = True
                        return
                    self.wfile.write(b"0\r\n\r\n")
                    return
                body = b"" if reply.body is None else json.dumps(reply.body).encode()
                if isinstance(reply.body, str):
                    body = reply.body.encode()
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def write_kubeconfig(path: Path, server: str) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    yield fake
    fake.close()


@pytest.fixture
def kube(server: FakeApiServer, tmp_path: Path) -> Iterator[Kube]:
    client = Kube(write_kubeconfig(tmp_path / "kubeconfig", server.url), request_timeout=5.0)
    yield client
    client.close()


def status(code: int, reason: str, message: str) -> JSON:
    return {"kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message}


def line(etype: str, obj: JSON) -> bytes:
    return json.dumps({"type": etype, "object": obj}).encode() + b"\n"


def pod(name: str, rv: str) -> JSON:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "default", "resourceVersion": rv}}


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("reply", "error", "reason", "message"),
    [
        pytest.param(
            Reply(404, status(404, "NotFound", 'pods "a" not found')),
            KubeError,
            "NotFound",
            'pods "a" not found',
            id="not-found-status",
        ),
        pytest.param(
            Reply(403, status(403, "Forbidden", "pods is forbidden")),
            KubeError,
            "Forbidden",
            "pods is forbidden",
            id="forbidden-status",
        ),
        pytest.param(Reply(410, status(410, "Expired", "too old")), Gone, "Expired", "too old", id="410-is-gone"),
        pytest.param(Reply(500, "etcd is down"), KubeError, "", "etcd is down", id="plain-text-body"),
    ],
)
def test_a_status_body_becomes_the_one_error_type(
    server: FakeApiServer, kube: Kube, reply: Reply, error: type[KubeError], reason: str, message: str
) -> None:
    server.replies = [reply]
    with pytest.raises(KubeError) as err:
        kube.get("/api/v1/namespaces/default/pods/a")
    assert type(err.value) is error
    assert (err.value.status, err.value.reason, err.value.message) == (reply.status, reason, message)
    assert str(err.value).startswith(f"GET /api/v1/namespaces/default/pods/a: {reply.status}")


def test_an_unreachable_server_is_status_zero(server: FakeApiServer, tmp_path: Path) -> None:
    url = server.url
    server.close()  # nothing listens on the port any more
    client = Kube(write_kubeconfig(tmp_path / "kubeconfig", url), request_timeout=2.0)
    with pytest.raises(KubeError) as err:
        client.get("/api/v1/nodes")
    assert err.value.status == 0 and type(err.value) is KubeError
    client.close()


# ----------------------------------------------------------------------------------- list


def test_a_list_follows_continue_tokens_and_returns_the_resource_version(server: FakeApiServer, kube: Kube) -> None:
    server.replies = [
        Reply(body={"items": [pod("a", "3")], "metadata": {"resourceVersion": "9", "continue": "tok"}}),
        Reply(body={"items": [pod("b", "4")], "metadata": {"resourceVersion": "9"}}),
    ]
    items, rv = kube.list_items("/api/v1/pods", field_selector="spec.nodeName=n1", label_selector="app=x")
    assert ([i["metadata"]["name"] for i in items], rv) == (["a", "b"], "9")
    first, second = (s.query for s in server.seen)
    assert (first["fieldSelector"], first["labelSelector"]) == (["spec.nodeName=n1"], ["app=x"])
    assert first["limit"] == ["500"]
    assert "continue" not in first and second["continue"] == ["tok"]


# ----------------------------------------------------------------------------------- watch


WATCH_CASES = [
    pytest.param(
        [line("ADDED", pod("a", "11"))[:20], line("ADDED", pod("a", "11"))[20:] + line("DELETED", pod("a", "12"))],
        [("ADDED", "a"), ("DELETED", "a")],
        id="a-line-split-across-chunks",
    ),
    pytest.param(
        [line("BOOKMARK", {"metadata": {"resourceVersion": "20"}}), b"\n\n", line("ADDED", pod("b", "21"))],
        [("BOOKMARK", None), ("ADDED", "b")],
        id="bookmarks-pass-blank-lines-do-not",
    ),
    pytest.param(
        [b"not json\n", b"[1, 2]\n", line("MODIFIED", pod("c", "30"))],
        [("MODIFIED", "c")],
        id="non-object-lines-are-skipped",
    ),
    pytest.param(
        [line("ADDED", pod("x" * 300, "40")), line("ADDED", pod("d", "41"))],
        [("ADDED", "d")],
        id="an-overlong-line-is-skipped",
    ),
    pytest.param([line("ADDED", pod("e", "50"))[:-1]], [("ADDED", "e")], id="a-last-line-without-newline"),
]


@pytest.mark.parametrize(("chunks", "expected"), WATCH_CASES)
def test_a_watch_streams_raw_events_line_by_line(
    server: FakeApiServer, tmp_path: Path, chunks: list[bytes], expected: list[tuple[str, str | None]]
) -> None:
    client = Kube(write_kubeconfig(tmp_path / "kubeconfig", server.url), max_line_bytes=256)
    server.replies = [Reply(chunks=chunks)]
    events = list(client.watch("/api/v1/pods", "10", timeout_seconds=5, field_selector="spec.nodeName=n1"))
    client.close()
    assert [(e.type, e.object.get("metadata", {}).get("name")) for e in events] == expected
    query = server.seen[0].query
    assert (query["watch"], query["resourceVersion"], query["allowWatchBookmarks"], query["timeoutSeconds"]) == (
        ["true"],
        ["10"],
        ["true"],
        ["5"],
    )
    assert query["fieldSelector"] == ["spec.nodeName=n1"]


@pytest.mark.parametrize(
    ("reply", "error", "status_code"),
    [
        pytest.param(Reply(chunks=[line("ERROR", status(410, "Expired", "too old"))]), Gone, 410, id="410-error-event"),
        pytest.param(Reply(410, status(410, "Expired", "too old")), Gone, 410, id="410-http-status"),
        pytest.param(
            Reply(chunks=[line("ERROR", status(500, "InternalError", "boom"))]), KubeError, 500, id="other-error-event"
        ),
        pytest.param(Reply(403, status(403, "Forbidden", "no watch")), KubeError, 403, id="forbidden-http-status"),
    ],
)
def test_a_watch_failure_raises_the_one_error_type(
    server: FakeApiServer, kube: Kube, reply: Reply, error: type[KubeError], status_code: int
) -> None:
    server.replies = [reply]
    with pytest.raises(KubeError) as err:
        list(kube.watch("/api/v1/pods", "1", timeout_seconds=5))
    assert (type(err.value), err.value.status) == (error, status_code)


def test_close_ends_a_watch_blocked_in_a_read(server: FakeApiServer, kube: Kube) -> None:
    server.replies = [Reply(chunks=[line("ADDED", pod("a", "2"))], hold=True)]
    seen: list[str] = []
    failure: list[KubeError] = []

    def consume() -> None:
        try:
            seen.extend(e.type for e in kube.watch("/api/v1/pods", "1", timeout_seconds=60))
        except KubeError as e:
            failure.append(e)

    worker = threading.Thread(target=consume)
    worker.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    kube.close()
    worker.join(5)
    assert not worker.is_alive() and seen == ["ADDED"]
    assert [(type(e), e.status) for e in failure] == [(KubeError, 0)]  # aborted mid-read


@pytest.mark.parametrize(
    ("chunks", "limit", "expected"),
    [
        pytest.param([b"ab", b"c\nde", b"f\n"], 10, [b"abc", b"def"], id="joined-across-chunks"),
        pytest.param([b"0123456789abc\nok\n"], 5, [b"ok"], id="overlong-in-one-chunk"),
        pytest.param([b"0123", b"456789", b"abc\nok\n"], 5, [b"ok"], id="overlong-across-chunks"),
        pytest.param([b" \n\nx"], 5, [b"x"], id="blank-lines-and-an-unterminated-tail"),
    ],
)
def test_lines_are_bounded(chunks: list[bytes], limit: int, expected: list[bytes]) -> None:
    assert list(iter_lines(chunks, limit)) == expected


# ----------------------------------------------------------------------------------- backoff and retries


@pytest.mark.parametrize(
    ("backoff", "delays"),
    [
        pytest.param(Backoff(), [0.5, 1.0, 2.0], id="default"),
        pytest.param(Backoff(base_s=1, factor=3, cap_s=5, attempts=5), [1, 3, 5, 5], id="capped"),
        pytest.param(Backoff(attempts=1), [], id="one-try-no-wait"),
    ],
)
def test_backoff_grows_exponentially_up_to_its_cap(backoff: Backoff, delays: list[float]) -> None:
    assert backoff.delays() == delays
    assert backoff.delay(50) == backoff.cap_s


@pytest.mark.parametrize(
    ("replies", "result", "waits", "requests"),
    [
        pytest.param(
            [Reply(500, status(500, "InternalError", "x")), Reply(body={"ok": 1})],
            {"ok": 1},
            [0.5],
            2,
            id="500-then-success",
        ),
        pytest.param(
            [Reply(429, status(429, "TooManyRequests", "slow")), Reply(body={"ok": 2})],
            {"ok": 2},
            [0.5],
            2,
            id="throttled-then-success",
        ),
        pytest.param([Reply(403, status(403, "Forbidden", "no"))], None, [], 1, id="forbidden-is-not-retried"),
        pytest.param(
            [Reply(503, status(503, "ServiceUnavailable", "x"))] * 4,
            None,
            [0.5, 1.0, 2.0],
            4,
            id="gives-up-after-attempts",
        ),
    ],
)
def test_retry_backs_off_on_retryable_answers(
    server: FakeApiServer, kube: Kube, replies: list[Reply], result: JSON | None, waits: list[float], requests: int
) -> None:
    server.replies = list(replies)
    slept: list[float] = []

    def sleep(s: float) -> bool:
        slept.append(s)
        return False

    def call() -> JSON:
        return kube.get("/api/v1/nodes/n1")

    if result is None:
        with pytest.raises(KubeError):
            retry(call, Backoff(), sleep, "get node")
    else:
        assert retry(call, Backoff(), sleep, "get node") == result
    assert (slept, len(server.seen)) == (waits, requests)


def test_list_watch_relists_on_gone_and_backs_off_on_failure(server: FakeApiServer, kube: Kube) -> None:
    server.replies = [
        Reply(body={"items": [pod("a", "5")], "metadata": {"resourceVersion": "5"}}),
        Reply(chunks=[line("ADDED", pod("b", "6")), line("ERROR", status(410, "Expired", "too old"))]),
        Reply(body={"items": [pod("a", "5"), pod("b", "6"), pod("c", "7")], "metadata": {"resourceVersion": "7"}}),
        Reply(500, status(500, "InternalError", "etcd")),
        Reply(chunks=[line("DELETED", pod("a", "8"))]),
    ]
    stop = threading.Event()
    state: dict[str, Any] = {"rv": "", "lists": 0, "names": set()}

    def relist() -> None:
        items, state["rv"] = kube.list_items("/api/v1/pods")
        state["names"] = {i["metadata"]["name"] for i in items}
        state["lists"] += 1

    def watch_once() -> None:
        try:
            for ev in kube.watch("/api/v1/pods", state["rv"], timeout_seconds=5):
                state["rv"] = ev.object["metadata"]["resourceVersion"]
                (state["names"].discard if ev.type == "DELETED" else state["names"].add)(ev.object["metadata"]["name"])
                if ev.type == "DELETED":
                    stop.set()
        except Gone:
            relist()

    run_list_watch(
        stop=stop,
        needs_list=lambda: not state["rv"],
        relist=relist,
        watch_once=watch_once,
        context={"kind": "pods"},
        pacing=Pacing(backoff=Backoff(base_s=0.01, cap_s=0.02)),
    )
    assert (state["lists"], state["names"], state["rv"]) == (2, {"b", "c"}, "8")
    watches = [s.query["resourceVersion"][0] for s in server.seen if "watch" in s.query]
    assert watches == ["5", "7", "7"]  # the 500 retried the same resourceVersion after the backoff


# ----------------------------------------------------------------------------------- typed writes


WHEN = datetime(2026, 1, 2, 3, 4, 5, 678900, tzinfo=UTC)
WRITES: list[Any] = [
    pytest.param(
        lambda k: k.create_binding("ns", "p", "uid-1", "n1", annotations={"gputopo.io/placement": "{}"}),
        ("POST", "/api/v1/namespaces/ns/pods/p/binding", "application/json"),
        {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": "p", "namespace": "ns", "uid": "uid-1", "annotations": {"gputopo.io/placement": "{}"}},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
        },
        id="binding-with-annotations",
    ),
    pytest.param(
        lambda k: k.create_event("ns", {"kind": "Event", "reason": "TopologyPlacement"}),
        ("POST", "/api/v1/namespaces/ns/events", "application/json"),
        {"kind": "Event", "reason": "TopologyPlacement"},
        id="core-event",
    ),
    pytest.param(
        lambda k: k.patch_node_metadata("n1", annotations={"a": "1"}, labels={"l": "2"}),
        ("PATCH", "/api/v1/nodes/n1", "application/merge-patch+json"),
        {"metadata": {"annotations": {"a": "1"}, "labels": {"l": "2"}}},
        id="node-metadata-merge-patch",
    ),
    pytest.param(
        lambda k: k.patch_node_metadata("n1", labels={"l": None}),
        ("PATCH", "/api/v1/nodes/n1", "application/merge-patch+json"),
        {"metadata": {"labels": {"l": None}}},
        id="node-label-removed-by-null",
    ),
    pytest.param(
        lambda k: k.create_lease("gs", "agent-n1", holder="n1", renew_time=WHEN, duration_s=40, labels={"x": "y"}),
        ("POST", "/apis/coordination.k8s.io/v1/namespaces/gs/leases", "application/json"),
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "agent-n1", "namespace": "gs", "labels": {"x": "y"}},
            "spec": {
                "holderIdentity": "n1",
                "leaseDurationSeconds": 40,
                "acquireTime": "2026-01-02T03:04:05.678900Z",
                "renewTime": "2026-01-02T03:04:05.678900Z",
            },
        },
        id="lease-create",
    ),
    pytest.param(
        lambda k: k.renew_lease("gs", "gputopo-agent-n1", holder="n1", renew_time=WHEN, duration_s=40),
        ("PATCH", "/apis/coordination.k8s.io/v1/namespaces/gs/leases/gputopo-agent-n1", "application/merge-patch+json"),
        {"spec": {"holderIdentity": "n1", "renewTime": "2026-01-02T03:04:05.678900Z", "leaseDurationSeconds": 40}},
        id="lease-renew",
    ),
]


@pytest.mark.parametrize(("write", "request_line", "body"), WRITES)
def test_typed_writes_send_what_the_api_server_expects(
    server: FakeApiServer, kube: Kube, write: Callable[[Kube], object], request_line: tuple[str, str, str], body: JSON
) -> None:
    server.replies = [Reply(201, {"kind": "Whatever"})]
    write(kube)
    (seen,) = server.seen
    assert (seen.method, seen.path, seen.content_type) == request_line
    assert seen.body == body


# ----------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("explicit", "env", "home_config", "expected"),
    [
        pytest.param("/a/explicit", "/b/env", True, "/a/explicit", id="explicit-wins"),
        pytest.param(None, "/b/env:/c/more", True, "/b/env", id="first-of-KUBECONFIG"),
        pytest.param(None, "", True, "HOME/.kube/config", id="home-config-when-it-exists"),
        pytest.param(None, "", False, None, id="in-cluster-otherwise"),
    ],
)
def test_the_kubeconfig_lookup(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    explicit: str | None,
    env: str,
    home_config: bool,
    expected: str | None,
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", env)
    if home_config:
        (tmp_path / ".kube").mkdir()
        (tmp_path / ".kube" / "config").write_text("{}")
    found = find_kubeconfig(explicit)
    assert (str(found).replace(str(tmp_path), "HOME") if found else None) == expected


def test_watch_events_are_plain_dicts(server: FakeApiServer, kube: Kube) -> None:
    server.replies = [Reply(chunks=[line("ADDED", pod("a", "2"))])]
    (event,) = kube.watch("/api/v1/pods", "1", timeout_seconds=5)
    assert event == WatchEvent("ADDED", pod("a", "2"))
