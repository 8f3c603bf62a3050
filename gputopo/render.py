"""Render a node's topology the way `nvidia-smi topo -m` prints it, plus health lines.

Shared by `gputopo-agent --once --print` and `gputopo topo NODE`. Pure: a NodeTopology (and
optionally the GPUs in use) in, a string out.

GPU pairs with NVLink show `NV#`. For pairs without NVLink the topology document carries no PCIe
path, so the cell is derived from NUMA placement: `NODE` on the same known NUMA node, else `SYS`.
NIC columns come from each NIC's `gpuAffinity` (`SYS` where unknown). On an NVL72 tray each GPU's
multi-node NVLink fabric health follows its legend line, and the tray's health (the worst) its own line.
"""

from __future__ import annotations

from collections.abc import Collection

from gputopo.model import FabricHealth, GpuInfo, Health, NodeTopology, decode_health, on_fabric, tray_health


def gpu_pair_cell(topology: NodeTopology, i: int, j: int) -> str:
    """`X`, `NV#`, or the PCIe distance derived from NUMA placement."""
    if i == j:
        return "X"
    links = topology.link_count(i, j)
    if links > 0:
        return f"NV{links}"
    a, b = topology.gpus[i].numa_node, topology.gpus[j].numa_node
    return "NODE" if a is not None and a == b else "SYS"


def _matrix(topology: NodeTopology) -> list[list[str]]:
    n = len(topology.gpus)
    header = ["", *(f"GPU{i}" for i in range(n)), *(f"NIC{k}" for k in range(len(topology.nics))), "NUMA Affinity"]
    rows = [header]
    for i, gpu in enumerate(topology.gpus):
        row = [f"GPU{i}", *(gpu_pair_cell(topology, i, j) for j in range(n))]
        for nic in topology.nics:
            row.append(nic.gpu_affinity[i].value if nic.gpu_affinity else "SYS")
        row.append(str(gpu.numa_node) if gpu.numa_node is not None else "N/A")
        rows.append(row)
    return rows


def _fabric_phrase(health: FabricHealth, why: str) -> str:
    return health.value + (f" ({why})" if why else "")


def _gpu_legend(gpu: GpuInfo) -> str:
    bus = f", {gpu.pci_bus_id}" if gpu.pci_bus_id else ""
    fabric = f", NVLink fabric {_fabric_phrase(*decode_health(gpu.fabric))}" if gpu.fabric is not None else ""
    return f"GPU{gpu.index}: {gpu.model}, {gpu.memory_mib} MiB{bus}{fabric}"


def _fmt_indices(indices: Collection[int]) -> str:
    return ", ".join(str(i) for i in sorted(indices)) if indices else "none"


def render_topology(topology: NodeTopology, gpus_in_use: Collection[int] | None = None) -> str:
    """The `topo -m`-style matrix, a NIC and GPU legend, then health and usage lines."""
    rows = _matrix(topology)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)).rstrip() for r in rows]
    lines.append("")
    for k, nic in enumerate(topology.nics):
        rate = f"{nic.rate_gbps:g} Gb/s"
        kind = "InfiniBand" if nic.rdma_kind == "infiniband" else "RoCE"
        numa = f", NUMA {nic.numa_node}" if nic.numa_node is not None else ""
        bus = f", {nic.pci_bus_id}" if nic.pci_bus_id else ""
        lines.append(f"NIC{k}: {nic.name} ({kind}, {rate}, {nic.state}{numa}{bus})")
    lines.extend(_gpu_legend(gpu) for gpu in topology.gpus)
    lines.append("")
    nv = topology.nvlink
    if any(any(row) for row in nv.links):
        via = "via NVSwitch" if nv.nvswitch else "direct"
        lines.append(f"NVLink: generation {nv.generation}, {nv.gbps_per_link:g} GB/s per link, {via}")
    else:
        lines.append("NVLink: none (PCIe only)")
    if topology.fabric is not None:
        lines.append(f"Fabric clique: {topology.fabric.clique}")
    if on_fabric(topology.gpus):
        lines.append(f"NVLink fabric: {_fabric_phrase(*tray_health(topology.gpus))}")
    for d in topology.degraded_links:
        detail = f" ({d.detail})" if d.detail else ""
        lines.append(f"Degraded link: GPU{d.gpu} link {d.link} {d.state.value}{detail}")
    for gpu in topology.gpus:
        if gpu.health is not Health.OK or gpu.reasons:
            why = "; ".join(gpu.reasons) if gpu.reasons else "no reason given"
            lines.append(f"GPU{gpu.index} {gpu.health.value}: {why}")
    if not topology.degraded_links and all(g.health is Health.OK for g in topology.gpus):
        lines.append("Health: all GPUs ok, no degraded links")
    if gpus_in_use is not None:
        lines.append(f"GPUs in use: {_fmt_indices(gpus_in_use)}")
    return "\n".join(lines) + "\n"
