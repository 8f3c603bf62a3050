"""Every named real system matches the public facts about the real box (nvidia-smi, NCCL captures)."""

from __future__ import annotations

import pytest

from gputopo.agent.labels import node_labels
from gputopo.engine.placement import evaluate_node
from gputopo.engine.reasons import Code, Reason
from gputopo.engine.snapshot import node_state
from gputopo.model import LinkLayer, PcieDistance, parse_pod_request
from gputopo.systems import GB200_CLIQUE, SYSTEMS, UnknownSystemError, build_system

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
