"""gputopo's GPUs as DRA devices: names, attributes and the NVLink clique encodings. Pure.

A ResourceClaim can only say "these devices share an attribute value" (`matchAttribute`). Two encodings
turn "fully NVLink-connected" into that:

- **List** (`nvlinkCliques`, needs the `DRAListTypeAttributes` gate): each GPU lists the ids of every
  maximal clique that holds it. `matchAttribute` over a list means a non-empty intersection, and a set
  of GPUs is fully connected exactly when one maximal clique holds them all, so one constraint is exact.
- **Scalar partitions** (`nvlinkPartition0..N-1`, any release): partition `p` splits the node's GPUs
  into disjoint cliques, and the partitions together hold every maximal clique as a block. A claim asks
  with a `firstAvailable` list, one subrequest per partition, each constrained to its own attribute.
  DGX-1V's overlapping cliques need two partitions (the quads, then the cross-quad pairs); NVSwitch and
  NV-paired nodes need one. A node whose maximal cliques need more than `PARTITIONS` partitions loses
  the rest, and `partition_cover` says so.

Unused partitions repeat partition 0, so every device carries every attribute: a device without the
attribute a constraint names can never be chosen.

**The cap.** Maximal cliques can be exponentially many (32 GPUs each linked to all but one partner:
2^16 of them), so enumeration stops past `MAX_CLIQUES` cliques or `MAX_CLIQUE_STEPS` steps. A capped
encoding publishes a greedy cover of the GPUs by disjoint cliques plus the first maximal cliques
found, at most `MAX_CLIQUES` in all: every published block is still fully connected, so no constraint
ever matches a set that is not a clique; what is lost is some fully connected sets (those in no
published clique) that can no longer be allocated together, and `nvlinkCliqueSize` is then the
largest published clique, not the largest there is. `Encoding.capped` says so. An encoding is
memoised on the adjacency and the healthy GPUs, so an unchanged topology costs no enumeration.
A clique id longer than an attribute value may be (64) is its GPU mask in hex, never truncated:
truncation could give two different cliques one value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from gputopo.engine.dra.order import Order, bounded_order
from gputopo.engine.state.cliques import bits, capped_cliques, mask_of, popcount
from gputopo.engine.state.snapshot import shape_of
from gputopo.model.base import LabelError
from gputopo.model.dra import ATTR_CLIQUES as ATTR_CLIQUES
from gputopo.model.dra import ATTR_PARTITION as ATTR_PARTITION
from gputopo.model.dra import DEVICE_CLASS as DEVICE_CLASS
from gputopo.model.dra import DRIVER as DRIVER
from gputopo.model.dra import PARTITIONS as PARTITIONS
from gputopo.model.dra import device_index as device_index
from gputopo.model.dra import device_name as device_name
from gputopo.model.dra import partition_attribute as partition_attribute
from gputopo.model.dra import qualified as qualified
from gputopo.model.rails import gpu_rail_masks, nic_rails
from gputopo.model.topology import Health, NodeTopology

# Real systems have a handful of maximal cliques (DGX-1V: 6, NVSwitch: 1); a node past these is
# adversarial or broken, and its encoding is capped (see the module's docstring).
MAX_CLIQUES = 64
MAX_CLIQUE_STEPS = 20_000  # Bron-Kerbosch calls, about 60 ms: bounds the work between two cliques found
MAX_ID_CHARS = 64  # DeviceAttributeMaxValueLength: a longer clique id would be truncated

# Attribute names, unqualified: DRA qualifies them with the driver's domain.
ATTR_INDEX = "index"
ATTR_UUID = "uuid"
ATTR_PRODUCT = "productName"
# ATTR_CLIQUES (the list attribute) and ATTR_PARTITION (+ partition number): gputopo.model.dra, which the
# reader of hand-written claims shares.
ATTR_CLIQUE_SIZE = "nvlinkCliqueSize"  # the largest clique this GPU is in
ATTR_RAIL = "rail"
ATTR_IMPAIRED = "nvlinkImpaired"  # the GPU is degraded or one of its NVLink links is
ATTR_HEALTH = "health"
ATTR_BLOCK_SIZE = "blockSize"  # 1 for a single GPU, k for a block of k (DeviceClass selectors tell them apart)
ATTR_BLOCK_GPUS = "gpus"  # a block's GPUs as `block_id` ('0-3')
CAPACITY_MEMORY = "memory"
# Standard attributes (KEP-4381 / KEP-6072), fully qualified.
STD_PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
STD_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
STD_NUMA_NODE = "resource.kubernetes.io/numaNode"

Scalar = bool | int | str


def greedy_cover(adj: Sequence[int], usable: int) -> list[int]:
    """Disjoint cliques covering `usable`: from the lowest GPU left, add each GPU left linked to all so
    far. Linear work; the capped encoding's guarantee that every GPU is in some published block."""
    out: list[int] = []
    left = usable
    while left:
        v = (left & -left).bit_length() - 1
        block, cand = 1 << v, left & adj[v]
        while cand:
            u = (cand & -cand).bit_length() - 1
            block |= 1 << u
            cand &= adj[u]
        out.append(block)
        left &= ~block
    return out


