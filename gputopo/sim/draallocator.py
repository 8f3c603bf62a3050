"""kube-scheduler's DRA allocator, emulated for gputopo's devices: the claims pods get, and `allocate`. Pure.

Under DRA the scheduler, not the device plugin, picks a pod's GPUs: its DynamicResources plugin runs the
structured allocator (k8s.io/dynamic-resource-allocation/structured) on every candidate node. What that
allocator does, as read in its v0.34.4 source (list values: as the v0.37.2 API documents them), and as
`allocate` repeats it for one claim on one node:

- a request's `firstAvailable` subrequests are tried in order; the first one that can be met wins;
- for each device the request still needs, the devices of the node's pool are tried in slice order,
  skipping those already allocated, those the class's and request's selectors reject, and those a
  constraint rejects; the search backtracks on a dead end and stops at the first full solution;
- `matchAttribute` needs the attribute on every chosen device; the values are compared as sets (a
  scalar is a one-element set, the list-typed attributes of KEP-5491 are their elements) and the
  chosen devices' sets must intersect. Over scalars alone that is plain equality, as before 1.36.

Upstream tries every ordering of the devices of a request. The constraint is a property of the set,
not of the order, so its first solution is the lexicographically least feasible set in slice order,
and so is the first of a search that only tries devices in increasing order: `allocate` searches that
way and finds the same devices, without walking every permutation when no solution exists.

Failed GPUs are never chosen: the agent taints them NoSchedule, or leaves them out of the slice.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gputopo.engine.dra.claims import MAX_DEVICES_PER_CLAIM, MAX_SUBREQUESTS, ClaimShape, claim_shape, device_claim
from gputopo.engine.dra.devices import DRIVER, Device
from gputopo.model import NvlinkPolicy, PodRequest

Encoding = Literal["none", "partitions", "list"]
ENCODINGS: tuple[Encoding, ...] = ("none", "partitions", "list")


# --------------------------------------------------------------------------------------------------
# Claims


@dataclass(frozen=True)
class Subrequest:
    """One way to meet the claim: `count` devices of gputopo's class with at least `min_memory_mib`
    (a CEL selector on the `memory` capacity), all sharing `match_attribute` when one is given (a
    `matchAttribute` constraint naming this subrequest)."""

    name: str
    count: int
    min_memory_mib: int = 0
    match_attribute: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("subrequest name must not be empty")
        if not 1 <= self.count <= MAX_DEVICES_PER_CLAIM:
            raise ValueError(
                f"subrequest {self.name!r}: count {self.count} must be between 1 and {MAX_DEVICES_PER_CLAIM}"
            )
        if self.min_memory_mib < 0:
            raise ValueError(f"subrequest {self.name!r}: min_memory_mib {self.min_memory_mib} must be >= 0")
        if self.match_attribute is not None and "/" not in self.match_attribute:
            raise ValueError(
                f"subrequest {self.name!r}: match_attribute {self.match_attribute!r} must be fully qualified"
            )


@dataclass(frozen=True)
class Claim:
    """A one-request ResourceClaim: one subrequest is a plain `exactly` request, several are its
    `firstAvailable` list, tried in order."""

    subrequests: tuple[Subrequest, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.subrequests) <= MAX_SUBREQUESTS:
            raise ValueError(f"claim has {len(self.subrequests)} subrequests; it needs 1 to {MAX_SUBREQUESTS}")
        names = [s.name for s in self.subrequests]
        if len(set(names)) != len(names):
            raise ValueError(f"claim subrequest names repeat: {', '.join(names)}")


def claim_from_spec(devices: Mapping[str, Any], min_memory_mib: int = 0) -> Claim:
    """The Claim a ResourceClaim's `spec.devices` asks for (one request: `exactly`, or `firstAvailable`
    subrequests tried in order; `matchAttribute` constraints naming the request or a subrequest).
    `min_memory_mib` stands for the builder's CEL memory selector, which this emulation does not parse."""
    (request,) = devices["requests"]
    constraints = {tuple(c["requests"]): c["matchAttribute"] for c in devices.get("constraints", [])}
    name = request["name"]
    if "exactly" in request:
        return Claim((Subrequest(name, request["exactly"]["count"], min_memory_mib, constraints.get((name,))),))
    return Claim(
        tuple(
            Subrequest(s["name"], s["count"], min_memory_mib, constraints.get((f"{name}/{s['name']}",)))
            for s in request["firstAvailable"]
        )
    )


def _built(count: int, nvlink: NvlinkPolicy, min_memory_mib: int, *, list_attributes: bool) -> Claim:
    """The claim gputopo's claim builder (the webhook's) makes for this shape."""
    shape = ClaimShape(count, nvlink, min_memory_mib or None, list_attributes)
    return claim_from_spec(device_claim(shape), min_memory_mib)


def unconstrained_claim(count: int, min_memory_mib: int = 0) -> Claim:
    """`count` GPUs, no constraint: what KEP-5004's `nvidia.com/gpu: N` becomes (with no memory selector)."""
    return _built(count, NvlinkPolicy.IGNORE, min_memory_mib, list_attributes=False)


