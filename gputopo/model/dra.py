"""gputopo's DRA names, and the two DRA objects the extender reads: ResourceSlices (which GPUs a node
publishes under our driver) and ResourceClaims (which of them are allocated, and to which pods).

Pure parsing of resource.k8s.io/v1 objects as JSON-shaped mappings. A malformed object raises
`DraObjectError` naming it; an object of another driver is not an error, it is simply not ours.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gputopo.model.inuse import GpusInUse

DRIVER = "gpu.gputopo.io"  # the DRA driver name, the attribute domain and the DeviceClass's name
DEVICE_CLASS = DRIVER
# gputopo's ResourceClaimTemplates: `gputopo-gpus-<count>-...` (gputopo.engine.dra.claims names them).
TEMPLATE_PREFIX = "gputopo-gpus"

# Upstream bounds (resource.k8s.io/v1 validation): devices per slice, results per allocation.
MAX_SLICE_DEVICES = 128
MAX_ALLOCATION_RESULTS = 32
MAX_RESERVED_FOR = 256
MAX_GPU_INDEX = 4096
# ASCII digits only: str.isdigit() and int() also take '٣' or '²', which no name of ours holds.
_INDEX = re.compile(r"0|[1-9][0-9]{0,3}")
_COUNT = re.compile(r"[1-9][0-9]{0,2}")


class DraObjectError(ValueError):
    """A ResourceSlice or ResourceClaim that cannot be read; the message names the object."""


def device_name(index: int) -> str:
    """The DRA device name of GPU `index` (a DNS label, stable across restarts)."""
    return f"gpu-{index}"


def device_index(name: str) -> int | None:
    """The GPU index a device name stands for, or None when it is not one of ours."""
    prefix, _, rest = name.partition("-")
    if prefix != "gpu" or not _INDEX.fullmatch(rest):
        return None
    index = int(rest)
    return index if index < MAX_GPU_INDEX else None


# Clique blocks (partitionable devices, KEP-4815): one device stands for a whole NVLink clique and
# consumes one counter per GPU it covers from the node's one counter set, so the allocator never hands
# out a block and any of its GPUs, or two overlapping blocks, at once. Names, all DNS labels:
COUNTER_SET = "gpus"  # the node's counter set: one counter per GPU, value 1
BLOCK_PREFIX = "block"  # a block device: `block-0-1-2-3`, or `block-x<hex mask>` past 63 characters
BLOCK_SIZES = (2, 4, 8, 16)  # the sizes a block is published in, each with its DeviceClass
MAX_DEVICE_NAME = 63
# The clique attributes a claim's `matchAttribute` names (gputopo.engine.dra.devices publishes them; the
# webhook's claims and the hand-written claims gputopo reads, gputopo.model.claimask, constrain on them):
# a list of clique ids, and PARTITIONS scalar partitions `nvlinkPartition0..`.
ATTR_CLIQUES = "nvlinkCliques"
ATTR_PARTITION = "nvlinkPartition"
PARTITIONS = 4  # every device carries them all: enough for DGX-1V (2) with room to spare
BLOCK_RESOURCE_PREFIX = "gputopo.io/gpu-clique"  # + the size: each block class's extended resource
_BLOCK_HEX = re.compile(r"x[1-9a-f][0-9a-f]{0,1023}")


def counter_name(index: int) -> str:
    """The counter that GPU `index` is in its node's counter set (the device name: one per GPU)."""
    return device_name(index)


def block_name(gpus: Iterable[int]) -> str:
    """The DRA device name of the block over `gpus` (two or more indices): canonical, so one set has
    one name and `block_gpus` reads back exactly the set."""
    idx = sorted(set(gpus))
    if len(idx) < 2 or idx[0] < 0 or idx[-1] >= MAX_GPU_INDEX:
        raise ValueError(f"a block covers two or more GPUs below {MAX_GPU_INDEX}, not {idx}")
    text = f"{BLOCK_PREFIX}-" + "-".join(map(str, idx))
    if len(text) <= MAX_DEVICE_NAME:
        return text
    return f"{BLOCK_PREFIX}-x{sum(1 << i for i in idx):x}"


