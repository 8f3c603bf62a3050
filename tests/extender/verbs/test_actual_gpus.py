"""Per-pod truth: a pod's assumed GPUs (its placement) give way to the GPUs its node reports under its
UID, so a kubelet that allocated other GPUs than placed frees the placed-but-unused ones at once; a
mismatch is posted once as a Warning Event, counted, and shown by `gputopo explain`."""

from __future__ import annotations

import argparse
import json

import pytest

from gputopo.console import inspect
from gputopo.extender.metrics import Metrics
from gputopo.extender.verbs.service import Extender
from gputopo.extender.watch.cache import ClusterCache
from gputopo.model import PLACEMENT_ANNOTATION, GpusInUse
from tests.extender.harness import JSON, NS, Env, gputopo_pod, node_obj, pod_obj, sync

UID = "uid-default-train"
PLACED = [0, 1, 2, 3]


def placed_pod(gpus: list[int] = PLACED, node: str = "n1", name: str = "train", uid: str = UID) -> JSON:
    ann = {
        "gputopo.io/nvlink": "required",
        PLACEMENT_ANNOTATION: json.dumps({"node": node, "gpus": gpus, "score": 9, "reason": "r"}),
    }
    return pod_obj(name, len(gpus), ann, uid=uid, node=node, phase="Running")


def reporting(actual: set[int], node: str = "n1", fixture: str = "dgx-h100", uid: str = UID) -> JSON:
    return node_obj(node, fixture, report=GpusInUse(pods={uid: frozenset(actual)}))


def free_for(env: Env, gpus: int, node: str = "n1") -> bool:
    return node in env.filter(gputopo_pod("next", gpus, nvlink="ignore"), [node])["NodeNames"]


@pytest.mark.parametrize(
    ("actual", "mismatch"),
    [
        pytest.param({0, 1, 2, 3}, False, id="matching"),
        pytest.param({4, 5, 6, 7}, True, id="disjoint"),
        pytest.param({2, 3, 4, 5}, True, id="overlapping"),
    ],
)
@pytest.mark.parametrize("report_first", [False, True], ids=["placement seen first", "report arrives first"])
def test_reported_gpus_replace_the_placed_ones(env: Env, actual: set[int], mismatch: bool, report_first: bool) -> None:
    if report_first:
        env.add_nodes(reporting(actual))
        assert env.ledger.node_for("n1").in_use == actual  # an unknown pod's GPUs are in use all the same
        env.add_pods(placed_pod())
    else:
        env.add_nodes(node_obj("n1"))
        env.add_pods(placed_pod())
        assert env.ledger.node_for("n1").in_use == set(PLACED)
        env.add_nodes(reporting(actual))
    assert env.ledger.node_for("n1").in_use == actual  # never placed ∪ actual
    assert free_for(env, 4)  # the placed-but-unused GPUs are free for the next pod
    assert not free_for(env, 5)
    assert (UID in env.ledger.mismatches) is mismatch


def test_a_deleted_pod_frees_its_placement_but_not_what_the_node_still_reports(env: Env) -> None:
    env.add_nodes(reporting({4, 5, 6, 7}))
    env.add_pods(placed_pod())
    env.source.delete("pods", "default", "train")
    env.resync()
    assert env.ledger.node_for("n1").in_use == {4, 5, 6, 7}  # the kubelet has not released them yet
    assert UID not in env.ledger.mismatches
    env.add_nodes(node_obj("n1", report=GpusInUse()))
    assert env.ledger.node_for("n1").in_use == frozenset()


def test_other_and_plain_pods_reported_by_uid_count_as_used(env: Env) -> None:
    report = GpusInUse(pods={"uid-plain": frozenset({6, 7})}, other=frozenset({5}))
    env.add_nodes(node_obj("n1", report=report))
    env.add_pods(placed_pod())
    assert env.ledger.node_for("n1").in_use == {0, 1, 2, 3, 5, 6, 7}


def test_a_version_1_list_still_counts_as_in_use_next_to_placements(env: Env) -> None:
    env.add_nodes(node_obj("n1", in_use=[4, 5]))
    env.add_pods(placed_pod())
    assert env.ledger.node_for("n1").in_use == {0, 1, 2, 3, 4, 5}
    assert not env.ledger.mismatches


def _events(env: Env) -> list[JSON]:
    env.extender.flush_events()
    return [e for e in env.source.events if e["reason"] == "TopologyPlacementMismatch"]


