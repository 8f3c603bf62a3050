"""The three listeners of one extender process, over real sockets: the verbs on loopback over HTTP, the
webhook over TLS, the metrics; each refuses the others' paths, and /healthz answers while a decision runs."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gputopo.engine.node.placement import evaluate_node
from gputopo.extender.app import create_listeners
from gputopo.extender.main import ListenError, serve
from gputopo.extender.settings import Settings
from gputopo.extender.state import ledger
from tests.extender.harness import args, certificate, gputopo_pod, serving

CLUSTER = "nodes:\n  - {name: h1, fixture: dgx-h100}\n  - {name: h2, fixture: hgx-h200}\n"
REVIEW = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": gputopo_pod("p", 1)},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Running:
    urls: dict[str, str]
    ca: Path

    def client(self, listener: str) -> httpx.Client:
        verify: Any = ssl.create_default_context(cafile=str(self.ca)) if listener == "webhook" else True
        return httpx.Client(base_url=self.urls[listener], timeout=10, verify=verify)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("listeners")
    ca, crt, key = certificate(tmp)
    (tmp / "cluster.yaml").write_text(CLUSTER)
    ports = {name: _free_port() for name in ("verbs", "webhook", "metrics")}
    settings = Settings(
        snapshot=tmp / "cluster.yaml",
        port=ports["verbs"],
        webhook_host="127.0.0.1",
        webhook_port=ports["webhook"],
        tls_cert_file=crt,
        tls_key_file=key,
        metrics_host="127.0.0.1",
        metrics_port=ports["metrics"],
        log_level="critical",
    )
    urls = {
        "verbs": f"http://127.0.0.1:{ports['verbs']}",
        "webhook": f"https://127.0.0.1:{ports['webhook']}",
        "metrics": f"http://127.0.0.1:{ports['metrics']}",
    }
    r = Running(urls, ca)

    def ready() -> bool:
        for listener in urls:
            with r.client(listener) as c:
                try:
                    if c.get("/readyz").status_code != 200:
                        return False
                except httpx.TransportError:
                    return False
        return True

    with serving(settings, ready, "every listener"):
        yield r


@pytest.mark.parametrize(
    ("listener", "method", "path", "body", "status"),
    [
        pytest.param("verbs", "POST", "/filter", args(gputopo_pod("p", 1), ["h1"]), 200, id="verbs serve filter"),
        pytest.param("verbs", "POST", "/mutate", REVIEW, 404, id="verbs refuse mutate"),
        pytest.param("verbs", "GET", "/metrics", None, 404, id="verbs refuse metrics"),
        pytest.param("webhook", "POST", "/mutate", REVIEW, 200, id="webhook serves mutate over TLS"),
        pytest.param("webhook", "POST", "/filter", args(gputopo_pod("p", 1), ["h1"]), 404, id="webhook refuses filter"),
        pytest.param("webhook", "POST", "/bind", {}, 404, id="webhook refuses bind"),
        pytest.param("webhook", "GET", "/metrics", None, 404, id="webhook refuses metrics"),
        pytest.param("metrics", "GET", "/metrics", None, 200, id="metrics serve metrics"),
        pytest.param("metrics", "POST", "/filter", args(gputopo_pod("p", 1), ["h1"]), 404, id="metrics refuse filter"),
        pytest.param("metrics", "POST", "/mutate", REVIEW, 404, id="metrics refuse mutate"),
        *[
            pytest.param(listener, "GET", path, None, 200, id=f"{listener} answer {path}")
            for listener in ("verbs", "webhook", "metrics")
            for path in ("/healthz", "/readyz")
        ],
    ],
)
def test_each_listener_answers_its_own_paths_and_404_for_the_others(
    running: Running, listener: str, method: str, path: str, body: Any, status: int
) -> None:
    with running.client(listener) as c:
        assert c.request(method, path, json=body).status_code == status


def test_the_webhook_listener_speaks_only_tls(running: Running) -> None:
    plain = running.urls["webhook"].replace("https://", "http://")
    with httpx.Client(base_url=plain, timeout=10) as c, pytest.raises(httpx.TransportError):
        c.get("/healthz")


def test_healthz_answers_while_a_long_decision_runs(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(*a: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(30)  # held until /healthz has answered (30 s only so a failure cannot hang the suite)
        return evaluate_node(*a, **kw)

    monkeypatch.setattr(ledger, "evaluate_node", slow)  # the engine call every filter makes per node
    answers: list[httpx.Response] = []

    def decide() -> None:
        with running.client("verbs") as c:
            answers.append(c.post("/filter", json=args(gputopo_pod("slow", 8), ["h1", "h2"])))

    decision = threading.Thread(target=decide)
    decision.start()
    try:
        assert entered.wait(30), "the filter call never reached the engine"
        for listener in ("verbs", "metrics"):
            with running.client(listener) as c:
                assert c.get("/healthz").json() == {"status": "ok"}, listener
        assert not answers, "the decision finished before it was released"
    finally:
        release.set()
        decision.join(30)
    assert answers[0].status_code == 200
    assert answers[0].json()["NodeNames"] == ["h1", "h2"]


@pytest.mark.parametrize(
    ("taken_by", "message"),
    [
        pytest.param("port", "--host/--port", id="verbs port in use"),
        pytest.param("metrics_port", "--metrics-host/--metrics-port", id="metrics port in use"),
    ],
)
def test_a_port_in_use_is_refused_naming_its_flags(tmp_path: Path, taken_by: str, message: str) -> None:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports: dict[str, Any] = {"port": _free_port(), "metrics_port": _free_port()}
        ports[taken_by] = taken.getsockname()[1]
        settings = Settings(snapshot=tmp_path / "cluster.yaml", metrics_host="127.0.0.1", log_level="critical", **ports)
        with pytest.raises(ListenError, match=message):
            asyncio.run(serve(create_listeners(settings), settings))