def block_gpus(name: str) -> tuple[int, ...] | None:
    """The GPUs a block device name covers, ascending; None when `name` is not a canonical block name
    (so two names never stand for one set)."""
    prefix, sep, rest = name.partition("-")
    if prefix != BLOCK_PREFIX or not sep or len(name) > MAX_DEVICE_NAME:
        return None
    if _BLOCK_HEX.fullmatch(rest):
        mask = int(rest[1:], 16)
        idx = tuple(i for i in range(mask.bit_length()) if mask >> i & 1)
    else:
        parts = rest.split("-")
        if not all(_INDEX.fullmatch(p) for p in parts):
            return None
        idx = tuple(int(p) for p in parts)
    if len(idx) < 2 or idx[-1] >= MAX_GPU_INDEX or list(idx) != sorted(set(idx)):
        return None
    return idx if block_name(idx) == name else None


def device_gpus(name: str) -> tuple[int, ...] | None:
    """The GPUs any of our device names stands for: one for `gpu-<i>`, a clique for a block; None for
    a name that is not ours."""
    index = device_index(name)
    return (index,) if index is not None else block_gpus(name)


def qualified(name: str) -> str:
    """An attribute's full name as a claim's constraint or CEL selector names it."""
    return name if "/" in name else f"{DRIVER}/{name}"


def partition_attribute(p: int) -> str:
    return f"{ATTR_PARTITION}{p}"


def block_class(size: int) -> str:
    """The DeviceClass whose devices are blocks of `size` GPUs."""
    return f"clique{size}.{DRIVER}"


def block_resource(size: int) -> str:
    """The extended resource a pod asks to get one block of `size` GPUs (KEP-5004: the DeviceClass's
    `extendedResourceName`), e.g. `gputopo.io/gpu-clique4: 1`."""
    return f"{BLOCK_RESOURCE_PREFIX}{size}"


def template_gpus(name: str) -> int | None:
    """The GPU count of one of gputopo's claim templates, read from its name; None for any other name."""
    head, sep, rest = name.partition(TEMPLATE_PREFIX + "-")
    if head or not sep:
        return None
    count = rest.split("-", 1)[0]
    if not _COUNT.fullmatch(count):
        return None
    return int(count)


def pod_claim_gpus(spec: Mapping[str, Any]) -> int:
    """The GPUs a pod asks for through gputopo's claim templates (`spec.resourceClaims`): a pod the
    webhook converted for DRA names no nvidia.com/gpu, only the template. 0 for anything else."""
    claims = spec.get("resourceClaims")
    if not isinstance(claims, list):
        return 0
    total = 0
    for c in claims[:MAX_ALLOCATION_RESULTS]:
        name = c.get("resourceClaimTemplateName") if isinstance(c, Mapping) else None
        count = template_gpus(name) if isinstance(name, str) else None
        total += count or 0
    return total


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return "<unnamed>"
    ns, name = meta.get("namespace"), meta.get("name")
    return f"{ns}/{name}" if isinstance(ns, str) and ns else str(name)


