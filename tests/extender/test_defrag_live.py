"""`gputopo defrag` over a live cluster (the in-memory FakeSource): it reads and never writes; and the
extender's fragmentation gauges, their values and their throttle."""

from __future__ import annotations

import json
import time

import pytest

from gputopo.console import defrag
from gputopo.console.cli import main
from gputopo.model import PLACEMENT_ANNOTATION, Placement
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, gputopo_pod, lease_obj, node_obj, pod_obj


def _placed(name: str, node: str, gpus: list[int], **ann: str) -> dict[str, object]:
    annotations = {"gputopo.io/nvlink": "required", **{f"gputopo.io/{k}": v for k, v in ann.items()}}
    annotations[PLACEMENT_ANNOTATION] = Placement(node=node, gpus=tuple(gpus), score=7, reason="r").to_annotation()
    return pod_obj(name, len(gpus), annotations, node=node, phase="Running")


def _cluster() -> FakeSource:
    source = FakeSource(NS)
    now = time.time()
    for n in (node_obj("n7", "dgx-h100"), node_obj("n9", "dgx-h100", in_use=[2, 3, 4, 5, 6, 7])):
        source.put("nodes", n)
        source.put("leases", lease_obj(n["metadata"]["name"], now))
    source.put("pods", _placed("tp2-x", "n7", [2, 5]))
    source.put("pods", pod_obj("wait-8", 8, {"gputopo.io/nvlink": "required"}))
    source.calls.clear()
    return source


def test_live_report_reads_lists_only_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _cluster()
    monkeypatch.setattr(defrag, "_source", lambda args: source)
    assert main(["defrag", "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["text"] for s in doc["steps"]] == [
        "move default/tp2-x from n7 GPUs 2,5 to n9 GPUs 0,1: frees an 8-GPU clique on n7, 8 fewer stranded GPUs"
    ]
    assert (doc["sizes"], doc["sizesFrom"]) == ([8], "the sizes of 1 pending gputopo pod")
    # Only lists reached the API server: no Binding, no Event, no eviction, no patch.
    assert sorted(source.calls) == ["list leases", "list nodes", "list pods"]
    assert source.bindings == [] and source.events == []


def test_live_loader_needs_nothing_but_list_objects() -> None:
    fake = _cluster()

    class ListOnly:  # an object with no write method at all: any write would raise AttributeError
        def list_objects(self, kind: str) -> tuple[list[dict[str, object]], str]:
            return fake.list_objects(kind)

    snap = defrag.load_live(ListOnly(), namespace=NS, stale_after_seconds=120)
    assert [(p.ref, p.node, sorted(p.gpus)) for p in snap.pods] == [("default/tp2-x", "n7", [2, 5])]
    assert (snap.pending, snap.skipped) == ([8], [])


def test_unreachable_cluster_is_status_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    source = _cluster()
    source.down = True
    monkeypatch.setattr(defrag, "_source", lambda args: source)
    assert main(["defrag"]) == 1
    assert capsys.readouterr().err.startswith("gputopo defrag: cannot read the cluster: ")


def _gauges(env: Env) -> dict[str, float | None]:
    """The gauges as a scrape reads them (collecting the registry is what /metrics does)."""
    registry = env.metrics.registry
    out: dict[str, float | None] = {
        f"free_cliques/{k}": registry.get_sample_value("gputopo_extender_free_cliques", {"size": k})
        for k in ("8", "4", "2")
    }
    out["stranded"] = registry.get_sample_value("gputopo_extender_stranded_gpus")
    return out


def test_gauges_count_free_cliques_and_stranded_gpus(env: Env) -> None:
    # n1: whole; n2: 6 free on NVSwitch; v1: GPUs 2, 3, 5, 6, 7 free on a DGX-1 (two pairs, one left).
    env.add_nodes(
        node_obj("n1", "dgx-h100"),
        node_obj("n2", "dgx-h100", in_use=[2, 5]),
        node_obj("v1", "dgx-1v", in_use=[0, 1, 4]),
    )
    assert _gauges(env) == {"free_cliques/8": 1.0, "free_cliques/4": 3.0, "free_cliques/2": 9.0, "stranded": 1.0}


def test_gauges_follow_cache_changes_at_most_every_ten_seconds(env: Env) -> None:
    env.add_nodes(node_obj("n1", "dgx-h100"))
    assert _gauges(env)["free_cliques/8"] == 1.0
    env.add_nodes(node_obj("n2", "dgx-h100"))
    assert _gauges(env)["free_cliques/8"] == 1.0  # throttled
    env.clock.advance(10)
    assert _gauges(env)["free_cliques/8"] == 2.0


def test_filter_calls_never_compute_the_gauges(env: Env) -> None:
    env.add_nodes(node_obj("n1", "dgx-h100"))
    tracker = env.metrics.fragmentation
    assert tracker is not None
    _gauges(env)
    computed = tracker.computed
    env.add_nodes(node_obj("n2", "dgx-h100"))
    env.clock.advance(60)
    for _ in range(5):
        env.filter(gputopo_pod("p", 8), ["n1", "n2"])
    assert tracker.computed == computed
    _gauges(env)
    assert tracker.computed == computed + 1