def partition_cover(
    n: int, cliques: Sequence[int], limit: int = PARTITIONS
) -> tuple[tuple[tuple[int, ...], ...], list[int]]:
    """Partitions of the node's GPUs into disjoint blocks whose union holds every maximal clique of
    size >= 2 as a block, built greedily (largest cliques first). Returns (partitions, left out): each
    partition gives, per GPU, the mask of its block; `left out` are the cliques beyond `limit`
    partitions. GPUs a partition's cliques do not reach are blocks of one."""
    todo = [c for c in cliques if popcount(c) >= 2]
    parts: list[tuple[int, ...]] = []
    while todo and len(parts) < limit:
        taken = 0
        blocks: list[int] = []
        rest: list[int] = []
        for c in todo:
            if c & taken:
                rest.append(c)
            else:
                blocks.append(c)
                taken |= c
        per_gpu = [1 << g for g in range(n)]
        for b in blocks:
            for g in bits(b):
                per_gpu[g] = b
        parts.append(tuple(per_gpu))
        todo = rest
    if not parts:
        parts.append(tuple(1 << g for g in range(n)))
    return tuple(parts), todo


def block_id(mask: int) -> str:
    """A clique's id as its GPU indices in ranges: '0-3', '0,4', '7'; past 64 characters the mask in
    hex ('mask-5555'), unique and short, as a truncated list would not be."""
    idx = bits(mask)
    runs: list[str] = []
    start = prev = idx[0]
    for i in [*idx[1:], -2]:
        if i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    text = ",".join(runs)
    return text if len(text) <= MAX_ID_CHARS else f"mask-{mask:x}"


@dataclass(frozen=True)
class Device:
    """One GPU as a DRA device: what a ResourceSlice carries for it, apart from the wire's shape."""

    name: str
    index: int
    attributes: Mapping[str, Scalar | tuple[str, ...]]
    memory_mib: int
    failed: bool
    gpus: tuple[int, ...] = ()  # a block's GPUs (`gputopo.engine.dra.blocks`); () for a single GPU


@dataclass(frozen=True)
class Encoding:
    """A node's clique encodings: the maximal cliques, the scalar partitions, and what they miss."""

    cliques: tuple[int, ...]
    partitions: tuple[tuple[int, ...], ...]
    left_out: tuple[int, ...]
    capped: bool = False  # the enumeration hit a cap: `cliques` are some of the maximal ones (docstring)


def _adjacency(topology: NodeTopology) -> tuple[int, ...]:
    n = len(topology.gpus)
    links = topology.nvlink.links or tuple(tuple(0 for _ in range(n)) for _ in range(n))
    return tuple(sum(1 << j for j in range(n) if j != i and links[i][j] > 0) for i in range(n))


def encoding(topology: NodeTopology) -> Encoding:
    """The clique encodings of a node's healthy GPUs: a failed GPU is in no clique. Memoised on the
    topology's content (adjacency and healthy GPUs): every discovery cycle asks again."""
    usable = sum(1 << g.index for g in topology.gpus if g.health is not Health.FAILED)
    return encode(len(topology.gpus), _adjacency(topology), usable)


