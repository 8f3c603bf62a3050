"""Contract tests: kube-scheduler-shaped payloads for every verb, both key casings."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from gputopo.engine.state.reasons import summarize_failures
from gputopo.extender.app import create_listeners
from gputopo.extender.settings import Settings
from gputopo.extender.verbs.door import NOT_READY
from gputopo.extender.watch.source import Informer
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, FakeClock, Reply, args, call, gputopo_pod, lease_obj, node_obj, pod_obj

NODES = ["h100-a", "h100-b", "l40s-a"]


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(node_obj("h100-a"), node_obj("h100-b", in_use=[0, 1]), node_obj("l40s-a", "l40s-4"))
    return env


@pytest.mark.parametrize("lower", [False, True], ids=["go-cased with Nodes null", "lower-cased legacy keys"])
def test_filter_answers_with_go_field_names(cluster: Env, lower: bool) -> None:
    out = cluster.filter(gputopo_pod("train", 4), NODES, lower=lower)
    assert set(out) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert out["NodeNames"] == ["h100-a", "h100-b"]
    assert out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {}  # a node passed: no reasons
    assert out["Error"] == ""
    none_fit = cluster.filter(gputopo_pod("train", 8), ["h100-b", "l40s-a"], lower=lower)
    assert none_fit["NodeNames"] == []
    assert none_fit["FailedNodes"] == {"h100-b": "fewer than 8 free GPUs"}
    assert none_fit["FailedAndUnresolvableNodes"] == {"l40s-a": "fewer than 8 GPUs"}


def test_filter_accepts_camel_case_nodenames_spelling(cluster: Env) -> None:
    r = cluster.call("filter", {"Pod": gputopo_pod("t", 8), "nodeNames": ["h100-a", "h100-b"]})
    assert r.json()["NodeNames"] == ["h100-a"]


@pytest.mark.parametrize("lower", [False, True], ids=["go-cased", "lower-cased"])
def test_prioritize_returns_a_json_array_of_host_scores(cluster: Env, lower: bool) -> None:
    r = cluster.call("prioritize", args(gputopo_pod("train", 4), ["h100-a", "h100-b"], lower=lower))
    body = r.json()
    assert isinstance(body, list)
    assert [set(h) for h in body] == [{"Host", "Score"}] * len(body)
    scores = {"h100-a": 0, "h100-b": 0, **{h["Host"]: h["Score"] for h in body}}  # unlisted: kube-scheduler adds 0
    assert all(0 <= s <= 10 for s in scores.values())
    # h100-b already has GPUs 0-1 in use: taking 4 more packs it fuller, so it scores at least as well
    assert scores["h100-b"] >= scores["h100-a"]


def test_prioritize_scores_nodes_that_do_not_fit_zero(cluster: Env) -> None:
    scores = cluster.prioritize(gputopo_pod("train", 8), NODES)
    assert scores == {"h100-a": 10, "h100-b": 0, "l40s-a": 0}


@pytest.mark.parametrize(
    "pod",
    [
        pod_obj("plain", 8),
        pod_obj("cpu-only", 0),
        pod_obj("placement-only", 8, {"gputopo.io/placement": "{}"}),
        pod_obj("other-annotations", 2, {"example.com/team": "ml"}),
    ],
    ids=["plain GPU pod", "CPU pod", "only gputopo's own output annotation", "foreign annotations"],
)
def test_pods_without_gputopo_annotations_pass_through(cluster: Env, pod: dict[str, object]) -> None:
    names = [*NODES, "not-a-gpu-node"]
    out = cluster.filter(pod, names)
    assert out["NodeNames"] == names
    assert out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {}
    assert cluster.call("prioritize", args(pod, names)).json() == []  # no preference for any node


def test_filter_never_returns_a_node_that_was_not_asked_about(cluster: Env) -> None:
    out = cluster.filter(gputopo_pod("t", 1), ["h100-b", "ghost"])
    assert out["NodeNames"] == ["h100-b"]
    out = cluster.filter(gputopo_pod("t", 8), ["h100-b", "ghost"])  # none fits: every node with its reason
    returned = set(out["NodeNames"]) | set(out["FailedNodes"]) | set(out["FailedAndUnresolvableNodes"])
    assert returned == {"h100-b", "ghost"}
    assert out["FailedAndUnresolvableNodes"]["ghost"] == "GPU topology not reported"


def test_filter_with_full_node_list_echoes_surviving_node_objects(cluster: Env) -> None:
    items = [{"metadata": {"name": n, "labels": {"x": "y"}}} for n in NODES]
    r = cluster.call(
        "filter", {"Pod": gputopo_pod("t", 8), "Nodes": {"metadata": {}, "items": items}, "NodeNames": None}
    )
    out = r.json()
    assert out["Nodes"]["items"] == [items[0]]
    assert out["NodeNames"] == ["h100-a"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b"[]", "JSON object"),
        (b'{"NodeNames": ["a"]}', "Pod: Field required"),
        (b'{"Pod": null, "NodeNames": ["a"]}', "Pod"),
        (b'{"Pod": {"spec": {}}, "NodeNames": ["a"]}', "Pod.metadata is missing"),
        (b'{"Pod": {"metadata": {"name": "p"}}, "NodeNames": "a"}', "NodeNames"),
        (
            b'{"Pod": {"metadata": {"name": "p"}, "spec": {"containers": [{"resources": '
            b'{"limits": {"nvidia.com/gpu": "two"}}}]}}, "NodeNames": []}',
            "containers[0].resources.limits.nvidia.com/gpu",
        ),
    ],
    ids=[
        "malformed JSON",
        "empty body",
        "array instead of object",
        "missing Pod",
        "null Pod",
        "Pod without metadata",
        "NodeNames not a list",
        "GPU quantity not a number",
    ],
)
@pytest.mark.parametrize("verb", ["filter", "prioritize", "preempt"])
def test_malformed_requests_get_400_naming_the_problem(env: Env, verb: str, body: bytes, needle: str) -> None:
    if verb == "preempt" and needle == "NodeNames":
        # preempt has no NodeNames: the same slot carries a malformed victims map instead
        body, needle = b'{"Pod": {"metadata": {"name": "p"}}, "NodeNameToMetaVictims": "a"}', "NodeNameToMetaVictims"
    r = env.call(verb, content=body)
    assert r.status == 400
    assert needle in r.json()["Error"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"PodName": "p", "PodNamespace": "default"}, "Node: Field required"),
        ({"PodNamespace": "default", "Node": "n"}, "PodName: Field required"),
        ({"PodName": "", "PodNamespace": "default", "Node": "n"}, "PodName"),
    ],
    ids=["missing Node", "missing PodName", "empty PodName"],
)
def test_malformed_bind_gets_400(env: Env, body: dict[str, str], needle: str) -> None:
    r = env.call("bind", body)
    assert r.status == 400
    assert needle in r.json()["Error"]


def test_bind_accepts_lower_case_keys(cluster: Env) -> None:
    cluster.add_pods(gputopo_pod("t", 2))
    r = cluster.call("bind", {"podName": "t", "podNamespace": "default", "podUID": "uid-default-t", "node": "h100-a"})
    assert r.json() == {"Error": ""}
    assert cluster.source.bindings == [("default", "t", "uid-default-t", "h100-a")]


def test_an_unexpected_failure_is_reported_in_error_not_as_500(cluster: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("cache exploded")

    monkeypatch.setattr(cluster.ledger, "evaluate_kinds", boom)
    r = cluster.call("filter", args(gputopo_pod("t", 4), NODES))
    assert r.status == 200
    assert "cache exploded" in r.json()["Error"]
    r = cluster.call("prioritize", args(gputopo_pod("t", 4), NODES))
    assert r.status == 200
    assert r.json() == []  # neutral: the same score for every node, so no node is preferred


def test_failure_messages_aggregate_into_the_failed_scheduling_text(env: Env) -> None:
    env.add_nodes(
        node_obj("ok-but-busy", in_use=[0, 1, 2, 3, 4]),
        node_obj("pcie", "l40s-4"),
        node_obj("pcie-2", "l40s-4"),
        node_obj("no-topology", None),
    )
    env.add_nodes(node_obj("stale-1"), node_obj("stale-2"), lease=False)
    env.source.put("leases", lease_obj("stale-1", env.clock.now - 1000))
    env.resync()
    names = ["ok-but-busy", "pcie", "pcie-2", "no-topology", "stale-1", "stale-2"]
    out = env.filter(gputopo_pod("t", 4), names)
    assert out["NodeNames"] == []
    messages = [*out["FailedNodes"].values(), *out["FailedAndUnresolvableNodes"].values()]
    assert summarize_failures(messages, len(names)) == (
        "0/6 nodes are available: 1 GPU topology not reported, 1 fewer than 4 free GPUs, "
        "2 GPU topology stale, 2 fewer than 4 NVLink-connected GPUs."
    )
    assert out["FailedNodes"] == {"ok-but-busy": "fewer than 4 free GPUs"}  # preemption could help there


def test_nodes_with_too_few_gpus_are_unresolvable(cluster: Env) -> None:
    out = cluster.filter(pod_obj("big", 16, {"gputopo.io/nvlink": "ignore"}), NODES)
    assert out["FailedAndUnresolvableNodes"] == dict.fromkeys(NODES, "fewer than 16 GPUs")
    assert out["FailedNodes"] == {}


@pytest.mark.parametrize(
    ("annotations", "needle"),
    [
        ({"gputopo.io/nvlink": "sometimes"}, 'gputopo.io/nvlink="sometimes"'),
        ({"gputopo.io/min-gpu-memory": "lots"}, "gputopo.io/min-gpu-memory"),
        ({"gputopo.io/group": "g"}, "needs gputopo.io/group-size"),
        ({"gputopo.io/colour": "blue"}, "unknown gputopo annotation"),
    ],
    ids=["bad nvlink value", "bad memory quantity", "group without size", "unknown annotation"],
)
def test_a_malformed_annotation_fails_every_node_with_one_message(
    cluster: Env, annotations: dict[str, str], needle: str
) -> None:
    before = cluster.ledger.generation
    out = cluster.filter(pod_obj("bad", 4, annotations), NODES)
    assert out["NodeNames"] == []
    assert out["FailedNodes"] == {}
    messages = set(out["FailedAndUnresolvableNodes"].values())
    assert len(messages) == 1 and set(out["FailedAndUnresolvableNodes"]) == set(NODES)
    assert needle in messages.pop()
    assert cluster.ledger.generation == before  # nothing about the cluster changed


def test_preempt_drops_nodes_that_cannot_fit_even_without_their_victims(env: Env) -> None:
    env.add_nodes(node_obj("busy", in_use=[0, 1, 2, 3]), node_obj("tiny", "l40s-4"), node_obj("victim-node"))
    victim = pod_obj(
        "low",
        8,
        {"gputopo.io/placement": '{"node":"victim-node","gpus":[0,1,2,3,4,5,6,7],"score":10,"reason":"r"}'},
        node="victim-node",
        phase="Running",
    )
    env.add_pods(victim)
    body = {
        "Pod": gputopo_pod("high", 8),
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            "victim-node": {"Pods": [{"UID": "uid-default-low"}], "NumPDBViolations": 0},
            "tiny": {"Pods": [{"UID": "whatever"}], "NumPDBViolations": 0},
            "busy": {"Pods": [{"UID": "unknown-plain-pod"}], "NumPDBViolations": 1},
        },
    }
    r = env.call("preempt", body)
    assert r.status == 200
    kept = r.json()["NodeNameToMetaVictims"]
    # tiny has 4 GPUs: no victim helps. busy's victim is unknown to gputopo, so it is kept.
    assert kept == {
        "victim-node": {"Pods": [{"UID": "uid-default-low"}], "NumPDBViolations": 0},
        "busy": {"Pods": [{"UID": "unknown-plain-pod"}], "NumPDBViolations": 1},
    }


def test_preempt_for_a_plain_pod_returns_candidates_unchanged(cluster: Env) -> None:
    body = {"pod": pod_obj("plain", 1), "nodeNameToMetaVictims": {"l40s-a": {"pods": [{"uid": "x"}]}}}
    r = cluster.call("preempt", body)
    assert r.json() == {"NodeNameToMetaVictims": {"l40s-a": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0}}}


def _sibling(env: Env, listener: str) -> TestClient:
    """A client of another listener's app; it shares the door's cache and service."""
    return TestClient(getattr(env.listeners, listener))


def _verbs(env: Env, method: str, path: str, body: bytes = b"") -> Reply:
    """What the verbs listener answers `method path`: the door's route, then its answer."""
    verb = env.door.route(method.encode(), path)
    return Reply(*verb) if isinstance(verb, tuple) else env.call(verb, content=body)