def _map(obj: Mapping[str, Any], key: str, what: str) -> Mapping[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DraObjectError(f"{what}: {key} is not an object")
    return value


def _list(obj: Mapping[str, Any], key: str, what: str, limit: int) -> list[Any]:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise DraObjectError(f"{what}: {key} is not a list")
    if len(value) > limit:
        raise DraObjectError(f"{what}: {key} has {len(value)} entries, more than {limit}")
    return value


@dataclass(frozen=True)
class SliceInfo:
    """Our devices on one node, as one ResourceSlice publishes them."""

    node: str
    pool: str
    generation: int
    gpus: frozenset[int]


def parse_slice(obj: Mapping[str, Any]) -> SliceInfo | None:
    """A ResourceSlice of our driver, or None for another driver's. Its pool must be named for its node,
    as our agent names it (a claim's pool is its node). Device names that are not ours
    (`gpu-<index>`, or a canonical block name: its GPUs count) are an error: our agent publishes no
    others. A slice of counters only (`sharedCounters`, no devices) is valid and publishes no GPUs; its
    counters are not read."""
    what = f"ResourceSlice {_name(obj)}"
    spec = _map(obj, "spec", what)
    if spec.get("driver") != DRIVER:
        return None
    node = spec.get("nodeName")
    if not isinstance(node, str) or not node:
        raise DraObjectError(f"{what}: no spec.nodeName (gputopo's devices are node-local)")
    pool = _map(spec, "pool", what)
    pool_name, generation = pool.get("name"), pool.get("generation", 0)
    if not isinstance(pool_name, str) or not isinstance(generation, int) or isinstance(generation, bool):
        raise DraObjectError(f"{what}: spec.pool needs a name and an integer generation")
    if pool_name != node:
        # Every reader keys a claim's GPUs by pool: a pool named for another node would move its claims there.
        raise DraObjectError(f"{what}: pool {pool_name[:80]!r} is not named for its node {node[:80]!r}")
    gpus: set[int] = set()
    for d in _list(spec, "devices", what, MAX_SLICE_DEVICES):
        name = d.get("name") if isinstance(d, Mapping) else None
        covers = device_gpus(name) if isinstance(name, str) else None
        if covers is None:
            raise DraObjectError(f"{what}: device {name!r} is not a gputopo GPU (gpu-<index>) or block")
        gpus.update(covers)
    return SliceInfo(node, pool_name, generation, frozenset(gpus))


@dataclass(frozen=True)
class ClaimInfo:
    """Which of our GPUs a ResourceClaim holds, on which pool (node), and for which pods."""

    uid: str
    namespace: str
    name: str
    pool: str | None  # None: nothing of ours is allocated
    gpus: frozenset[int]
    reserved_for: frozenset[str]  # pod UIDs


def parse_claim(obj: Mapping[str, Any]) -> ClaimInfo:
    what = f"ResourceClaim {_name(obj)}"
    meta = _map(obj, "metadata", what)
    uid, namespace, name = meta.get("uid", ""), meta.get("namespace", ""), meta.get("name", "")
    if not all(isinstance(v, str) for v in (uid, namespace, name)):
        raise DraObjectError(f"{what}: metadata uid, namespace and name must be strings")
    status = _map(obj, "status", what)
    allocation = _map(status, "allocation", what)
    devices = _map(allocation, "devices", what)
    pools: set[str] = set()
    gpus: set[int] = set()
    for r in _list(devices, "results", what, MAX_ALLOCATION_RESULTS):
        if not isinstance(r, Mapping):
            raise DraObjectError(f"{what}: an allocation result is not an object")
        if r.get("driver") != DRIVER:
            continue
        pool, device = r.get("pool"), r.get("device")
        covers = device_gpus(device) if isinstance(device, str) else None
        if not isinstance(pool, str) or covers is None:
            raise DraObjectError(f"{what}: allocation result {device!r} in pool {pool!r} is not a gputopo GPU")
        pools.add(pool)
        gpus.update(covers)  # a block is its GPUs; a GPU named twice (a block and one of its own) counts once
    if len(pools) > 1:
        raise DraObjectError(f"{what}: our GPUs from {len(pools)} pools; gputopo's devices are node-local")
    reserved: set[str] = set()
    for c in _list(status, "reservedFor", what, MAX_RESERVED_FOR):
        if isinstance(c, Mapping) and c.get("resource") == "pods" and isinstance(c.get("uid"), str):
            reserved.add(c["uid"])
    return ClaimInfo(str(uid), str(namespace), str(name), next(iter(pools), None), frozenset(gpus), frozenset(reserved))


def in_use_by_node(
    claims: Iterable[ClaimInfo], slices: Iterable[SliceInfo], pod_namespace: Callable[[str], str | None]
) -> dict[str, GpusInUse]:
    """Per node that publishes our GPUs, the GPUs its claims hold: per pod UID when the claim is
    reserved for one pod that `pod_namespace` (a pod UID's namespace, None when unknown) puts in the
    claim's own namespace, else under `other`. A consumer reference in `reservedFor` is in the claim's
    namespace by API definition: a claim naming another namespace's pod (or one not known yet) still
    holds its GPUs, but never as that pod's, so a what-if without that pod frees none of them. A claim
    shared by pods, or allocated but not yet reserved, likewise counts under `other`. A claim on a pool
    no slice publishes counts for nobody."""
    node_of = {s.pool: s.node for s in slices}
    pods: dict[str, dict[str, set[int]]] = {node: {} for node in node_of.values()}
    other: dict[str, set[int]] = {node: set() for node in node_of.values()}
    for c in claims:
        node = node_of.get(c.pool) if c.pool is not None else None
        if node is None or not c.gpus:
            continue
        pod = sole_pod(c)
        if pod is not None and pod_namespace(pod) == c.namespace:
            pods[node].setdefault(pod, set()).update(c.gpus)
        else:
            other[node].update(c.gpus)
    out: dict[str, GpusInUse] = {}
    for node in pods:
        out[node] = GpusInUse(pods={uid: frozenset(g) for uid, g in pods[node].items()}, other=frozenset(other[node]))
    return out


def sole_pod(claim: ClaimInfo) -> str | None:
    """The UID of the one pod `claim` is reserved for; None when it is reserved for none or several."""
    return next(iter(claim.reserved_for)) if len(claim.reserved_for) == 1 else None
