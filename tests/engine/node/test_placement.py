"""Per-node verdicts: every reason category, GPU choice, scores, and equivalence memoisation."""

from __future__ import annotations

import json

import pytest

from gputopo.engine.node.placement import evaluate_node, evaluate_pod, fail_invalid, rank
from gputopo.engine.state.reasons import Code, Reason, summarize_failures
from gputopo.engine.state.scoring import grade
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import NodeTopology, parse_pod_request, parse_topology
from gputopo.systems import build_system


def node(system: str, name: str = "n", in_use: tuple[int, ...] = (), **kw: object) -> NodeState:
    return node_state(name, build_system(system, name), in_use=frozenset(in_use), **kw)  # type: ignore[arg-type]


def degraded(system: str, *gpus: int) -> NodeTopology:
    """A topology whose GPUs each lost one link (as the agent publishes it: listed, not counted).
    On NVSwitch systems that is one switch link: every pair with that GPU drops from NV18 to NV17."""
    doc = json.loads(build_system(system).to_annotation())
    doc["degradedLinks"] = [{"gpu": g, "link": 5, "state": "down", "detail": "link inactive"} for g in gpus]
    links = doc["nvlink"]["links"]
    for g in gpus:
        peer = next(j for j in range(len(links)) if links[g][j] > 1 or (links[g][j] and not doc["nvlink"]["nvswitch"]))
        for j in range(len(links)) if doc["nvlink"]["nvswitch"] else [peer]:
            if links[g][j]:
                links[g][j] = links[j][g] = links[g][j] - 1
    return parse_topology(json.dumps(doc))


def req(gpus: int, **ann: str) -> object:
    return parse_pod_request({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()}, gpus)


VERDICTS = [
    # (id, node, gpus, annotations, code, reason, message)
    ("tp4-fits-nvswitch", node("dgx-h100"), 4, {}, Code.SUCCESS, None, ""),
    (
        "tp8-needs-clique-dgx1v",
        node("dgx-1v"),
        8,
        {},
        Code.UNRESOLVABLE,
        Reason.NO_NVLINK_DOMAIN,
        "fewer than 8 NVLink-connected GPUs",
    ),
    (
        "tp4-pcie-only",
        node("l40s-4"),
        4,
        {},
        Code.UNRESOLVABLE,
        Reason.NO_NVLINK_DOMAIN,
        "fewer than 4 NVLink-connected GPUs",
    ),
    ("too-few-gpus", node("hgx-a100-4"), 8, {}, Code.UNRESOLVABLE, Reason.TOO_FEW_GPUS, "fewer than 8 GPUs"),
    (
        "hbm-too-small",
        node("dgx-h100"),
        2,
        {"min_gpu_memory": "100Gi"},
        Code.UNRESOLVABLE,
        Reason.INSUFFICIENT_GPU_MEMORY,
        "fewer than 2 GPUs with 100Gi HBM",
    ),
    ("hbm-fits-h200", node("hgx-h200"), 2, {"min_gpu_memory": "100Gi"}, Code.SUCCESS, None, ""),
    (
        "no-free-clique-dgx1v",
        node("dgx-1v", in_use=(0, 4)),
        4,
        {},
        Code.UNSCHEDULABLE,
        Reason.NO_FREE_CLIQUE,
        "no free 4-GPU NVLink clique",
    ),
    (
        "not-enough-free",
        node("dgx-h100", in_use=(0, 1, 2, 3, 4)),
        4,
        {},
        Code.UNSCHEDULABLE,
        Reason.INSUFFICIENT_FREE_GPUS,
        "fewer than 4 free GPUs",
    ),
    (
        "no-infiniband-on-roce-node",
        node("a100-pcie-bridged"),
        2,
        {"network": "infiniband"},
        Code.UNRESOLVABLE,
        Reason.NO_NETWORK,
        "no active InfiniBand NIC",
    ),
    ("roce-accepted-as-rdma", node("a100-pcie-bridged"), 2, {"network": "rdma"}, Code.SUCCESS, None, ""),
    (
        "no-nics-at-all",
        node("rtx4090-8"),
        1,
        {"network": "rdma"},
        Code.UNRESOLVABLE,
        Reason.NO_NETWORK,
        "no active RDMA NIC",
    ),
    ("preferred-falls-back-on-pcie", node("l40s-4"), 4, {"nvlink": "preferred"}, Code.SUCCESS, None, ""),
    ("ignore-takes-pcie", node("rtx4090-8"), 8, {"nvlink": "ignore"}, Code.SUCCESS, None, ""),
    ("single-gpu-on-pcie", node("l40s-4"), 1, {}, Code.SUCCESS, None, ""),
    (
        "stale-topology",
        node("dgx-h100", problem=Reason.TOPOLOGY_STALE),
        1,
        {},
        Code.UNRESOLVABLE,
        Reason.TOPOLOGY_STALE,
        "GPU topology stale",
    ),
    (
        "missing-topology",
        node_state("bare", None),
        1,
        {},
        Code.UNRESOLVABLE,
        Reason.TOPOLOGY_MISSING,
        "GPU topology not reported",
    ),
    (
        "degraded-link-blocks-tp8",
        node_state("d", degraded("dgx-h100", 3)),
        8,
        {},
        Code.UNRESOLVABLE,
        Reason.NVLINK_DEGRADED,
        "NVLink degraded",
    ),
    ("degraded-link-avoided-for-tp4", node_state("d", degraded("dgx-h100", 3)), 4, {}, Code.SUCCESS, None, ""),
    (
        "degraded-link-in-each-dgx1v-quad",
        node_state("d", degraded("dgx-1v", 1, 5)),
        4,
        {},
        Code.UNRESOLVABLE,
        Reason.NVLINK_DEGRADED,
        "NVLink degraded",
    ),
    (
        "degraded-quad-busy-other-quad-waits",
        node_state("d", degraded("dgx-1v", 1), in_use=frozenset({4})),
        4,
        {},
        Code.UNSCHEDULABLE,
        Reason.NO_FREE_CLIQUE,
        "no free 4-GPU NVLink clique",
    ),
    ("zero-gpu-pod-fits", node("l40s-4"), 0, {}, Code.SUCCESS, None, ""),
]