def list_claim(count: int, min_memory_mib: int = 0, *, fallback: bool = False) -> Claim:
    """`count` GPUs that share a maximal NVLink clique (the list attribute); `fallback`: then any GPUs."""
    nvlink = NvlinkPolicy.PREFERRED if fallback else NvlinkPolicy.REQUIRED
    return _built(count, nvlink, min_memory_mib, list_attributes=True)


def partition_claim(count: int, min_memory_mib: int = 0, *, fallback: bool = False) -> Claim:
    """`count` GPUs in one block of scalar partition 0, else of partition 1, ...; `fallback`: then any."""
    nvlink = NvlinkPolicy.PREFERRED if fallback else NvlinkPolicy.REQUIRED
    return _built(count, nvlink, min_memory_mib, list_attributes=False)


def claim_for(request: PodRequest, encoding_: Encoding, *, opted_in: bool = True) -> Claim:
    """The claim a pod gets. `none`: KEP-5004's count alone, whatever the pod's annotations. Otherwise
    the claim builder's (the webhook's): min HBM as a selector, and for an NVLink-wanting multi-GPU
    pod the clique constraint (`preferred` adds an unconstrained last subrequest). A plain pod keeps
    KEP-5004's."""
    if encoding_ not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding_!r}; known: {', '.join(ENCODINGS)}")
    if encoding_ == "none" or not opted_in:
        return unconstrained_claim(request.gpus)
    shape = claim_shape(request, list_attributes=encoding_ == "list")
    return claim_from_spec(device_claim(shape), shape.min_memory_mib or 0)


# --------------------------------------------------------------------------------------------------
# The allocator


Values = frozenset[tuple[str, object]]  # an attribute's values as a set of (type, value)


def _values(v: object) -> Values:
    items = v if isinstance(v, tuple) else (v,)
    # Typed: upstream never matches an int against a string or a bool (and Python's True == 1).
    return frozenset((type(x).__name__, x) for x in items)


class NodeDevices:
    """A node's published devices in slice order, with what the allocator reads of them cached."""

    def __init__(self, published: Sequence[Device]) -> None:
        self.devices = tuple(published)
        self.position = {d.name: i for i, d in enumerate(self.devices)}
        if len(self.position) != len(self.devices):
            raise ValueError("devices: device names repeat")
        self._attr: dict[str, tuple[Values | None, ...]] = {}

    def __len__(self) -> int:
        return len(self.devices)

    def values(self, attribute: str) -> tuple[Values | None, ...]:
        """Per device, the attribute's values (None: the device lacks it), looked up as upstream does:
        the full name, else the bare name when the domain is the driver's."""
        cached = self._attr.get(attribute)
        if cached is None:
            domain, _, bare = attribute.partition("/")
            out: list[Values | None] = []
            for d in self.devices:
                v = d.attributes.get(attribute)
                if v is None and domain == DRIVER:
                    v = d.attributes.get(bare)
                out.append(None if v is None else _values(v))
            cached = tuple(out)
            self._attr[attribute] = cached
        return cached


@dataclass(frozen=True)
class Allocation:
    subrequest: str  # the subrequest that was met
    devices: tuple[str, ...]  # device names, in the order chosen
    gpus: tuple[int, ...]  # their GPU indices, ascending


def _first_fit(cands: Sequence[int], values: Sequence[Values | None] | None, k: int) -> tuple[int, ...] | None:
    """The first `k` of `cands` (positions, ascending) that meet the constraint, depth first."""
    chosen: list[int] = []

    def dfs(start: int, common: Values | None) -> bool:
        if len(chosen) == k:
            return True
        for j in range(start, len(cands) - (k - len(chosen)) + 1):
            pos = cands[j]
            nxt = common
            if values is not None:
                v = values[pos]
                if v is None:
                    continue
                nxt = v if common is None else common & v
                if not nxt:
                    continue
            chosen.append(pos)
            if dfs(j + 1, nxt):
                return True
            chosen.pop()
        return False

    return tuple(chosen) if dfs(0, None) else None


def allocate(node: NodeDevices | Sequence[Device], claim: Claim, allocated: Collection[str] = ()) -> Allocation | None:
    """The devices kube-scheduler's allocator gives `claim` on a node whose `allocated` devices (by
    name) are taken, or None when it cannot be met there."""
    nd = node if isinstance(node, NodeDevices) else NodeDevices(node)
    unknown = [a for a in allocated if a not in nd.position]
    if unknown:
        raise ValueError(f"allocated: no such device on the node: {', '.join(sorted(unknown))}")
    taken = {nd.position[a] for a in allocated}
    for sub in claim.subrequests:
        cands = [
            i
            for i, d in enumerate(nd.devices)
            if i not in taken and not d.failed and d.memory_mib >= sub.min_memory_mib
        ]
        if len(cands) < sub.count:
            continue
        values = nd.values(sub.match_attribute) if sub.match_attribute else None
        got = _first_fit(cands, values, sub.count)
        if got is not None:
            names = tuple(nd.devices[i].name for i in got)
            return Allocation(sub.name, names, tuple(sorted(nd.devices[i].index for i in got)))
    return None
