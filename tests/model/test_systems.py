"""Every named real system matches the public facts about the real box (nvidia-smi, NCCL captures)."""

from __future__ import annotations

import pytest

from gputopo.agent.labels import node_labels
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.reasons import Code, Reason
from gputopo.engine.state.snapshot import node_state
from gputopo.localcluster.nodes import GpuNode
from gputopo.model import HEALTHY_MASK, FabricHealth, FabricState, Health, LinkLayer, PcieDistance, parse_pod_request
from gputopo.model.fabric import decode_health, tray_health
from gputopo.systems import (
    GB200_CLIQUE,
    GB300_CLIQUE,
    RACKS,
    SYSTEMS,
    TRAYS_PER_RACK,
    UnknownSystemError,
    build_rack,
    build_system,
    rack_clique,
)

DGX1V_LINKS = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
]


def uniform(n: int, v: int) -> list[list[int]]:
    return [[0 if i == j else v for j in range(n)] for i in range(n)]


def pairs(n: int, ps: list[tuple[int, int]], v: int) -> list[list[int]]:
    m = [[0] * n for _ in range(n)]
    for a, b in ps:
        m[a][b] = m[b][a] = v
    return m


# name, GPU count, model substring, HBM MiB, links, nvswitch, largest clique, NIC count, NIC layer, NIC rate
CASES = [
    ("dgx-1v", 8, "V100", 32510, DGX1V_LINKS, False, 4, 4, LinkLayer.INFINIBAND, 100),
    ("dgx-a100", 8, "A100-SXM4-80GB", 81920, uniform(8, 12), True, 8, 8, LinkLayer.INFINIBAND, 200),
    ("dgx-h100", 8, "H100 80GB", 81559, uniform(8, 18), True, 8, 8, LinkLayer.INFINIBAND, 400),
    ("hgx-h200", 8, "H200", 143771, uniform(8, 18), True, 8, 8, LinkLayer.INFINIBAND, 400),
    ("hgx-a100-4", 4, "A100-SXM4-80GB", 81920, uniform(4, 4), False, 4, 4, LinkLayer.INFINIBAND, 200),
    (
        "a100-pcie-bridged",
        8,
        "A100 80GB PCIe",
        81920,
        pairs(8, [(0, 1), (2, 3), (4, 5), (6, 7)], 12),
        False,
        2,
        2,
        LinkLayer.ETHERNET,
        100,
    ),
    ("l40s-4", 4, "L40S", 46068, uniform(4, 0), False, 1, 2, LinkLayer.ETHERNET, 100),
    ("rtx4090-8", 8, "RTX 4090", 24564, uniform(8, 0), False, 1, 0, None, 0),
    ("gb200-tray", 4, "GB200", 189471, uniform(4, 18), True, 4, 4, LinkLayer.INFINIBAND, 400),
    ("gb300-tray", 4, "GB300", 287775, uniform(4, 18), True, 4, 4, LinkLayer.INFINIBAND, 800),
]