@pytest.mark.parametrize(
    ("n", "gpus", "ann", "code", "reason", "msg"), [v[1:] for v in VERDICTS], ids=[v[0] for v in VERDICTS]
)
def test_node_verdict(
    n: NodeState, gpus: int, ann: dict[str, str], code: Code, reason: Reason | None, msg: str
) -> None:
    out = evaluate_node(n, req(gpus, **ann))  # type: ignore[arg-type]
    assert (out.code, out.reason, out.message) == (code, reason, msg), out.detail
    if code is Code.SUCCESS:
        assert len(out.gpus) == gpus
        assert 0.0 <= out.score <= 1.0


def test_failed_gpu_never_chosen() -> None:
    doc = json.loads(build_system("dgx-h100").to_annotation())
    doc["gpus"][0]["health"] = "failed"
    n = node_state("f", parse_topology(json.dumps(doc)))
    out = evaluate_node(n, req(1))  # type: ignore[arg-type]
    assert out.gpus == (1,)
    assert evaluate_node(n, req(8)).reason is Reason.TOO_FEW_HEALTHY_GPUS  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("system", "in_use", "k", "expected"),
    [
        pytest.param("dgx-1v", (), 4, (0, 1, 2, 3), id="dgx1v-tp4-takes-a-whole-quad"),
        pytest.param("dgx-1v", (0,), 4, (4, 5, 6, 7), id="dgx1v-tp4-uses-the-intact-quad"),
        pytest.param("dgx-1v", (), 2, (0, 3), id="dgx1v-tp2-prefers-nv2-inside-a-quad"),
        pytest.param("dgx-1v", (0, 3), 2, (1, 2), id="dgx1v-tp2-keeps-the-other-quad-whole"),
        pytest.param("a100-pcie-bridged", (0,), 2, (2, 3), id="bridged-tp2-takes-a-bridged-pair"),
        pytest.param("a100-pcie-bridged-nonadjacent", (1, 6), 2, (0, 5), id="bridged-pairs-need-not-be-adjacent"),
        pytest.param("a100-pcie-bridged-nonadjacent", (), 2, (1, 2), id="bridged-prefers-a-pair-on-one-numa-node"),
        pytest.param("dgx-h100", (0, 1, 4), 4, (2, 3, 5, 6), id="nvswitch-any-four"),
        pytest.param("a100-pcie-bridged", (0, 2), 2, (4, 5), id="bridged-avoids-splitting-pairs"),
    ],
)
def test_gpu_choice_prefers_strong_links_then_least_fragmentation(
    system: str, in_use: tuple[int, ...], k: int, expected: tuple[int, ...]
) -> None:
    assert evaluate_node(node(system, in_use=in_use), req(k)).gpus == expected  # type: ignore[arg-type]


def test_single_gpu_pod_leaves_a_broken_bridge_pair_rather_than_a_whole_one() -> None:
    out = evaluate_node(node("a100-pcie-bridged", in_use=(0,)), req(1))  # type: ignore[arg-type]
    assert out.gpus == (1,), "GPU 1's partner is busy, so taking it breaks no clique"


def test_single_gpu_pod_prefers_pcie_node_over_nvswitch_node() -> None:
    ranked = rank(evaluate_pod([node("dgx-h100", "h100"), node("l40s-4", "l40s")], req(1)))  # type: ignore[arg-type]
    assert ranked[0].name == "l40s"


