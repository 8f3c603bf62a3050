"""The preempt verb over the cache: victims' GPUs, priorities and groups come from the pods the cache
holds; the answer names, per node, the victims that free an NVLink clique, or drops the node. And the
filter keeps nodes preemption cannot resolve out of kube-scheduler's preemption candidates."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping

import pytest

from gputopo.extender.verbs import service
from gputopo.model import PLACEMENT_ANNOTATION
from tests.extender.harness import JSON, Env, gputopo_pod, node_obj, pod_obj


def victim(name: str, node: str, gpus: list[int], priority: int, group: str | None = None) -> JSON:
    """A bound gputopo pod holding `gpus` on `node` (its placement), with that spec.priority."""
    ann = {PLACEMENT_ANNOTATION: json.dumps({"node": node, "gpus": gpus, "score": 9, "reason": "r"})}
    if group is not None:
        ann |= {"gputopo.io/group": group, "gputopo.io/group-size": "2"}
    pod = pod_obj(name, len(gpus), ann, node=node, phase="Running")
    pod["spec"]["priority"] = priority
    return pod


def preempt(env: Env, offers: Mapping[str, list[str]], *, pdb: int = 0, gpus: int = 4) -> JSON:
    meta = {n: {"Pods": [{"UID": f"uid-default-{v}"} for v in vs], "NumPDBViolations": pdb} for n, vs in offers.items()}
    body = {"Pod": gputopo_pod("high", gpus, nvlink="required"), "NodeNameToMetaVictims": meta}
    r = env.call("preempt", body)
    assert r.status == 200
    out: JSON = r.json()["NodeNameToMetaVictims"]
    return out


def names(answer: JSON, node: str) -> list[str]:
    return [p["UID"].removeprefix("uid-default-") for p in answer[node]["Pods"]]


# dgx-1v: NVLink quads 0-3 and 4-7. Every GPU of "a" is held by a 1-GPU victim.
PRIORITIES = {0: 1, 1: 1, 4: 1, 5: 1, 2: 50, 3: 50, 6: 40, 7: 40}


@pytest.mark.parametrize(
    ("offer", "kept"),
    [
        pytest.param(["p0", "p1", "p4", "p5"], None, id="kube-scheduler's count-based offer frees no quad: dropped"),
        pytest.param(["p0", "p1", "p2", "p3"], ["p0", "p1", "p2", "p3"], id="an offer that frees quad 0-3 stands"),
        pytest.param(
            ["p0", "p1", "p2", "p3", "p4", "p5"], ["p0", "p1", "p2", "p3"], id="a larger offer is narrowed to one quad"
        ),
        pytest.param(
            ["p6", "p7", "p4", "p5", "p2", "p3", "p0", "p1"],
            ["p6", "p7", "p4", "p5"],
            id="of two quads, the one whose highest victim priority is lower, in the order offered",
        ),
    ],
)
def test_preempt_keeps_only_victims_that_free_a_full_quad(env: Env, offer: list[str], kept: list[str] | None) -> None:
    env.add_nodes(node_obj("a", "dgx-1v"))
    env.add_pods(*(victim(f"p{g}", "a", [g], p) for g, p in PRIORITIES.items()))
    answer = preempt(env, {"a": offer})
    if kept is None:
        assert answer == {}
    else:
        assert names(answer, "a") == kept


@pytest.mark.parametrize(
    ("second_member_on", "kept"),
    [
        pytest.param("a", ["g0", "g1", "p2", "p3"], id="both members offered: the group goes whole"),
        pytest.param("b", None, id="the other member runs on another node: never the only one evicted"),
    ],
)
def test_preempt_never_leaves_a_group_partial(env: Env, second_member_on: str, kept: list[str] | None) -> None:
    env.add_nodes(node_obj("a", "dgx-1v"), node_obj("b", "dgx-1v"))
    g1_gpus = [1] if second_member_on == "a" else [0]
    env.add_pods(
        victim("g0", "a", [0], 1, group="g"),
        victim("g1", second_member_on, g1_gpus, 1, group="g"),
        *(victim(f"p{g}", "a", [g], 1) for g in (2, 3) + ((1,) if second_member_on == "b" else ())),
        *(victim(f"p{g}", "a", [g], 50) for g in (4, 5, 6, 7)),
    )
    offer = ["g0", "g1", "p2", "p3"] if second_member_on == "a" else ["g0", "p1", "p2", "p3"]
    answer = preempt(env, {"a": offer})
    if kept is None:
        assert answer == {}
    else:
        assert names(answer, "a") == kept


@pytest.mark.parametrize(
    ("pdb", "offer", "want_pdb"),
    [
        pytest.param(2, ["p0", "p1", "p2", "p3"], 2, id="an unchanged offer keeps kube-scheduler's count"),
        pytest.param(6, ["p0", "p1", "p2", "p3", "p4", "p5"], 4, id="a narrowed offer reports at most its victims"),
    ],
)
def test_preempt_reports_pdb_violations_never_below_what_they_may_be(
    env: Env, pdb: int, offer: list[str], want_pdb: int
) -> None:
    env.add_nodes(node_obj("a", "dgx-1v"))
    env.add_pods(*(victim(f"p{g}", "a", [g], p) for g, p in PRIORITIES.items()))
    assert preempt(env, {"a": offer}, pdb=pdb)["a"]["NumPDBViolations"] == want_pdb


@pytest.mark.parametrize(
    ("in_use", "bucket", "message"),
    [
        pytest.param([0, 1, 4, 5], "FailedAndUnresolvableNodes", "no free 4-GPU NVLink clique", id="free but no quad"),
        pytest.param([0, 1, 2, 4, 5], "FailedNodes", "fewer than 4 free GPUs", id="too few free: preemption may help"),
    ],
)
def test_filter_keeps_a_node_with_free_gpus_but_no_clique_out_of_preemption(
    env: Env, in_use: list[int], bucket: str, message: str
) -> None:
    env.add_nodes(node_obj("a", "dgx-1v", in_use=in_use))
    out = env.filter(gputopo_pod("high", 4, nvlink="required"), ["a"])
    assert out[bucket] == {"a": message}


def _delete_after(env: Env, names: list[str], seconds: float) -> threading.Thread:
    """The pod watch delivering the victims' deletions `seconds` late (they leave the cache then)."""

    def run() -> None:
        time.sleep(seconds)
        for name in names:
            env.cache.upsert_pod(pod_obj(name, node="a"), deleted=True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    ("preemptor", "deleted_after", "wait_at_most", "passes"),
    [
        pytest.param("high", 0.05, 30.0, True, id="the preemptor waits for its victims to leave the lagging cache"),
        pytest.param("high", None, 0.2, False, id="victims that never leave: the wait is bounded"),
        pytest.param("other", None, 30.0, False, id="another pod does not wait"),
    ],
)
def test_a_preemptors_retry_waits_for_the_victims_its_preempt_answer_named(
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
    preemptor: str,
    deleted_after: float | None,
    wait_at_most: float,
    passes: bool,
) -> None:
    monkeypatch.setattr(service, "PREEMPTION_CATCH_UP_SECONDS", wait_at_most)
    env.add_nodes(node_obj("a", "dgx-1v"))
    env.add_pods(*(victim(f"p{g}", "a", [g], p) for g, p in PRIORITIES.items()))
    assert names(preempt(env, {"a": ["p0", "p1", "p2", "p3"]}), "a") == ["p0", "p1", "p2", "p3"]
    # kube-scheduler deletes them and retries at once: the cache has not seen the deletions yet.
    waiter = _delete_after(env, ["p0", "p1", "p2", "p3"], deleted_after) if deleted_after is not None else None
    start = time.monotonic()
    answer = env.filter(gputopo_pod(preemptor, 4, nvlink="required"), ["a"])
    took = time.monotonic() - start
    assert (answer["NodeNames"] == ["a"]) is passes
    assert took < 25  # bounded: the wait ends with the deletions or at the limit, never later
    if waiter is not None:
        waiter.join(25)
