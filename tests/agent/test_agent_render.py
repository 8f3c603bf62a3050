"""gputopo.render: the `nvidia-smi topo -m`-style view, checked against public captures."""

from __future__ import annotations

import pytest

from gputopo.model import DegradedLink, FabricState, GpuFabric, GpuInfo, Health, LinkState, NodeTopology
from gputopo.render import gpu_pair_cell, render_topology
from gputopo.systems import build_system

# topologies.md, `dgx-1v` (Oneflow-Inc/DLPerf capture), GPU block and the mlx5_0 column.
DGX1V_CAPTURE = """
GPU0     X   NV1  NV1  NV2  NV2  SYS  SYS  SYS  NODE
GPU1    NV1   X   NV2  NV1  SYS  NV2  SYS  SYS  NODE
GPU2    NV1  NV2   X   NV2  SYS  SYS  NV1  SYS  PIX
GPU3    NV2  NV1  NV2   X   SYS  SYS  SYS  NV1  PIX
GPU4    NV2  SYS  SYS  SYS   X   NV1  NV1  NV2  SYS
GPU5    SYS  NV2  SYS  SYS  NV1   X   NV2  NV1  SYS
GPU6    SYS  SYS  NV1  SYS  NV1  NV2   X   NV2  SYS
GPU7    SYS  SYS  SYS  NV1  NV2  NV1  NV2   X   SYS
"""

# topologies.md, `l40s-4` (warpem/miss-alignment #106), GPU block.
L40S_CAPTURE = """
GPU0     X   NODE SYS  SYS
GPU1    NODE  X   SYS  SYS
GPU2    SYS  SYS   X   NODE
GPU3    SYS  SYS  NODE  X
"""


def matrix_rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith("GPU") and "  " in line}


def test_dgx1v_matches_the_public_capture() -> None:
    rows = matrix_rows(render_topology(build_system("dgx-1v")))
    for gpu, cells in matrix_rows(DGX1V_CAPTURE).items():
        assert rows[gpu][:8] == cells[:8], gpu  # GPU block
        assert rows[gpu][8] == cells[8], gpu  # NIC0 = mlx5_0


def test_l40s_pcie_only_cells_from_numa() -> None:
    rows = matrix_rows(render_topology(build_system("l40s-4")))
    for gpu, cells in matrix_rows(L40S_CAPTURE).items():
        assert rows[gpu][:4] == cells
    assert "NVLink: none (PCIe only)" in render_topology(build_system("l40s-4"))


def test_header_lists_gpus_nics_and_numa() -> None:
    text = render_topology(build_system("dgx-h100"))
    header = text.splitlines()[0].split()
    assert header[:8] == [f"GPU{i}" for i in range(8)]
    assert header[8:16] == [f"NIC{k}" for k in range(8)]
    assert header[16:] == ["NUMA", "Affinity"]
    assert "NIC6: mlx5_10 (InfiniBand, 400 Gb/s, ACTIVE, NUMA 1, 0000:ce:00.0)" in text
    assert matrix_rows(text)["GPU5"][-1] == "1"


def test_unknown_numa_renders_sys() -> None:
    topo = NodeTopology(
        gpus=(
            GpuInfo(index=0, uuid="a", model="m", memory_mib=1),
            GpuInfo(index=1, uuid="b", model="m", memory_mib=1),
        )
    )
    assert gpu_pair_cell(topo, 0, 1) == "SYS"
    assert matrix_rows(render_topology(topo))["GPU0"] == ["X", "SYS", "N/A"]


def test_health_lines_for_degraded_links_gpus_usage_and_fabric() -> None:
    base = build_system("gb200-tray")
    gpus = list(base.gpus)
    gpus[1] = gpus[1].model_copy(update={"health": Health.DEGRADED, "reasons": ("NVLink link 4 down",)})
    topo = base.model_copy(
        update={
            "gpus": tuple(gpus),
            "degraded_links": (DegradedLink(gpu=1, link=4, state=LinkState.DOWN, detail="link not active"),),
        }
    )
    text = render_topology(topo, {3, 0})
    assert "Degraded link: GPU1 link 4 down (link not active)" in text
    assert "GPU1 degraded: NVLink link 4 down" in text
    assert "GPUs in use: 0, 3" in text
    assert "Fabric clique: 9c6f5af3-53bf-49b5-a436-b66766c413c3.4026" in text
    assert "NVLink: generation 5, 50 GB/s per link, via NVSwitch" in text
    assert "Health: all GPUs ok" not in text


@pytest.mark.parametrize(
    ("in_use", "line"),
    [
        pytest.param(set(), "GPUs in use: none", id="empty set says none"),
        pytest.param(None, None, id="unknown: no line"),
    ],
)
def test_in_use_line(in_use: set[int] | None, line: str | None) -> None:
    text = render_topology(build_system("rtx4090-8"), in_use)
    assert "Health: all GPUs ok, no degraded links" in text
    if line is None:
        assert "GPUs in use" not in text
    else:
        assert line in text


def _fabric_in_progress(system: str, gpu: int) -> NodeTopology:
    topo = build_system(system)
    gpus = list(topo.gpus)
    gpus[gpu] = gpus[gpu].model_copy(update={"fabric": GpuFabric(state=FabricState.IN_PROGRESS)})
    return topo.model_copy(update={"gpus": tuple(gpus)})


@pytest.mark.parametrize(
    ("topology", "gpu_line", "tray_line"),
    [
        pytest.param(build_system("gb200-tray"), "GPU2: NVIDIA GB200, 189471 MiB, 0018:01:00.0, NVLink fabric healthy",
                     "NVLink fabric: healthy", id="healthy tray"),
        pytest.param(build_system("gb200-tray-degraded"),
                     "GPU2: NVIDIA GB200, 189471 MiB, 0018:01:00.0, NVLink fabric degraded "
                     "(healthMask 0xa9: degraded bandwidth)",
                     "NVLink fabric: degraded (GPU 2: healthMask 0xa9: degraded bandwidth)", id="degraded GPU 2"),
        pytest.param(_fabric_in_progress("gb200-tray", 1),
                     "GPU1: NVIDIA GB200, 189471 MiB, 0009:01:00.0, NVLink fabric unknown "
                     "(fabric registration in-progress)",
                     "NVLink fabric: unknown (GPU 1: fabric registration in-progress)", id="one GPU still registering"),
        pytest.param(build_system("dgx-h100"), "GPU2: NVIDIA H100 80GB HBM3, 81559 MiB, 0000:52:00.0", None,
                     id="no fabric info: no fabric lines"),
    ],
)  # fmt: skip
def test_fabric_health_per_gpu_and_per_tray(topology: NodeTopology, gpu_line: str, tray_line: str | None) -> None:
    lines = render_topology(topology).splitlines()
    assert gpu_line in lines
    if tray_line is None:
        assert not any("NVLink fabric" in line for line in lines)
    else:
        assert tray_line in lines
