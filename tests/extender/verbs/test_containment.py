"""Containment and bounded state: a malformed Node, Pod or Lease costs only itself (nodes become
unschedulable for gputopo with the reason, others are skipped and counted), nothing kept grows with
names that requests make up, and a decision leaves the ledger's lock free while it computes."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest

from gputopo.console import inspect
from gputopo.engine.node.placement import Outcome, evaluate_node
from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import NodeState
from gputopo.extender.watch.source import ClusterSource, Informer, Kind
from gputopo.kube import WatchEvent
from gputopo.model import PodRequest, parse_pod_request
from tests.extender.harness import JSON, Env, gputopo_pod, lease_obj, node_obj

HUGE = "x" * (300 * 1024)  # over the API server's 256 KiB cap on one object's annotations


class ScriptedSource:
    """Just what an Informer reads: one list, then one watch replaying the given events."""

    def __init__(self, items: list[Any], events: list[WatchEvent]) -> None:
        self.items, self.events = items, events

    def list_objects(self, kind: Kind) -> tuple[list[JSON], str]:
        return list(self.items), "1"

    def watch(self, kind: Kind, resource_version: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        yield from self.events


def scripted(items: list[Any], events: list[WatchEvent]) -> ClusterSource:
    return cast(ClusterSource, ScriptedSource(items, events))


def with_meta(**meta: Any) -> JSON:
    return {"metadata": meta, "spec": {}}


def bad_count(env: Env, kind: str) -> float:
    metrics = env.metrics
    return float(metrics.registry.get_sample_value("gputopo_extender_bad_objects_total", {"kind": kind}) or 0)


GOOD_POD = gputopo_pod("good", 8)
GOOD_POD["spec"]["nodeName"] = "good"
GOOD_POD["metadata"]["annotations"]["gputopo.io/placement"] = (
    '{"node":"good","gpus":[0,1,2,3,4,5,6,7],"score":9,"reason":"r"}'
)

# (kind, the malformed object, the node it leaves unreadable in the cache or None when it is skipped)
CASES = [
    pytest.param("nodes", "not an object", None, id="node: the object is a string"),
    pytest.param("nodes", {"metadata": ["n"]}, None, id="node: metadata not an object"),
    pytest.param("nodes", with_meta(name=7), None, id="node: name not a string"),
    pytest.param("nodes", with_meta(name="n" * 1_000_000), None, id="node: a 1 MB name"),
    pytest.param(
        "nodes", with_meta(name="bad", annotations=["a"]), "metadata.annotations", id="node: annotations a list"
    ),
    pytest.param("nodes", with_meta(name="bad", labels="l"), "metadata.labels", id="node: labels a string"),
    pytest.param(
        "nodes",
        with_meta(name="bad", annotations={"gputopo.io/topology": 5}),
        "not a string",
        id="node: value a number",
    ),
    pytest.param(
        "nodes", with_meta(name="bad", annotations={"gputopo.io/topology": HUGE}), "over 256 KiB", id="node: huge value"
    ),
    pytest.param("pods", ["a", "list"], None, id="pod: the object is a list"),
    pytest.param("pods", {"metadata": "m"}, None, id="pod: metadata not an object"),
    pytest.param("pods", with_meta(name="p", annotations=7), None, id="pod: annotations a number"),
    pytest.param("pods", with_meta(name="p", annotations={"gputopo.io/nvlink": None}), None, id="pod: value null"),
    pytest.param("pods", with_meta(name="p", annotations={"gputopo.io/nvlink": HUGE}), None, id="pod: huge value"),
    pytest.param("pods", {"metadata": {"name": "p"}, "spec": {"containers": "c"}}, None, id="pod: containers a string"),
    pytest.param("leases", 42, None, id="lease: the object is a number"),
    pytest.param("leases", {"metadata": None}, None, id="lease: metadata null"),
    pytest.param("leases", {"metadata": {"name": "gputopo-agent-good"}, "spec": []}, None, id="lease: spec a list"),
    pytest.param(
        "leases",
        {"metadata": {"name": "gputopo-agent-good"}, "spec": {"renewTime": 5}},
        None,
        id="lease: time a number",
    ),
]


@pytest.mark.parametrize("path", ["list", "watch"])
@pytest.mark.parametrize(("kind", "bad", "unreadable"), CASES)
def test_a_malformed_object_costs_only_itself(
    env: Env, path: str, kind: Kind, bad: Any, unreadable: str | None
) -> None:
    env.add_nodes(node_obj("good"))
    env.add_pods(GOOD_POD)
    good: dict[Kind, JSON] = {"nodes": node_obj("good"), "pods": GOOD_POD, "leases": lease_obj("good", env.clock.now)}
    before = bad_count(env, kind)
    if path == "list":
        Informer(scripted([bad, good[kind]], []), kind, env.cache).relist()
    else:
        events = [WatchEvent("MODIFIED", bad), WatchEvent("DELETED", bad), WatchEvent("MODIFIED", good[kind])]
        Informer(scripted([], events), kind, env.cache).watch_once(timeout_seconds=0)

    assert bad_count(env, kind) >= before + 1
    # The good objects still serve: the node is fresh, and the bound pod still holds its GPUs.
    assert env.ledger.node_for("good").in_use == frozenset(range(8))
    assert env.filter(gputopo_pod("next", 1, nvlink="ignore"), ["good"])["FailedNodes"] == {
        "good": "fewer than 1 free GPUs"
    }
    if unreadable is not None and (path == "list" or "bad" in env.ledger.nodes):
        (state,) = env.ledger.states(["bad"])
        assert state.problem is Reason.TOPOLOGY_INVALID and unreadable in state.problem_detail
        out = env.filter(gputopo_pod("next", 1), ["bad"])
        assert out["FailedAndUnresolvableNodes"] == {"bad": "GPU topology unreadable"}


def test_binds_to_10000_unknown_node_names_keep_no_state_per_name(env: Env) -> None:
    """Once, every distinct node name in a /bind left a lock behind (300 binds with 1 MB names: +287 MiB)."""
    env.add_nodes(node_obj("n1"))
    pod = gputopo_pod("p", 4)
    env.add_pods(pod)
    env.filter(pod, ["n1"])  # remembered: binds need no GET
    extender = env.extender
    locks_before = len(extender.binder.locks)
    for i in range(10_000):
        err = extender.bind("default", "p", "uid-default-p", f"no-such-node-{i}-" + "n" * 200)
        assert "GPU topology not reported" in err
    assert len(extender.binder.locks) == locks_before
    assert list(env.ledger.nodes) == ["n1"]
    assert env.ledger.node_for("n1").in_use == frozenset()  # no claim left behind
    assert len(extender.recent) <= extender.recent.MAX_PODS


def test_reservations_are_bounded_in_count(env: Env) -> None:
    """Filters may name any group; a one-member group is planned at once. The oldest reservations go."""
    env.add_nodes(*(node_obj(f"n{i}") for i in range(4)))
    env.ledger.book.max_groups = 8
    names = [f"n{i}" for i in range(4)]
    for i in range(50):
        pod = gputopo_pod(f"lone-{i}", 1, nvlink="ignore", group=f"g{i}", group_size="1")
        assert len(env.filter(pod, names)["NodeNames"]) == 1
        env.clock.advance(0.001)
    assert len(env.ledger.reservations) == 8
    assert set(env.ledger.reservations) == {("default", f"g{i}") for i in range(42, 50)}


def test_a_decision_leaves_the_ledger_lock_free_while_it_computes(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluating nodes runs outside the ledger's lock: informers keep applying events and other
    requests keep reading while a long decision is in progress."""
    env.add_nodes(node_obj("n1"), node_obj("n2", "l40s-4"))
    started, release = threading.Event(), threading.Event()

    def slow(state: NodeState, req: PodRequest, weights: Any) -> Outcome:
        started.set()
        assert release.wait(30), "the test never released the decision"
        return evaluate_node(state, req, weights)

    monkeypatch.setattr("gputopo.extender.state.ledger.evaluate_node", slow)
    results: list[list[Outcome]] = []
    worker = threading.Thread(
        target=lambda: results.append(env.ledger.evaluate(["n1", "n2"], parse_pod_request({}, 4))), daemon=True
    )
    worker.start()
    try:
        assert started.wait(30)
        assert env.ledger.lock.acquire(blocking=False), "the decision holds the ledger lock"
        env.ledger.lock.release()
        env.cache.apply("nodes", "MODIFIED", node_obj("n3"))  # an informer event lands meanwhile
        assert "n3" in env.ledger.nodes
    finally:
        release.set()
        worker.join(30)
    (outcomes,) = results
    assert [o.fits for o in outcomes] == [True, False]  # the PCIe-only node has no 4-GPU NVLink clique


def test_gputopo_topo_names_what_is_unreadable_in_a_node_object(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class OneNode:
        def get_node(self, name: str) -> JSON:
            return with_meta(name=name, annotations=["not", "a", "map"])

    monkeypatch.setattr(inspect, "_source", lambda _args: OneNode())
    args = argparse.Namespace(node="bad", gputopo_namespace="gputopo-system", stale_after_seconds=120)
    assert inspect.run_topo(args) == 1
    assert "bad: unreadable node object: metadata.annotations is not a map" in capsys.readouterr().err