def test_health_readiness_and_metrics(cluster: Env) -> None:
    assert cluster.call("healthz").json() == {"status": "ok"}
    assert cluster.call("readyz").json() == {"status": "ready", "nodes": 3}
    cluster.filter(gputopo_pod("t", 8), NODES)
    cluster.filter(pod_obj("plain", 8), NODES)
    text = _sibling(cluster, "metrics").get("/metrics").text
    assert 'gputopo_extender_request_duration_seconds_count{verb="filter"} 2.0' in text
    assert 'gputopo_extender_decisions_total{outcome="feasible",reason="",verb="filter"} 1.0' in text
    assert 'gputopo_extender_decisions_total{outcome="pass_through",reason="",verb="filter"} 1.0' in text
    assert "gputopo_extender_cache_age_seconds 0.0" in text


def test_the_mutating_webhook_is_served_at_mutate(env: Env) -> None:
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "object": pod_obj("p", 1, {"gputopo.io/nvlink": "required"})},
    }
    webhook = _sibling(env, "webhook")
    r = webhook.post("/mutate", json=review)
    assert r.status_code == 200
    assert r.json()["response"]["uid"] == "u-1"
    assert webhook.post("/mutate", content=b"[]").status_code == 400
    assert webhook.post("/mutate", json={"kind": "AdmissionReview", "request": "not an object"}).status_code == 400