@pytest.mark.parametrize(
    ("placed", "actual", "words"),
    [
        pytest.param(
            [0, 1], {2, 3}, "GPUs 2-3 on n1, not the placed GPUs 0-1: still a full NVLink clique", id="clique"
        ),
        pytest.param([0, 1], {0, 5}, "GPUs 0,5 on n1, not the placed GPUs 0-1: not a full NVLink clique", id="split"),
        pytest.param([0], {3}, "GPU 3 on n1, not the placed GPU 0: a single GPU", id="single gpu"),
    ],
)
def test_a_mismatch_posts_one_warning_event_naming_both_sets(
    env: Env, placed: list[int], actual: set[int], words: str
) -> None:
    env.add_nodes(node_obj("n1", "dgx-1v"))
    env.add_pods(placed_pod(placed))
    env.add_nodes(reporting(actual, fixture="dgx-1v"))
    # Later updates of the same pod and node, and a relist, do not repeat it.
    env.add_nodes(node_obj("n1", "dgx-1v", report=GpusInUse(pods={UID: frozenset(actual)}, other=frozenset({7}))))
    env.add_pods(placed_pod(placed))
    env.resync()
    (event,) = _events(env)
    assert event["type"] == "Warning"
    assert words in event["message"]
    assert event["involvedObject"]["uid"] == UID
    assert event["involvedObject"]["name"] == "train"
    metrics: Metrics = env.metrics
    clique = "false" if "not a full" in words else "true"
    assert metrics.registry.get_sample_value("gputopo_extender_placement_mismatches_total", {"clique": clique}) == 1


def test_a_restarted_extender_does_not_post_the_mismatch_event_again(env: Env) -> None:
    env.add_nodes(reporting({4, 5, 6, 7}))
    env.add_pods(placed_pod())
    assert len(_events(env)) == 1
    restarted = Extender(ClusterCache(clock=env.clock, lease_namespace=NS), env.source)
    sync(restarted.cache, env.source)
    restarted.flush_events()
    assert len(_events(env)) == 1  # same Event name: the API server answers 409, nothing new


def test_no_event_when_the_node_reports_the_placed_gpus(env: Env) -> None:
    env.add_nodes(node_obj("n1"))
    env.add_pods(placed_pod())
    env.add_nodes(reporting(set(PLACED)))
    assert _events(env) == []


@pytest.mark.parametrize(
    ("victims", "gpus", "kept"),
    [
        pytest.param([UID], 4, True, id="the victim's actual GPUs make room"),
        pytest.param([UID], 8, False, id="the pod now on its placed GPUs stays"),
        pytest.param([UID, "uid-other"], 8, True, id="both victims: the whole node"),
        pytest.param(["uid-plain"], 1, True, id="a plain pod the node reports by uid is known"),
        pytest.param(["uid-plain"], 8, False, id="a known plain victim frees only its own GPUs"),
    ],
)
def test_preempt_subtracts_what_victims_actually_hold(env: Env, victims: list[str], gpus: int, kept: bool) -> None:
    # train was placed on 0-3 but got 4-7; other was then placed on the freed 0-3.
    env.add_nodes(node_obj("n1", report=GpusInUse(pods={UID: frozenset({4, 5, 6, 7})})))
    env.add_nodes(node_obj("n2", report=GpusInUse(pods={"uid-plain": frozenset({7})}, other=frozenset({0}))))
    env.add_pods(placed_pod(), placed_pod([0, 1, 2, 3], name="other", uid="uid-other"))
    assert env.ledger.node_for("n1").in_use == set(range(8))
    node = "n2" if victims == ["uid-plain"] else "n1"
    meta = {node: {"Pods": [{"UID": v} for v in victims], "NumPDBViolations": 0}}
    body = {"Pod": gputopo_pod("high", gpus, nvlink="ignore"), "NodeNameToVictims": None, "NodeNameToMetaVictims": meta}
    r = env.call("preempt", body)
    assert r.status == 200
    assert (node in r.json()["NodeNameToMetaVictims"]) is kept


def test_explain_shows_the_actual_gpus_next_to_the_placed_ones(
    env: Env, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env.add_nodes(reporting({4, 5, 6, 7}))
    env.add_pods(placed_pod())
    monkeypatch.setattr(inspect, "_source", lambda _args: env.source)
    args = argparse.Namespace(pod="train", namespace="default", stale_after_seconds=1e12, gputopo_namespace=NS)
    assert inspect.run(args) == 0
    out = capsys.readouterr().out
    assert "Bound to n1, GPUs 0-3" in out
    assert "Actual GPUs 4-7 (reported by the node), not the placed 0-3: still a full NVLink clique" in out
    # Judged as if the pod were not there: neither its placed nor its actual GPUs count.
    assert "fits" in out and "0-3" in out.split("NODE", 1)[1]
