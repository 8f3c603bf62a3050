"""KubePodSource over HTTP against a small stand-in API server: the list and watch requests it sends (field
selector, resourceVersion), events decoded line by line, 410 Gone as an ERROR event or an HTTP status, and a
KubeLocalPods kept current from it end to end."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from gputopo.agent.pods import KubeLocalPods, KubePodSource
from gputopo.kube import Backoff, Gone, Kube, Pacing
from tests.agent.dp_harness import NODE, pod_object, wait_for


class FakeApi:
    """GET /api/v1/pods: a list, or a watch that streams the queued lines and then ends."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.rv = "100"
        self.watch_lines: list[str] = []
        self.watch_status = 200
        self.queries: list[dict[str, list[str]]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                api.queries.append(query)
                assert url.path == "/api/v1/pods"
                if query.get("watch") == ["true"]:
                    body = "".join(line + "\n" for line in api.watch_lines).encode()
                    api.watch_lines = []
                    status = api.watch_status
                else:
                    doc = {"kind": "PodList", "metadata": {"resourceVersion": api.rv}, "items": api.items}
                    body, status = json.dumps(doc).encode(), 200
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    yield fake
    fake.close()


@pytest.fixture
def source(api: FakeApi, tmp_path: Path) -> Iterator[KubePodSource]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    kube = Kube(kubeconfig)
    src = KubePodSource(kube)
    yield src
    src.close()
    kube.close()


def _event(kind: str, obj: dict[str, Any]) -> str:
    return json.dumps({"type": kind, "object": obj})


def test_list_asks_for_this_nodes_pods(api: FakeApi, source: KubePodSource) -> None:
    api.items = [pod_object("a", [0])]
    items, rv = source.list_pods(NODE)
    assert ([i["metadata"]["name"] for i in items], rv) == (["a"], "100")
    assert api.queries[-1]["fieldSelector"] == [f"spec.nodeName={NODE}"]


def test_watch_streams_events_from_the_resource_version(api: FakeApi, source: KubePodSource) -> None:
    api.watch_lines = [_event("ADDED", pod_object("a", [0])), _event("DELETED", pod_object("a", [0]))]
    events = list(source.watch_pods(NODE, "100", timeout_seconds=5))
    assert [(t, o["metadata"]["name"]) for t, o in events] == [("ADDED", "a"), ("DELETED", "a")]
    query = api.queries[-1]
    assert (query["resourceVersion"], query["fieldSelector"], query["watch"]) == (
        ["100"],
        [f"spec.nodeName={NODE}"],
        ["true"],
    )


@pytest.mark.parametrize(
    ("lines", "status"),
    [
        pytest.param([_event("ERROR", {"kind": "Status", "code": 410, "message": "too old"})], 200, id="error-event"),
        pytest.param([], 410, id="http-status"),
    ],
)
def test_gone_is_reported_for_a_relist(api: FakeApi, source: KubePodSource, lines: list[str], status: int) -> None:
    api.watch_lines, api.watch_status = lines, status
    with pytest.raises(Gone):
        list(source.watch_pods(NODE, "1", timeout_seconds=5))


def test_view_follows_the_api_server(api: FakeApi, source: KubePodSource) -> None:
    api.items = [pod_object("a", [0, 1])]
    api.watch_lines = [_event("ADDED", pod_object("b", [2]))]
    view = KubeLocalPods(NODE, source, watch_timeout_s=1, pacing=Pacing(backoff=Backoff(base_s=0.01, cap_s=30.0)))
    try:
        wait_for(lambda: sorted(p.name for p in view.pods()) == ["a", "b"], what="listed and watched pods")
        pod = view.get("default", "a")
        assert pod is not None and pod.placement is not None and pod.placement.gpus == (0, 1)
    finally:
        view.close()