@pytest.mark.parametrize(
    ("name", "count", "model", "mib", "links", "nvswitch", "clique", "nics", "layer", "rate"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_named_system_matches_public_facts(
    name: str,
    count: int,
    model: str,
    mib: int,
    links: list[list[int]],
    nvswitch: bool,
    clique: int,
    nics: int,
    layer: LinkLayer | None,
    rate: int,
) -> None:
    t = build_system(name, "n1")
    assert len(t.gpus) == count
    assert all(model in g.model and g.memory_mib == mib for g in t.gpus)
    assert [list(r) for r in t.nvlink.links] == links
    assert t.nvlink.nvswitch is nvswitch
    labels = node_labels(t)
    assert labels["gputopo.io/nvlink-domain"] == str(clique)
    assert labels["gputopo.io/nvswitch"] == str(nvswitch).lower()
    assert len(t.nics) == nics
    assert all(n.link_layer is layer and n.rate_gbps == rate and len(n.gpu_affinity) == count for n in t.nics)


def test_every_named_system_is_covered() -> None:
    assert {c[0] for c in CASES} == set(SYSTEMS)


@pytest.mark.parametrize(
    ("name", "gib"),
    [("dgx-a100", "80"), ("dgx-h100", "80"), ("hgx-h200", "140"), ("l40s-4", "45"), ("rtx4090-8", "24")],
)
def test_seed_gpu_types_publish_their_hbm_label(name: str, gib: str) -> None:
    assert node_labels(build_system(name))["gputopo.io/gpu-memory-gib"] == gib


@pytest.mark.parametrize(
    ("system", "marketed", "reported"),
    [
        pytest.param("dgx-1v", "32Gi", "32510Mi", id="V100-SXM2-32GB reports 32510 MiB, not 32 GiB"),
        pytest.param("gb200-tray", "186Gi", "189471Mi", id="GB200 186GB reports 189471 MiB, not 186 GiB"),
        pytest.param("gb300-tray", "288Gi", "287775Mi", id="GB300 288GB reports less than 288 GiB"),
    ],
)
def test_marketed_hbm_size_does_not_fit_but_the_reported_one_does(system: str, marketed: str, reported: str) -> None:
    # A pod written from the spec sheet would be placed on the fixture and then fail on the real GPU.
    node = node_state(system, build_system(system))
    refused = evaluate_node(node, parse_pod_request({"gputopo.io/min-gpu-memory": marketed}, 1))
    fits = evaluate_node(node, parse_pod_request({"gputopo.io/min-gpu-memory": reported}, 1))
    assert (refused.code, refused.reason) == (Code.UNRESOLVABLE, Reason.INSUFFICIENT_GPU_MEMORY)
    assert fits.code is Code.SUCCESS


def test_dgx_h100_has_one_pix_nic_per_gpu_and_node_within_the_socket() -> None:
    t = build_system("dgx-h100")
    for g in range(8):
        pix = [n.name for n in t.nics if n.gpu_affinity[g] is PcieDistance.PIX]
        assert len(pix) == 1
    nic0 = t.nics[0]
    assert nic0.name == "mlx5_0"
    assert list(nic0.gpu_affinity) == ["PIX", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]


def test_sys_nic_variant_reports_sys_for_same_socket_nics() -> None:
    t = build_system("dgx-h100-sys-nics")
    assert list(t.nics[0].gpu_affinity) == ["PIX", "SYS", "SYS", "SYS", "SYS", "SYS", "SYS", "SYS"]


def test_dgx_1v_first_nic_is_pix_to_gpus_2_and_3_as_captured() -> None:
    nic = build_system("dgx-1v").nics[0]
    assert list(nic.gpu_affinity) == ["NODE", "NODE", "PIX", "PIX", "SYS", "SYS", "SYS", "SYS"]


def test_non_adjacent_bridge_variant_pairs_0_5() -> None:
    t = build_system("a100-pcie-bridged-nonadjacent")
    assert t.nvlink.links[0][5] == 12 and t.nvlink.links[0][1] == 0


def test_gb200_tray_publishes_its_fabric_clique_and_grace_pci_domains() -> None:
    t = build_system("gb200-tray")
    assert t.fabric is not None and t.fabric.clique == GB200_CLIQUE
    assert t.gpus[2].pci_bus_id == "0018:01:00.0"


def test_gpu_uuids_differ_between_nodes_of_one_system() -> None:
    assert build_system("dgx-h100", "a").gpus[0].uuid != build_system("dgx-h100", "b").gpus[0].uuid


def test_unknown_system_names_the_known_ones() -> None:
    with pytest.raises(UnknownSystemError, match="dgx-h100"):
        build_system("dgx-9000")


@pytest.mark.parametrize("system", ["gb200-tray", "gb300-tray"])
def test_a_healthy_tray_publishes_every_gpu_fabric_registered_and_healthy(system: str) -> None:
    t = build_system(system, "n1")
    for g in t.gpus:
        assert g.fabric is not None
        assert (g.fabric.state, g.fabric.status, g.fabric.health_mask) == (FabricState.COMPLETED, 0, HEALTHY_MASK)
        assert decode_health(g.fabric) == (FabricHealth.HEALTHY, "")
    assert tray_health(t.gpus) == (FabricHealth.HEALTHY, "")
    assert all(g.health is Health.OK for g in t.gpus)


@pytest.mark.parametrize("system", ["gb200-tray-degraded", "gb300-tray-degraded"])
def test_the_degraded_tray_variant_reports_gpu_2_with_degraded_fabric_bandwidth(system: str) -> None:
    t = build_system(system, "r1-tray-01")
    assert [g.fabric.health_mask for g in t.gpus if g.fabric is not None] == [0xAA, 0xAA, 0xA9, 0xAA]
    assert tray_health(t.gpus) == (FabricHealth.DEGRADED, "GPU 2: healthMask 0xa9: degraded bandwidth")
    assert [g.health for g in t.gpus] == [Health.OK, Health.OK, Health.DEGRADED, Health.OK]
    assert t.gpus[2].reasons == ("NVLink fabric degraded: healthMask 0xa9: degraded bandwidth",)
    assert t.fabric is not None and t.fabric.clique == rack_clique("r1")


@pytest.mark.parametrize(
    ("system", "node", "clique"),
    [
        pytest.param("gb200-tray", "r7-tray-05", rack_clique("r7"), id="gb200 tray of rack r7"),
        pytest.param("gb300-tray", "r7-tray-18", rack_clique("r7"), id="gb300 tray of rack r7"),
        pytest.param("gb200-tray", "west.r-2-tray-01", rack_clique("west.r-2"), id="rack names may hold dashes"),
        pytest.param("gb200-tray", "gb200-tray", GB200_CLIQUE, id="gb200 outside any rack: the captured domain"),
        pytest.param("gb200-tray", "r7-tray-5", GB200_CLIQUE, id="one digit is not a tray number"),
        pytest.param("gb300-tray", "tray-01", GB300_CLIQUE, id="no rack name before -tray-"),
    ],
)
def test_a_tray_takes_its_rack_clique_from_the_node_name(system: str, node: str, clique: str) -> None:
    t = build_system(system, node)
    assert t.fabric is not None and t.fabric.clique == clique


def test_an_e2e_gpu_node_of_a_tray_fixture_gets_its_rack_clique() -> None:
    # The agent's fixture backend builds build_system(fixture, node name), as GpuNode.resolved() does.
    t = GpuNode(name="rack-b-tray-03", fixture="gb200-tray").resolved()
    assert t.fabric is not None and t.fabric.clique == rack_clique("rack-b")


@pytest.mark.parametrize(("name", "model"), [("gb200-nvl72", "NVIDIA GB200"), ("gb300-nvl72", "NVIDIA GB300")])
def test_a_named_rack_is_18_trays_of_4_gpus_in_one_nvlink_domain(name: str, model: str) -> None:
    trays = build_rack(name, "r1")
    assert [node for node, _ in trays] == [f"r1-tray-{i:02d}" for i in range(1, 19)]
    assert len(trays) == TRAYS_PER_RACK == RACKS[name].trays
    assert {t.fabric.clique for _, t in trays if t.fabric is not None} == {rack_clique("r1")}
    assert sum(len(t.gpus) for _, t in trays) == 72
    assert all(g.model == model for _, t in trays for g in t.gpus)
    assert len({g.uuid for _, t in trays for g in t.gpus}) == 72


def test_two_racks_are_two_nvlink_domains_and_degraded_trays_are_the_named_ones() -> None:
    a = build_rack("gb200-nvl72", "a", trays=16, degraded=[2, 16])
    b = build_rack("gb200-nvl72", "b")
    assert len(a) == 16
    domains = {t.fabric.clique for _, t in a + b if t.fabric is not None}
    assert domains == {rack_clique("a"), rack_clique("b")} and len(domains) == 2
    degraded = [node for node, t in a + b if tray_health(t.gpus)[0] is FabricHealth.DEGRADED]
    assert degraded == ["a-tray-02", "a-tray-16"]


@pytest.mark.parametrize(
    ("name", "trays", "degraded", "error", "match"),
    [
        pytest.param("gb100-nvl36", None, [], UnknownSystemError, "gb200-nvl72, gb300-nvl72", id="unknown rack"),
        pytest.param("gb200-nvl72", 0, [], ValueError, "a gb200-nvl72 rack holds 1 to 18 trays, not 0", id="none"),
        pytest.param("gb300-nvl72", 19, [], ValueError, "holds 1 to 18 trays, not 19", id="too many trays"),
        pytest.param(
            "gb200-nvl72",
            4,
            [5],
            ValueError,
            r"degraded trays \[5\] are not among",
            id="degraded outside",
        ),
    ],
)
def test_bad_rack_arguments_name_the_argument(
    name: str, trays: int | None, degraded: list[int], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build_rack(name, "r1", trays, degraded)