@lru_cache(maxsize=16)
def encode(n: int, adj: tuple[int, ...], usable: int) -> Encoding:
    """The encodings of `n` GPUs with adjacency masks `adj`, cliques inside `usable`; capped (docstring)."""
    cliques, capped = capped_cliques(adj, usable, MAX_CLIQUES, MAX_CLIQUE_STEPS)
    if capped:
        cover = greedy_cover(adj, usable)
        extra = [c for c in cliques if c not in cover][: max(0, MAX_CLIQUES - len(cover))]
        cliques = sorted({*cover, *extra}, key=lambda m: (-popcount(m), m))
    parts, left = partition_cover(n, cliques)
    return Encoding(tuple(cliques), parts, tuple(left), capped)


def devices(
    topology: NodeTopology,
    *,
    list_attributes: bool,
    labels: Mapping[str, str] | None = None,
    pcie_roots: Mapping[int, str] | None = None,
    in_use: frozenset[int] | None = None,
) -> list[Device]:
    """The node's GPUs as DRA devices. `list_attributes`: the cluster serves list-typed attributes
    (KEP-5491); without it only the scalar partitions are published. `pcie_roots`: per GPU index, the
    root complex sysfs gives ('pci0000:3a'); without it the standard attribute is left out. `in_use`:
    the GPUs allocated now, for best-fit order (`gputopo.engine.dra.order`); None: index order."""
    enc = encoding(topology)
    try:
        rails = gpu_rail_masks(topology, nic_rails(topology, dict(labels or {})))
    except LabelError:  # a bad rails label: no rail attribute, as the engine reads no rail either
        rails = tuple(0 for _ in topology.gpus)
    impaired = {d.gpu for d in topology.degraded_links}
    out: list[Device] = []
    for g in topology.gpus:
        i = g.index
        failed = g.health is Health.FAILED
        attrs: dict[str, Scalar | tuple[str, ...]] = {
            ATTR_INDEX: i,
            ATTR_UUID: g.uuid,
            ATTR_PRODUCT: g.model,
            ATTR_HEALTH: str(g.health),
            ATTR_IMPAIRED: g.health is Health.DEGRADED or i in impaired,
            ATTR_CLIQUE_SIZE: max((popcount(c) for c in enc.cliques if c >> i & 1), default=0),
            ATTR_BLOCK_SIZE: 1,
        }
        for p in range(PARTITIONS):
            part = enc.partitions[p] if p < len(enc.partitions) else enc.partitions[0]
            attrs[partition_attribute(p)] = block_id(part[i])
        if list_attributes:
            attrs[ATTR_CLIQUES] = tuple(block_id(c) for c in enc.cliques if c >> i & 1) or (block_id(1 << i),)
        if i < len(rails) and rails[i]:
            attrs[ATTR_RAIL] = (rails[i] & -rails[i]).bit_length() - 1  # the lowest rail when a GPU has two
        if g.pci_bus_id:
            attrs[STD_PCI_BUS_ID] = g.pci_bus_id.lower()
        root = (pcie_roots or {}).get(i)
        if root:
            attrs[STD_PCIE_ROOT] = root
        if g.numa_node is not None and g.numa_node >= 0:
            attrs[STD_NUMA_NODE] = g.numa_node
        out.append(Device(device_name(i), i, attrs, g.memory_mib, failed))
    if in_use is None:
        return out
    at = {d.index: d for d in out}
    return [at[i] for i in best_fit(topology, in_use).gpus if i in at]


def best_fit(topology: NodeTopology, in_use: frozenset[int]) -> Order:
    """The node's GPUs in best-fit order for `in_use` (the GPUs allocated now), within the order's work
    budget (`gputopo.engine.dra.order`); memoised, so asking again after `devices` costs nothing."""
    usable = sum(1 << g.index for g in topology.gpus if g.health is not Health.FAILED)
    busy = mask_of(sorted(in_use)) & usable
    return bounded_order(shape_of(topology), encoding(topology).partitions[0], usable, busy)