# Which paths each listener serves; every other listener's path is a 404 there.
ROUTES = {
    "verbs": [("POST", "/filter"), ("POST", "/prioritize"), ("POST", "/bind"), ("POST", "/preempt")],
    "webhook": [("POST", "/mutate")],
    "metrics": [("GET", "/metrics")],
}
HEALTH = [("GET", "/healthz"), ("GET", "/readyz")]


@pytest.mark.parametrize(
    ("listener", "method", "path", "served"),
    [
        pytest.param(listener, method, path, owner == listener, id=f"{listener} {path}")
        for listener in ROUTES
        for owner, routes in ROUTES.items()
        for method, path in routes
    ]
    + [pytest.param(listener, m, p, True, id=f"{listener} {p}") for listener in ROUTES for m, p in HEALTH],
)
def test_each_listener_serves_only_its_own_paths(
    cluster: Env, listener: str, method: str, path: str, served: bool
) -> None:
    if listener == "verbs":
        answer = _verbs(cluster, method, path, b"{}")
        assert (answer.status != 404) is served, (answer.status, answer.text[:200])
        return
    r = _sibling(cluster, listener).request(method, path, content=b"{}")
    assert (r.status_code != 404) is served, (r.status_code, r.text[:200])


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        pytest.param("filter", args(gputopo_pod("t", 8), NODES), id="filter"),
        pytest.param("bind", {"PodName": "t", "PodNamespace": "default", "PodUID": "u", "Node": "h100-a"}, id="bind"),
    ],
)
def test_filter_and_bind_report_an_error_until_the_first_full_list(verb: str, body: dict[str, Any]) -> None:
    # Nodes listed but no pods yet: the ledger would not know which GPUs bound pods hold.
    source = FakeSource(NS)
    source.put("nodes", node_obj("h100-a"))
    listeners = create_listeners(Settings(namespace=NS), cluster=source, clock=FakeClock(), watch=False)
    Informer(source, "nodes", listeners.cache).relist()
    with listeners.running():
        assert call(listeners.door, "readyz").status == 503
        out = call(listeners.door, verb, body).json()
    assert out["Error"] == NOT_READY
    assert not out.get("NodeNames")
