"""RDMA NICs and PCIe placement from sysfs (nvml-and-nodes.md §6).

NVML has no GPU-to-NIC call, so the PCIe distance is derived here from the sysfs PCI chains, as
NCCL does. Reading the filesystem (`read_nics`, `pci_path`) is kept apart from the pure distance
rule (`pcie_distance`) so the rule is tested on plain values.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gputopo.model import LinkLayer, NicInfo, PcieDistance

log = logging.getLogger(__name__)

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ROOT_COMPLEX = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


@dataclass(frozen=True)
class PciPath:
    """Where a PCI function sits: its root complex, the bridges above it (root port first), itself."""

    root: str
    bridges: tuple[str, ...]
    device: str
    numa_node: int | None = None


def parse_pci_path(real_path: str, numa_node: int | None = None) -> PciPath | None:
    """Split a sysfs device realpath (`…/devices/pci0000:17/0000:17:01.0/0000:18:00.0`) into a PciPath."""
    parts = [p for p in real_path.lower().split("/") if p]
    roots = [i for i, p in enumerate(parts) if _ROOT_COMPLEX.fullmatch(p)]
    if not roots:
        return None
    start = roots[-1]
    chain = [p for p in parts[start + 1 :] if _BDF.fullmatch(p)]
    if not chain or not _BDF.fullmatch(parts[-1]):
        return None
    return PciPath(root=parts[start], bridges=tuple(chain[:-1]), device=chain[-1], numa_node=numa_node)


def pcie_distance(a: PciPath, b: PciPath) -> PcieDistance:
    """nvidia-smi's PIX/PXB/PHB/NODE/SYS between two PCI functions.

    A PCIe switch shows in sysfs as an upstream port plus one downstream port per slot, so two
    functions behind one switch diverge right below its upstream port: at most one bridge each
    below the common ancestor means a single switch (PIX); deeper means several switches (PXB).
    No common bridge but the same root complex means the path crosses the host bridge (PHB).
    """
    if a.root != b.root:
        same_numa = a.numa_node is not None and a.numa_node == b.numa_node
        return PcieDistance.NODE if same_numa else PcieDistance.SYS
    common = 0
    for x, y in zip(a.bridges, b.bridges, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return PcieDistance.PHB
    if len(a.bridges) - common <= 1 and len(b.bridges) - common <= 1:
        return PcieDistance.PIX
    return PcieDistance.PXB


def numa_distance(a: int | None, b: int | None) -> PcieDistance:
    """Fallback when a PCI chain is unknown: NODE on the same known NUMA node, SYS otherwise."""
    return PcieDistance.NODE if a is not None and a == b else PcieDistance.SYS


def parse_port_state(text: str) -> str:
    """`4: ACTIVE` → `ACTIVE` (the kernel prints `"%d: %s"`)."""
    return text.strip().split(":", 1)[-1].strip().upper() or "UNKNOWN"


def parse_rate_gbps(text: str) -> float:
    """`400 Gb/sec (4X NDR)` → 400.0; 0.0 when the format is not recognised."""
    m = _RATE.match(text)
    return float(m.group(1)) if m else 0.0


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _numa(text: str | None) -> int | None:
    try:
        n = int(text) if text is not None else -1
    except ValueError:
        return None
    return n if n >= 0 else None  # the kernel writes -1 when it does not know


def pci_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """NUMA node of a PCI function from `<root>/bus/pci/devices/<bdf>/numa_node` (None if unknown)."""
    return _numa(_read(sysfs_root / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node"))


def _path_of(device_dir: Path) -> PciPath | None:
    if not device_dir.exists():
        return None
    return parse_pci_path(os.path.realpath(device_dir), _numa(_read(device_dir / "numa_node")))


def pci_path(sysfs_root: Path, bus_id: str) -> PciPath | None:
    """The PciPath of a PCI function by bus id, via the `<root>/bus/pci/devices/<bdf>` symlink."""
    return _path_of(sysfs_root / "bus" / "pci" / "devices" / bus_id.lower())


def _natural(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*?)([0-9]+)", name)  # ASCII digits: int() of '²' raises
    return (m.group(1), int(m.group(2))) if m else (name, -1)


def _pick_port(dev: Path) -> Path | None:
    ports = sorted(
        (p for p in (dev / "ports").glob("*") if p.name.isascii() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    for port in ports:
        if parse_port_state(_read(port / "state") or "") == "ACTIVE":
            return port
    return ports[0] if ports else None


def read_nics(
    sysfs_root: Path, gpu_bus_ids: Sequence[str], gpu_numa: Sequence[int | None] | None = None
) -> tuple[NicInfo, ...]:
    """Every RDMA device under `<root>/class/infiniband`, with its PCIe distance to each GPU."""
    base = sysfs_root / "class" / "infiniband"
    if not base.is_dir():
        return ()
    numa_hint = list(gpu_numa) if gpu_numa is not None else [None] * len(gpu_bus_ids)
    gpu_paths = [pci_path(sysfs_root, b) if b else None for b in gpu_bus_ids]
    gpu_nodes = [p.numa_node if p and p.numa_node is not None else numa_hint[i] for i, p in enumerate(gpu_paths)]
    nics = []
    for dev in sorted(base.iterdir(), key=lambda p: _natural(p.name)):
        port = _pick_port(dev)
        if port is None:
            log.info("rdma device has no ports; skipped", extra={"nic": dev.name})
            continue
        layer_text = _read(port / "link_layer") or ""
        try:
            layer = LinkLayer(layer_text)
        except ValueError:
            log.info("rdma device link layer not InfiniBand or Ethernet; skipped", extra={"nic": dev.name})
            continue
        path = _path_of(dev / "device")
        numa = path.numa_node if path else None
        affinity = tuple(
            pcie_distance(path, gp) if path and gp else numa_distance(numa, gpu_nodes[g])
            for g, gp in enumerate(gpu_paths)
        )
        nics.append(
            NicInfo(
                name=dev.name,
                link_layer=layer,
                state=parse_port_state(_read(port / "state") or ""),
                rate_gbps=parse_rate_gbps(_read(port / "rate") or ""),
                numa_node=numa,
                pci_bus_id=path.device if path else "",
                gpu_affinity=affinity,
            )
        )
    return tuple(nics)
