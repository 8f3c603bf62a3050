"""The cluster cache: list+watch with 410 relist, Lease staleness on the injected clock, assumed
allocations rebuilt from placement annotations after a restart, serving while the API is down."""

from __future__ import annotations

import json
import threading

import pytest

from gputopo.engine.state.reasons import Reason
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.source import Informer, start_informers
from gputopo.kube import Backoff, Pacing
from gputopo.model import PLACEMENT_ANNOTATION, parse_pod_request
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, lease_obj, node_obj, pod_obj, sync


def placed(name: str, node: str, gpus: list[int], *, bound: bool = True, phase: str = "Running") -> JSON:
    ann = {
        "gputopo.io/nvlink": "required",
        PLACEMENT_ANNOTATION: json.dumps({"node": node, "gpus": gpus, "score": 9, "reason": "r"}),
    }
    return pod_obj(name, len(gpus), ann, node=node if bound else None, phase=phase)


def test_watch_events_update_the_cache(env: Env) -> None:
    env.add_nodes(node_obj("n1"))
    inf = Informer(env.source, "nodes", env.cache)
    inf.relist()
    env.source.put("nodes", node_obj("n1", in_use=[0, 1, 2]))
    env.source.put("nodes", node_obj("n2", "l40s-4"))
    inf.watch_once(timeout_seconds=0)
    assert env.ledger.node_for("n1").in_use == frozenset({0, 1, 2})
    assert "n2" in env.cache.nodes
    env.source.delete("nodes", "", "n2")
    inf.watch_once(timeout_seconds=0)
    assert "n2" not in env.cache.nodes


def test_a_410_gone_watch_relists(env: Env) -> None:
    inf = Informer(env.source, "nodes", env.cache)
    inf.relist()
    assert inf.relists == 1
    env.source.put("nodes", node_obj("late"))
    env.source.compact()  # the change happened, but the watch history is gone
    inf.watch_once(timeout_seconds=0)
    assert inf.relists == 2
    assert "late" in env.cache.nodes


def test_informer_threads_sync_reconnect_and_keep_serving_when_the_api_is_down() -> None:
    source = FakeSource(NS)
    clock = FakeClock()
    source.put("nodes", node_obj("n1"))
    source.put("leases", lease_obj("n1", clock.now))
    cache = ClusterCache(clock=clock, lease_namespace=NS)
    fast = Pacing(backoff=Backoff(base_s=0.01, cap_s=0.05))
    started = start_informers(source, cache, watch_timeout_seconds=1, pacing=fast)
    try:
        for inf, _ in started:
            assert inf.synced.wait(10)
        assert cache.ready
        source.down = True  # the API server goes away: the informers retry with backoff
        source.put("nodes", node_obj("n2"))  # a change made while we could not watch
        source.down = False
        deadline = threading.Event()
        for _ in range(1000):  # bounded wait for the reconnect; no timing asserted
            if "n2" in cache.nodes:
                break
            deadline.wait(0.01)
        assert "n2" in cache.nodes
        source.down = True
        out = cache.ledger.evaluate(["n1"], parse_pod_request({}, 8))
        assert out[0].fits  # still answered from the cache
    finally:
        for inf, _t in started:
            inf.stop.set()
        source.down = False
        for _, t in started:
            t.join(5)


def test_readiness_waits_for_the_first_full_sync() -> None:
    cache = ClusterCache()
    assert not cache.ready
    source = FakeSource()
    Informer(source, "nodes", cache).relist()
    Informer(source, "pods", cache).relist()
    assert not cache.ready
    Informer(source, "leases", cache).relist()
    assert cache.ready


@pytest.mark.parametrize(
    ("lease_age", "expected"),
    [(0, None), (119, None), (121, Reason.TOPOLOGY_STALE), (None, Reason.TOPOLOGY_STALE)],
    ids=["fresh lease", "just inside staleAfterSeconds", "older than staleAfterSeconds", "no lease at all"],
)
def test_staleness_follows_the_lease_and_the_clock(env: Env, lease_age: float | None, expected: Reason | None) -> None:
    env.add_nodes(node_obj("n1"), lease=False)
    if lease_age is not None:
        env.source.put("leases", lease_obj("n1", env.clock.now - lease_age))
        env.resync()
    assert env.ledger.states(["n1"])[0].problem is expected


def test_a_node_goes_stale_when_its_agent_stops_without_any_event(env: Env) -> None:
    env.add_nodes(node_obj("n1"))
    pod = gputopo_pod("t", 8)
    assert env.filter(pod, ["n1"])["NodeNames"] == ["n1"]
    env.clock.advance(121)
    assert env.filter(pod, ["n1"])["FailedAndUnresolvableNodes"] == {"n1": "GPU topology stale"}
    env.source.put("leases", lease_obj("n1", env.clock.now))  # the agent is back
    env.resync()
    assert env.filter(pod, ["n1"])["NodeNames"] == ["n1"]


