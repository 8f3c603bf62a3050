"""RDMA NIC discovery and PCIe distances from sysfs fixture trees built in tmp_path."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from gputopo.agent.sysfs import (
    PciPath,
    parse_pci_path,
    parse_port_state,
    parse_rate_gbps,
    pcie_distance,
    read_nics,
)
from gputopo.model import LinkLayer, PcieDistance

P, X, B, N, S = PcieDistance.PIX, PcieDistance.PXB, PcieDistance.PHB, PcieDistance.NODE, PcieDistance.SYS


def add_pci(root: Path, chain: Sequence[str], numa: int | None) -> Path:
    """Create `devices/<root complex>/<bridges…>/<device>` and the `bus/pci/devices/<bdf>` symlink."""
    d = root / "devices" / chain[0]
    for part in chain[1:]:
        d = d / part
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{-1 if numa is None else numa}\n")
    link = root / "bus" / "pci" / "devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(os.path.relpath(d, link.parent))
    return d


def add_ib(
    root: Path,
    name: str,
    chain: Sequence[str] | None,
    numa: int | None = 0,
    layer: str = "InfiniBand",
    state: str = "4: ACTIVE",
    rate: str = "400 Gb/sec (4X NDR)",
) -> None:
    dev = root / "class" / "infiniband" / name
    port = dev / "ports" / "1"
    port.mkdir(parents=True)
    (port / "link_layer").write_text(layer + "\n")
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "rate").write_text(rate + "\n")
    if chain is not None:
        (dev / "device").symlink_to(add_pci(root, chain, numa))


# One dual-socket box. Socket 0: root complex pci0000:17 (two root ports) and pci0000:3a.
# Root port 17:01.0 leads to a two-level PCIe switch tree; root port 17:02.0 holds GPU3.
GPU0 = ["pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:00.0", "0000:1b:00.0"]  # top switch, slot 0
GPU1 = [
    "pci0000:17",
    "0000:17:01.0",
    "0000:18:00.0",
    "0000:19:01.0",
    "0000:2a:00.0",
    "0000:2b:00.0",
    "0000:2c:00.0",
]  # below a second switch on slot 1
GPU2 = ["pci0000:3a", "0000:3a:01.0", "0000:3b:00.0"]
GPU3 = ["pci0000:17", "0000:17:02.0", "0000:20:00.0"]
GPU4 = ["pci0000:97", "0000:97:01.0", "0000:98:00.0"]  # socket 1
GPU_CHAINS = [GPU0, GPU1, GPU2, GPU3, GPU4]
GPU_NUMA = [0, 0, 0, 0, 1]
NIC_TOP = ["pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:02.0", "0000:1a:00.0"]  # top switch, slot 2
NIC_SOCKET1 = ["pci0000:97", "0000:97:03.0", "0000:99:00.0"]  # fmt: skip


def build_box(root: Path) -> list[str]:
    for chain, numa in zip(GPU_CHAINS, GPU_NUMA, strict=True):
        add_pci(root, chain, numa)
    return [c[-1] for c in GPU_CHAINS]


def test_ndr_infiniband_nic_distances_to_every_gpu(tmp_path: Path) -> None:
    gpus = build_box(tmp_path)
    add_ib(tmp_path, "mlx5_0", NIC_TOP, numa=0)
    (nic,) = read_nics(tmp_path, gpus)
    assert nic.name == "mlx5_0"
    assert nic.link_layer is LinkLayer.INFINIBAND
    assert nic.state == "ACTIVE"
    assert nic.rate_gbps == 400
    assert nic.numa_node == 0
    assert nic.pci_bus_id == "0000:1a:00.0"
    # same switch, two switches down, other root complex same socket, same root complex other port, socket 1
    assert nic.gpu_affinity == (P, X, N, B, S)


def test_roce_nic_on_the_other_socket(tmp_path: Path) -> None:
    gpus = build_box(tmp_path)
    add_ib(tmp_path, "mlx5_1", NIC_SOCKET1, numa=1, layer="Ethernet", state="1: DOWN", rate="100 Gb/sec (2X HDR)")
    (nic,) = read_nics(tmp_path, gpus)
    assert (nic.link_layer, nic.rdma_kind, nic.state, nic.rate_gbps) == (LinkLayer.ETHERNET, "roce", "DOWN", 100)
    assert not nic.active
    assert nic.gpu_affinity == (S, S, S, S, B)


def test_nic_without_pci_device_falls_back_to_numa(tmp_path: Path) -> None:
    gpus = build_box(tmp_path)
    add_ib(tmp_path, "rxe0", None, layer="Ethernet")
    (nic,) = read_nics(tmp_path, gpus)
    assert nic.pci_bus_id == ""
    assert nic.gpu_affinity == (S,) * 5  # NUMA unknown: SYS, never a guess


def test_nics_sorted_naturally_and_unknown_link_layer_skipped(tmp_path: Path) -> None:
    gpus = build_box(tmp_path)
    add_ib(tmp_path, "mlx5_10", ["pci0000:97", "0000:97:04.0", "0000:9a:00.0"], numa=1)
    add_ib(tmp_path, "mlx5_2", ["pci0000:97", "0000:97:05.0", "0000:9b:00.0"], numa=1)
    add_ib(tmp_path, "mlx5_3", ["pci0000:97", "0000:97:06.0", "0000:9c:00.0"], numa=1, layer="Unknown")
    (tmp_path / "class" / "infiniband" / "mlx5_9").mkdir()  # no ports at all
    assert [n.name for n in read_nics(tmp_path, gpus)] == ["mlx5_2", "mlx5_10"]


def test_gpu_missing_from_sysfs_uses_its_numa_hint(tmp_path: Path) -> None:
    add_ib(tmp_path, "mlx5_0", NIC_TOP, numa=0)
    (nic,) = read_nics(tmp_path, ["0000:aa:00.0", "0000:bb:00.0"], [0, 1])
    assert nic.gpu_affinity == (N, S)


def test_no_infiniband_class_means_no_nics(tmp_path: Path) -> None:
    assert read_nics(tmp_path, ["0000:18:00.0"]) == ()


def _p(chain: Sequence[str], numa: int | None = 0) -> PciPath:
    return PciPath(root=chain[0], bridges=tuple(chain[1:-1]), device=chain[-1], numa_node=numa)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param(_p(NIC_TOP), _p(GPU0), P, id="PIX: both behind one PCIe switch"),
        pytest.param(_p(NIC_TOP), _p(GPU1), X, id="PXB: across two levels of switches"),
        pytest.param(_p(NIC_TOP), _p(GPU3), B, id="PHB: same root complex, different root ports"),
        pytest.param(_p(NIC_TOP), _p(GPU2), N, id="NODE: other root complex, same NUMA node"),
        pytest.param(_p(NIC_TOP), _p(GPU4, 1), S, id="SYS: other socket"),
        pytest.param(_p(NIC_TOP, None), _p(GPU2, None), S, id="SYS when NUMA is unknown"),
        pytest.param(
            _p(["pci0000:c1", "0000:c1:01.0", "0000:c2:00.0"]), _p(["pci0000:c1", "0000:c1:01.0", "0000:c2:00.1"]),
            P, id="PIX: two functions of one device",
        ),
    ],
)  # fmt: skip
def test_pcie_distance(a: PciPath, b: PciPath, expected: PcieDistance) -> None:
    assert pcie_distance(a, b) == expected
    assert pcie_distance(b, a) == expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param(
            "/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0",
            PciPath("pci0000:17", ("0000:17:01.0",), "0000:18:00.0"), id="device below a root port",
        ),
        pytest.param(
            "/tmp/x/devices/pci0008:00/0008:00:00.0/0008:01:00.0",
            PciPath("pci0008:00", ("0008:00:00.0",), "0008:01:00.0"), id="grace non-zero domain",
        ),
        pytest.param("/sys/devices/virtual/net/lo", None, id="not a PCI device"),
        pytest.param("/sys/devices/pci0000:17/0000:17:01.0/net", None, id="path must end at a function"),
    ],
)  # fmt: skip
def test_parse_pci_path(path: str, expected: PciPath | None) -> None:
    assert parse_pci_path(path) == expected


@pytest.mark.parametrize(
    ("text", "state"),
    [("4: ACTIVE", "ACTIVE"), ("1: DOWN", "DOWN"), ("5: ACTIVE_DEFER\n", "ACTIVE_DEFER"), ("", "UNKNOWN")],
    ids=["active", "down", "active defer", "empty"],
)
def test_parse_port_state(text: str, state: str) -> None:
    assert parse_port_state(text) == state


@pytest.mark.parametrize(
    ("text", "rate"),
    [("400 Gb/sec (4X NDR)", 400.0), ("200 Gb/sec (4X HDR)", 200.0), ("2.5 Gb/sec (1X SDR)", 2.5), ("junk", 0.0)],
    ids=["ndr", "hdr", "sdr fractional", "unrecognised"],
)
def test_parse_rate(text: str, rate: float) -> None:
    assert parse_rate_gbps(text) == rate