def test_tp_pod_prefers_nvswitch_over_weaker_direct_links() -> None:
    ranked = rank(evaluate_pod([node("hgx-a100-4", "a100"), node("dgx-h100", "h100")], req(4)))  # type: ignore[arg-type]
    assert [v.name for v in ranked] == ["h100", "a100"]


def test_pod_packs_onto_partly_used_node_to_keep_whole_nodes_free() -> None:
    ranked = rank(evaluate_pod([node("dgx-h100", "empty"), node("dgx-h100", "half", in_use=(0, 1, 2, 3))], req(4)))  # type: ignore[arg-type]
    assert ranked[0].name == "half"


def test_min_memory_prefers_the_tightest_fitting_hbm() -> None:
    doc = json.loads(build_system("hgx-h200").to_annotation())
    for g in doc["gpus"]:
        g["memoryMiB"] = 190464  # the same box with 186 GB GPUs
    big = node_state("big", parse_topology(json.dumps(doc)))
    ranked = rank(evaluate_pod([big, node("hgx-h200", "h200")], req(2, min_gpu_memory="100Gi")))  # type: ignore[arg-type]
    assert ranked[0].name == "h200"


def test_degraded_node_scores_below_healthy_one() -> None:
    healthy = node("dgx-h100", "ok")
    bad = node_state("bad", degraded("dgx-h100", 3))
    ranked = rank(evaluate_pod([bad, healthy], req(4)))  # type: ignore[arg-type]
    assert ranked[0].name == "ok"
    assert 3 not in ranked[1].outcome.gpus


def test_preferred_fallback_scores_below_a_real_clique() -> None:
    r = req(4, nvlink="preferred")
    clique = evaluate_node(node("dgx-h100"), r)  # type: ignore[arg-type]
    pcie = evaluate_node(node("l40s-4"), r)  # type: ignore[arg-type]
    assert clique.components["clique"] == 1.0 and pcie.components["clique"] == 0.0
    assert pcie.score < clique.score


def test_equivalent_nodes_share_one_evaluation() -> None:
    nodes = [node("dgx-h100", f"n{i}") for i in range(50)]
    verdicts = evaluate_pod(nodes, req(4))  # type: ignore[arg-type]
    assert len({id(v.outcome) for v in verdicts}) == 1
    assert [v.name for v in verdicts] == [f"n{i}" for i in range(50)]


def test_rank_breaks_ties_by_name() -> None:
    nodes = [node("dgx-h100", n) for n in ("c", "a", "b")]
    assert [v.name for v in rank(evaluate_pod(nodes, req(2)))] == ["a", "b", "c"]  # type: ignore[arg-type]


def test_invalid_annotation_fails_every_node_identically() -> None:
    verdicts = fail_invalid([node("dgx-h100", "a"), node("l40s-4", "b")], 'invalid annotation gputopo.io/nvlink="x"')
    assert {v.outcome.code for v in verdicts} == {Code.UNRESOLVABLE}
    assert {v.outcome.message for v in verdicts} == {'invalid annotation gputopo.io/nvlink="x"'}


def test_failure_summary_matches_kube_scheduler_format() -> None:
    msgs = ["GPU topology stale"] * 20 + ["NVLink degraded"] * 4 + ["no free 4-GPU NVLink clique"] * 40
    assert summarize_failures(msgs, 64) == (
        "0/64 nodes are available: 20 GPU topology stale, 4 NVLink degraded, 40 no free 4-GPU NVLink clique."
    )


@pytest.mark.parametrize(
    ("score", "expected"),
    [(0.0, 0), (0.04, 0), (0.05, 0), (0.51, 5), (0.96, 10), (1.0, 10), (1.7, 10), (-1.0, 0), (float("nan"), 0)],
)
def test_grade_is_clamped_to_0_10(score: float, expected: int) -> None:
    assert grade(score) == expected


def test_grade_is_monotonic() -> None:
    values = [grade(i / 1000) for i in range(1001)]
    assert values == sorted(values)


def test_preferred_pod_falls_back_onto_degraded_gpus_with_a_lower_score() -> None:
    doc = json.loads(build_system("hgx-a100-4").to_annotation())
    doc["degradedLinks"] = [{"gpu": g, "link": 0, "state": "down", "detail": ""} for g in (0, 1)]
    doc["nvlink"]["links"][0][1] = doc["nvlink"]["links"][1][0] = 3
    n = node_state("d", parse_topology(json.dumps(doc)))
    preferred = evaluate_node(n, req(4, nvlink="preferred"))  # type: ignore[arg-type]
    assert preferred.code is Code.SUCCESS and preferred.components["health"] == 0.0
    assert evaluate_node(n, req(4)).reason is Reason.NVLINK_DEGRADED  # type: ignore[arg-type]
    assert evaluate_node(n, req(2, nvlink="preferred")).gpus == (2, 3)  # type: ignore[arg-type]