def test_leases_in_other_namespaces_are_ignored(env: Env) -> None:
    env.add_nodes(node_obj("n1"), lease=False)
    env.source.put("leases", lease_obj("n1", env.clock.now, namespace="kube-node-lease"))
    env.resync()
    assert env.ledger.states(["n1"])[0].problem is Reason.TOPOLOGY_STALE


@pytest.mark.parametrize(
    ("node", "reason", "detail"),
    [
        (node_obj("n1", None), Reason.TOPOLOGY_MISSING, "no gputopo.io/topology annotation"),
        (node_obj("n1", topology_text="{oops"), Reason.TOPOLOGY_INVALID, "not JSON"),
        (node_obj("n1", topology_text='{"version": 2, "gpus": []}'), Reason.TOPOLOGY_INVALID, "schema version"),
    ],
    ids=["no topology annotation", "topology not JSON", "unknown schema version"],
)
def test_topology_problems_carry_the_parse_error(
    env: Env, node: dict[str, object], reason: Reason, detail: str
) -> None:
    env.add_nodes(node)
    state = env.ledger.states(["n1"])[0]
    assert state.problem is reason
    assert detail in state.problem_detail


def test_in_use_is_agent_report_plus_placements_of_pods_bound_there(env: Env) -> None:
    env.add_nodes(node_obj("n1", in_use=[0]))
    env.add_pods(
        placed("bound", "n1", [1, 2]),
        placed("annotated-not-bound", "n1", [3], bound=False, phase="Pending"),
        placed("finished", "n1", [4, 5], phase="Succeeded"),
        placed("bound-elsewhere", "n2", [6]),
    )
    # An unbound pod's placement was written by someone else than a bind: it holds nothing.
    assert env.ledger.node_for("n1").in_use == frozenset({0, 1, 2})


def test_a_restarted_extender_rebuilds_assumed_gpus_from_placement_annotations(env: Env) -> None:
    env.add_nodes(node_obj("n1"), node_obj("n2"))
    first = gputopo_pod("first", 8)
    env.add_pods(first)
    assert env.bind(first, "n1") == ""
    # A new cache (a restarted extender, or a second replica) lists the same API state.
    fresh = ClusterCache(clock=env.clock, lease_namespace=NS)
    sync(fresh, env.source)
    assert fresh.ledger.node_for("n1").in_use == frozenset(range(8))
    outcomes = fresh.ledger.evaluate(["n1", "n2"], parse_pod_request({}, 8))
    assert [o.fits for o in outcomes] == [False, True]


def test_deleting_a_pod_frees_its_assumed_gpus(env: Env) -> None:
    env.add_nodes(node_obj("n1"))
    env.add_pods(placed("p", "n1", [0, 1, 2, 3]))
    assert env.ledger.node_for("n1").in_use == frozenset({0, 1, 2, 3})
    env.source.delete("pods", "default", "p")
    inf = Informer(env.source, "pods", env.cache)
    inf.relist()
    assert env.ledger.node_for("n1").in_use == frozenset()


def test_an_unbound_pods_placement_blocks_neither_itself_nor_others(env: Env) -> None:
    """Bind writes the placement in the same call that binds: an unbound pod carrying one did not get
    it from a bind, so it holds no GPUs."""
    env.add_nodes(node_obj("n1"))
    pod = placed("retry", "n1", list(range(8)), bound=False, phase="Pending")
    env.add_pods(pod)
    assert env.filter(pod, ["n1"])["NodeNames"] == ["n1"]
    other = gputopo_pod("other", 8)
    assert env.filter(other, ["n1"])["NodeNames"] == ["n1"]


def test_prioritize_right_after_filter_reuses_the_filter_outcomes(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    env.add_nodes(node_obj("n1"), node_obj("n2"))
    calls: list[int] = []
    real = env.ledger.evaluate_kinds

    def counting(*a: object, **kw: object) -> object:
        calls.append(1)
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(env.ledger, "evaluate_kinds", counting)
    pod = gputopo_pod("t", 4)
    assert env.filter(pod, ["n1", "n2"])["NodeNames"] == ["n1", "n2"]
    env.cache.apply("leases", "MODIFIED", lease_obj("n1", env.clock.now))  # a fresh node's heartbeat
    assert set(env.prioritize(pod, ["n1", "n2"])) == {"n1", "n2"}
    assert len(calls) == 1, "the heartbeat changed nothing, so prioritize answered from filter"
    env.add_pods(pod_obj("other", 4, node="n1"))  # a real change: recompute
    env.prioritize(pod, ["n1", "n2"])
    assert len(calls) == 2
