"""Predicted communication times: the model's figures against published nccl-tests results, the
message-size annotation, the estimate in the placement sentence and annotation, and the simulator."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gputopo.engine.cluster.explain import Seat, outcome_estimate, placement_estimate, placement_sentence, runner_up
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupPlan
from gputopo.engine.network.cost import (
    allreduce_seconds,
    format_bytes,
    format_ms,
    intra_node_bandwidth,
    tier_share,
    tiers_crossed,
)
from gputopo.engine.network.estimate import group_allreduce_seconds, stage_transfer_seconds, widest_crossing
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.snapshot import NodeState, node_state, shape_of
from gputopo.model import (
    AnnotationError,
    CommEstimate,
    Placement,
    parse_placement,
    parse_pod_request,
)
from gputopo.sim import Measures, simulate
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS, Tier, TierConfig
from tests.engine.gang.test_groups import TWO_SPINES, cluster, members
from tests.engine.node.test_placement import node
from tests.paths import REPO
from tests.sim.helpers import job

GIB = 1 << 30
DOCS = REPO / "docs" / "cost-model.md"


# --------------------------------------------------------------------------------------------------
# The calibration table of docs/cost-model.md


def _intra(system: str, gpus: tuple[int, ...]) -> float:
    s = shape_of(build_system(system))
    return intra_node_bandwidth(s.links, s.nvswitch, s.gbps_per_link, s.numa, gpus).gbps


def _across(system: str, nodes: int, gpus: int, nics: int) -> float:
    """Bus bandwidth of the model's all-reduce across `nodes` members under one leaf, each with `gpus`
    GPUs on a node keeping its first `nics` NICs: backed out of the time of a huge message."""
    topo = build_system(system)
    topo = topo.model_copy(update={"nics": topo.nics[:nics]})
    labels = {"gputopo.io/network-spine": "s", "gputopo.io/network-leaf": "l"}
    states = [node_state(f"n{i}", topo, labels=labels) for i in range(nodes)]
    size = float(1 << 50)  # latency vanishes next to it
    t = group_allreduce_seconds([(s, tuple(range(gpus))) for s in states], size)
    return 2 * (nodes - 1) / nodes * size / t / 1e9


# (label as in the docs table, published GB/s, model GB/s)
CALIBRATION = [
    pytest.param("8x H100 NVSwitch (NV18), `NCCL_ALGO=RING`", 370, _intra("dgx-h100", tuple(range(8))), id="h100-ring"),
    pytest.param("8x H100 NVSwitch, default (NVLink SHARP)", 476, _intra("dgx-h100", tuple(range(8))), id="h100-nvls"),
    pytest.param("8x H200 NVSwitch, default (NVLink SHARP)", 475, _intra("hgx-h200", tuple(range(8))), id="h200-nvls"),
    pytest.param("8x A100 NVSwitch (NV12)", 232.5, _intra("dgx-a100", tuple(range(8))), id="a100-nvswitch"),
    pytest.param(
        "A100 PCIe pair on NVLink bridges (NV12)", 208, _intra("a100-pcie-bridged", (0, 1)), id="a100-bridged"
    ),
    pytest.param("A100 PCIe ring through a SYS hop", 20, _intra("l40s-4", (0, 2)), id="pcie-sys-hop"),
    pytest.param(
        "8x PCIe-only GPUs, two sockets (RTX 5090, PCIe Gen5)", 28, _intra("rtx4090-8", tuple(range(8))), id="pcie-8"
    ),
    pytest.param("InfiniBand NDR 400 Gb/s, per NIC", 47, _across("dgx-h100", 2, 1, 1), id="ndr-per-nic"),
    pytest.param("2 nodes x 1 H100, 4 NDR NICs (Tree)", 50, _across("dgx-h100", 2, 1, 4), id="ndr-one-rail-per-gpu"),
    pytest.param("3 nodes x 8 A100, 4 HDR 200 Gb/s NICs each", 96, _across("dgx-a100", 3, 8, 4), id="hdr-3-nodes"),
    pytest.param("2 nodes x 8 A100, 4 HDR 200 Gb/s NICs each", 86, _across("dgx-a100", 2, 8, 4), id="hdr-2-nodes"),
]


@pytest.mark.parametrize(("label", "published", "model"), CALIBRATION)
def test_calibration_table_in_the_docs_matches_the_model(label: str, published: float, model: float) -> None:
    row = next((line for line in DOCS.read_text().splitlines() if line.startswith(f"| {label} |")), None)
    assert row is not None, f"docs/cost-model.md has no row {label!r}"
    assert f"{model:.1f} GB/s" in row
    error = (model - published) / published * 100
    assert f"{error:+.1f}%" in row or (abs(error) < 0.05 and "0% (anchor)" in row)


@pytest.mark.parametrize(
    ("label", "published", "model"), [p for p in CALIBRATION if p.id in ("h100-ring", "a100-nvswitch", "hdr-3-nodes")]
)
def test_model_is_within_ten_percent_where_nccl_runs_a_ring(label: str, published: float, model: float) -> None:
    assert abs(model - published) / published < 0.10, label


# --------------------------------------------------------------------------------------------------
# Formulas


@pytest.mark.parametrize(
    ("crossed", "oversubscription", "share"),
    [
        pytest.param(0, (1.0, 2.0), 1.0, id="same-node"),
        pytest.param(1, (4.0, 2.0), 1.0, id="same-leaf-uses-no-uplink"),
        pytest.param(2, (4.0, 2.0), 0.25, id="across-leaves-leaf-uplinks"),
        pytest.param(3, (4.0, 2.0), 0.125, id="across-spines-both-uplinks"),
        pytest.param(4, (2.0,), 0.5, id="tiers-past-the-configured-count-as-1-to-1"),
    ],
)
def test_tier_share_divides_by_every_uplink_climbed(
    crossed: int, oversubscription: tuple[float, ...], share: float
) -> None:
    assert tier_share(crossed, oversubscription) == pytest.approx(share)


@pytest.mark.parametrize(
    ("size", "ranks", "busbw", "step", "seconds"),
    [
        pytest.param(GIB, 8, 369.0, 3e-6, 2 * 7 / 8 * GIB / 369e9 + 14 * 3e-6, id="h100-8-1GiB"),
        pytest.param(GIB, 2, 246.0, 3e-6, GIB / 246e9 + 2 * 3e-6, id="pair-1GiB"),
        pytest.param(8, 8, 369.0, 3e-6, 14 * 3e-6 + 2 * 7 / 8 * 8 / 369e9, id="latency-dominates-8-bytes"),
        pytest.param(GIB, 1, 369.0, 3e-6, 0.0, id="one-rank-moves-nothing"),
    ],
)
def test_ring_allreduce_time(size: int, ranks: int, busbw: float, step: float, seconds: float) -> None:
    assert allreduce_seconds(size, ranks, busbw, step) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "text"),
    [(GIB, "1 GiB"), (1.5 * GIB, "1.5 GiB"), (256 << 20, "256 MiB"), (1 << 40, "1 TiB"), (100, "100 B")],
)
def test_format_bytes(value: float, text: str) -> None:
    assert format_bytes(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.0051, "5.1 ms"), (0.245, "245 ms"), (4.2e-5, "0.042 ms"), (0.0197, "19.7 ms")]
)
def test_format_ms(seconds: float, text: str) -> None:
    assert format_ms(seconds) == text


def _spine_tiers(spine: float, leaf: float) -> TierConfig:
    return TierConfig(
        tiers=(
            Tier(name="spine", labels=("gputopo.io/network-spine",), oversubscription=spine),
            Tier(name="leaf", labels=("gputopo.io/network-leaf",), oversubscription=leaf),
        )
    )


def test_stage_transfer_follows_the_configured_oversubscription() -> None:
    nodes = {n.name: n for n in cluster(TWO_SPINES)}
    same_leaf = stage_transfer_seconds(nodes["a1"], (0,), nodes["a2"], (0,), GIB)
    across_spines = stage_transfer_seconds(nodes["a1"], (0,), nodes["b1"], (0,), GIB)
    non_blocking = stage_transfer_seconds(nodes["a1"], (0,), nodes["b1"], (0,), GIB, _spine_tiers(1.0, 1.0))
    three_to_one = stage_transfer_seconds(nodes["a1"], (0,), nodes["b1"], (0,), GIB, _spine_tiers(3.0, 1.0))
    assert same_leaf == pytest.approx(GIB / 47e9 + 1.5e-6)
    assert across_spines == pytest.approx(2 * GIB / 47e9 + 5 * 1.5e-6)  # default spine 2:1
    assert non_blocking == pytest.approx(GIB / 47e9 + 5 * 1.5e-6)
    assert three_to_one == pytest.approx(3 * GIB / 47e9 + 5 * 1.5e-6)


@pytest.mark.parametrize(
    ("names", "crossed"),
    [
        pytest.param(("a1", "a2"), 1, id="one-leaf"),
        pytest.param(("a1", "a2", "a3"), 2, id="two-leaves-one-spine"),
        pytest.param(("a1", "b1"), 3, id="two-spines-same-leaf-name"),
        pytest.param(("a3", "a4", "a5", "b2"), 3, id="one-node-on-another-spine"),
    ],
)
def test_widest_crossing_is_the_largest_pairwise_crossing(names: tuple[str, ...], crossed: int) -> None:
    nodes = {n.name: n for n in cluster(TWO_SPINES)}
    chosen = [nodes[n] for n in names]
    net = DEFAULT_TIERS.network_tiers()
    pairwise = max(tiers_crossed(dict(a.location), dict(b.location), net) for a in chosen for b in chosen if a is not b)
    assert widest_crossing(chosen, net) == pairwise == crossed


def test_default_tiers_assume_non_blocking_leaves_and_two_to_one_spines() -> None:
    assert DEFAULT_TIERS.narrow_first_oversubscription() == (1.0, 2.0)


# --------------------------------------------------------------------------------------------------
# gputopo.io/message-size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(None, GIB, id="default-1Gi"),
        pytest.param("256Mi", 256 << 20, id="binary-suffix"),
        pytest.param("1G", 10**9, id="decimal-suffix"),
        pytest.param("1e6", 10**6, id="exponent"),
        pytest.param("1Ti", 1 << 40, id="upper-bound"),
        pytest.param("1", 1, id="lower-bound"),
    ],
)
def test_message_size_annotation_is_a_quantity_in_bytes(value: str | None, expected: int) -> None:
    ann = {} if value is None else {"gputopo.io/message-size": value}
    assert parse_pod_request(ann, 4).message_bytes == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param("0", "between 1 byte and 1Ti", id="zero"),
        pytest.param("2Ti", "between 1 byte and 1Ti", id="above-1Ti"),
        pytest.param("-1Gi", "must not be negative", id="negative"),
        pytest.param("lots", "not a Kubernetes quantity", id="not-a-quantity"),
        pytest.param("1" * 80, "longer than", id="too-long"),
    ],
)
def test_bad_message_size_names_the_annotation(value: str, why: str) -> None:
    with pytest.raises(AnnotationError) as e:
        parse_pod_request({"gputopo.io/message-size": value}, 4)
    assert "gputopo.io/message-size" in str(e.value)
    assert why in str(e.value)


# --------------------------------------------------------------------------------------------------
# The sentence and the annotation


def _ranked(nodes: list[NodeState], gpus: int, **ann: str) -> list:  # type: ignore[type-arg]
    req = parse_pod_request({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()}, gpus)
    return rank(evaluate_pod(nodes, req))


def test_sentence_ends_with_the_allreduce_estimate_and_the_runner_ups() -> None:
    ranked = _ranked([node("dgx-h100", "gpu-07", in_use=(4, 5, 6, 7)), node("dgx-1v", "gpu-09", in_use=(0,))], 4)
    win = ranked[0]
    text = placement_sentence(win.name, win.outcome, runner_up(win.name, ranked))
    assert text.endswith("; est. 1 GiB all-reduce 4.4 ms (runner-up 19.7 ms)")


@pytest.mark.parametrize(
    ("size", "clause"),
    [
        pytest.param("256Mi", "est. 256 MiB all-reduce 1.1 ms", id="quarter-size-quarter-time"),
        pytest.param("4Gi", "est. 4 GiB all-reduce 17.5 ms", id="four-times-the-size"),
        pytest.param("8", "est. 8 B all-reduce 0.018 ms", id="latency-only"),
    ],
)
def test_estimate_follows_the_message_size(size: str, clause: str) -> None:
    ranked = _ranked([node("dgx-h100", "gpu-07", in_use=(4, 5, 6, 7))], 4, message_size=size)
    assert placement_sentence(ranked[0].name, ranked[0].outcome, None).endswith(clause)


def test_single_gpu_pod_has_no_estimate() -> None:
    ranked = _ranked([node("dgx-h100", "a"), node("dgx-h100", "b", in_use=(0,))], 1)
    assert placement_estimate(ranked[0].outcome, ranked[1]) is None
    assert "est." not in placement_sentence(ranked[0].name, ranked[0].outcome, ranked[1])


@pytest.mark.parametrize(
    ("system", "gpus", "words"),
    [
        pytest.param("dgx-h100", 4, "; est. 1 GiB all-reduce 4.4 ms", id="nvswitch-quad"),
        pytest.param("l40s-4", 4, "; est. 1 GiB all-reduce 80.6 ms", id="pcie-across-sockets"),
        pytest.param("dgx-h100", 1, "", id="one-gpu-says-nothing"),
    ],
)
def test_explain_rows_carry_each_nodes_own_estimate(system: str, gpus: int, words: str) -> None:
    ranked = _ranked([node(system, "x")], gpus, nvlink="preferred")
    assert outcome_estimate(ranked[0].outcome) == words


def test_placement_annotation_carries_the_estimate_and_reads_back() -> None:
    ranked = _ranked([node("dgx-h100", "gpu-07", in_use=(4, 5, 6, 7)), node("dgx-1v", "gpu-09", in_use=(0,))], 4)
    est = placement_estimate(ranked[0].outcome, ranked[1])
    assert est is not None
    # 4 GPUs at NV18 x 25 GB/s x 0.82 = 369 GB/s; the runner-up's DGX-1V quad: 4 direct links per GPU
    # inside the set (NV1 + NV1 + NV2), 82 GB/s.
    assert est.message_bytes == GIB
    assert est.all_reduce_ms == pytest.approx((1.5 * GIB / 369e9 + 6 * 3e-6) * 1e3, abs=1e-4)
    assert est.runner_up_all_reduce_ms == pytest.approx((1.5 * GIB / 82e9 + 6 * 3e-6) * 1e3, abs=1e-4)
    p = Placement(node="gpu-07", gpus=(0, 1, 2, 3), score=10, reason="r", estimate=est)
    text = p.to_annotation()
    assert '"estimate":{"messageBytes":1073741824,"allReduceMs":4.3828,"runnerUpAllReduceMs":19.6596}' in text
    assert parse_placement(text) == p


@pytest.mark.parametrize(
    "estimate",
    [
        pytest.param({"messageBytes": 0}, id="empty-message"),
        pytest.param({"messageBytes": 1, "allReduceMs": -1}, id="negative-time"),
        pytest.param({"messageBytes": 1, "allReduceMs": "Infinity"}, id="infinite-time"),
    ],
)
def test_placement_estimate_rejects_impossible_values(estimate: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CommEstimate.model_validate(estimate)


def _pp_plan(size: int = 5, tiers: TierConfig = DEFAULT_TIERS) -> GroupPlan:
    plan = plan_group("pp", members(size), cluster(TWO_SPINES), tiers)
    assert isinstance(plan, GroupPlan)
    return plan


def test_group_member_sentence_adds_stage_transfer_and_group_allreduce() -> None:
    plan = _pp_plan()
    a = plan.assignments[1]
    text = placement_sentence(a.node.name, a.outcome, None, Seat(plan, a.member))
    # Stage 1 (a2, leaf-1) sends to stage 2 (a3, leaf-2) through the non-blocking leaf uplinks: one NDR
    # NIC, 47 GB/s. The ring over 5 members stays under spine-a: 8 NDR rails each, 376 GB/s.
    assert text.endswith("; est. 1 GiB all-reduce 5.1 ms, stage transfer 22.9 ms, all-reduce across 5 members 4.6 ms")


def test_group_spanning_spines_pays_the_spine_oversubscription() -> None:
    plan = _pp_plan(6)  # spine-a holds 5 nodes
    assert {a.node.location["spine"] for a in plan.assignments} == {"spine-a", "spine-b"}
    by_default = [placement_estimate(a.outcome, None, plan, a.member) for a in plan.assignments]
    flat = [placement_estimate(a.outcome, None, plan, a.member, _spine_tiers(1.0, 1.0)) for a in plan.assignments]
    ring = {e.group_all_reduce_ms for e in by_default if e is not None}
    flat_ring = {e.group_all_reduce_ms for e in flat if e is not None}
    assert len(ring) == len(flat_ring) == 1  # one ring: every member reports the same
    assert ring.pop() > 1.9 * flat_ring.pop()  # type: ignore[operator]


# --------------------------------------------------------------------------------------------------
# The simulator


def test_simulator_reasons_carry_the_estimates() -> None:
    nodes = cluster(TWO_SPINES)
    jobs = [job("tp4", 4, message_size="512Mi"), job("pp", 8, pods=2, group="pp", group_size="2")]
    placed = {p.pod: p.reason for p in simulate(nodes, jobs, "gputopo", measures=Measures(exhaustive=False)).placements}
    assert "est. 512 MiB all-reduce 2.2 ms (runner-up 2.2 ms)" in placed["tp4-0"]
    assert "est. 1 GiB all-reduce 5.1 ms, stage transfer 22.8 ms, all-reduce across 2 members" in placed["pp-0"]
