"""NIC rails: which leaf of a rail-optimized fabric each NIC and GPU of a node reaches."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gputopo.model.base import LabelError
from gputopo.model.names import LABEL_RAILS
from gputopo.model.topology import MAX_NICS_PER_NODE, NodeTopology, PcieDistance

# Rail-optimized fabrics cable NIC k of every node to leaf k ("rail k"): traffic between GPUs on the
# same rail of two nodes stays on one leaf, traffic between rails crosses the spine. By default a NIC's
# rail is its position in the topology's NIC list, the order the agent publishes (RDMA devices in
# natural name order: mlx5_0, mlx5_1, ..., mlx5_10). Where the cabling differs, the operator labels the
# node with each NIC's rail in that same order, dot-separated (label values allow no "=" or ","):
# `gputopo.io/rails=4.5.6.7.0.1.2.3`. A label is what an operator can set without touching the agent,
# and the engine already reads node labels. Two NICs of one node may share a rail.
MAX_RAIL = MAX_NICS_PER_NODE - 1
_RAIL_ENTRY = re.compile(r"^[0-9]{1,2}$")


def parse_rails_label(value: str, nic_names: tuple[str, ...] | list[str]) -> tuple[int, ...]:
    """The `gputopo.io/rails` label: one rail number per NIC of the topology, in its NIC order.
    Raises LabelError saying what is wrong; never guesses a partial mapping."""
    example = ".".join(str(i) for i in range(min(len(nic_names), 4))) or "0.1"
    if not value.strip():
        raise LabelError(LABEL_RAILS, value, f"empty; give each NIC's rail in NIC order, dot-separated, e.g. {example}")
    entries = value.strip().split(".")
    for i, entry in enumerate(entries):
        if not _RAIL_ENTRY.fullmatch(entry) or int(entry) > MAX_RAIL:
            where = f"NIC {nic_names[i]}" if i < len(nic_names) else f"entry {i}"
            raise LabelError(LABEL_RAILS, value, f"{where}: {entry!r} is not a rail number 0..{MAX_RAIL}")
    if len(entries) != len(nic_names):
        names = ", ".join(nic_names[:8]) + (", ..." if len(nic_names) > 8 else "")
        have = f"the node has {len(nic_names)} NICs ({names})" if nic_names else "the node reports no NICs"
        raise LabelError(LABEL_RAILS, value, f"lists {len(entries)} rails; {have}, one rail each in this order")
    return tuple(int(e) for e in entries)


def nic_rails(topology: NodeTopology, labels: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """Each NIC's rail, in the topology's NIC order: its position, or the `gputopo.io/rails` label."""
    value = (labels or {}).get(LABEL_RAILS)
    if value is None:
        return tuple(range(len(topology.nics)))
    return parse_rails_label(value, [n.name for n in topology.nics])


def gpu_rail_masks(topology: NodeTopology, rails: tuple[int, ...]) -> tuple[int, ...]:
    """Per GPU, the rails (bit r: rail r) of its nearest active NICs at PIX or PXB; 0 when no active NIC
    sits that near. Ties count every NIC at the nearest distance (a DGX A100 puts two NICs behind each
    GPU pair's PCIe switch, so the pair uses both rails)."""
    near = (PcieDistance.PIX, PcieDistance.PXB)
    out = []
    for g in range(len(topology.gpus)):
        best: PcieDistance | None = None
        mask = 0
        for nic, rail in zip(topology.nics, rails, strict=True):
            if not nic.active or not nic.gpu_affinity:
                continue
            d = nic.gpu_affinity[g]
            if d not in near:
                continue
            if best is None or d.rank < best.rank:
                best, mask = d, 1 << rail
            elif d is best:
                mask |= 1 << rail
        out.append(mask)
    return tuple(out)
