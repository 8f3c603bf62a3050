"""The ResourceClaimTemplate a gputopo pod's request becomes under DRA (resource.k8s.io/v1). Pure.

One device request, `gpus`, asks for N devices of the DeviceClass `gpu.gputopo.io`; a minimum HBM is a
CEL selector on each device's `memory` capacity. The NVLink policy picks the constraint, in one of the
two encodings gputopo.engine.dra.devices publishes:

- `required`, N >= 2, **list attributes**: one `matchAttribute` on `nvlinkCliques` over the request. A
  list attribute matches when the chosen devices' lists intersect (KEP-5491), which for maximal-clique
  ids is exactly "fully NVLink-connected".
- `required`, N >= 2, **scalar partitions**: `firstAvailable`, one subrequest `p<k>` per partition,
  each constrained (`requests: ["gpus/p<k>"]`) to share `nvlinkPartition<k>`. The allocator tries the
  subrequests in order and a constraint that names a subrequest binds only when that one is chosen
  (k8s.io/dynamic-resource-allocation v0.34 `matchAttributeConstraint.matches`).
- `preferred`: the same, then a last subrequest `any` with no constraint: a clique where one is free,
  else any N devices.
- `ignore`, or one GPU: no constraint.
- **blocks** (`blocks`, the agents publish clique blocks: `--dra-blocks`), N a block size: `firstAvailable`
  starts with one subrequest `block`, one device of the class `clique<N>.gpu.gputopo.io` (a whole
  NVLink clique, no constraint needed), and goes on with the subrequests above: N single GPUs of one
  clique when no whole block is free (a block whose GPU is taken is no longer free, but the clique's
  other GPUs may still be). A minimum HBM per GPU is, on the block, N times that on its `memory` (N
  times its smallest GPU's).

The API's limits (k8s.io/api v0.34 resource/v1) that bound what this builds, checked by `check_spec`:
at most 32 devices allocated per claim (`AllocationResultsMaxSize`), 8 subrequests
(`FirstAvailableDeviceRequestMaxSize`), 32 constraints and 32 selectors, a CEL expression of at most
10 KiB; the one expression built here is a single capacity comparison, far below the CEL cost limit.

A template's name comes from the request's shape (`gputopo-gpus-4-nvlink-80gi-<digest>`): pods of the
same shape in a namespace share one template, and the digest of the spec keeps a template that an
older or differently configured gputopo made under the same shape from being taken for this one.

The minimum HBM rounds up to a memory class (`MEMORY_CLASSES_MIB`: the per-GPU memory of every named
system, as NVML reports it), so the shapes, and with them the templates of a namespace, are a bounded
set (a pod could otherwise name a new template per MiB). Rounding up never gives less than asked, and
among the named systems' GPUs a request selects exactly those its class selects; a request above the
largest class is refused, naming both.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gputopo.engine.dra.devices import (
    ATTR_CLIQUES,
    CAPACITY_MEMORY,
    DEVICE_CLASS,
    DRIVER,
    PARTITIONS,
    partition_attribute,
    qualified,
)
from gputopo.model.claimtemplate import MANAGED_BY, MANAGED_BY_LABEL, SPEC_DIGEST_ANNOTATION
from gputopo.model.dra import BLOCK_SIZES, TEMPLATE_PREFIX, block_class, template_gpus
from gputopo.model.request import NvlinkPolicy, PodRequest
from gputopo.systems import SYSTEMS

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceClaimTemplate"
REQUEST = "gpus"  # the one device request; also the pod's claim name (gputopo.extender.webhook.mutation)
ANY_SUBREQUEST = "any"  # the unconstrained fallback of `preferred`
CLIQUE_SUBREQUEST = "clique"  # the constrained subrequest of `preferred` with list attributes
BLOCK_SUBREQUEST = "block"  # one whole clique block, tried first where the agents publish blocks
DEVICE_CLASSES = frozenset({DEVICE_CLASS, *(block_class(s) for s in BLOCK_SIZES)})
NAME_PREFIX = TEMPLATE_PREFIX
# Every template gputopo makes carries MANAGED_BY_LABEL and the digest of its spec, SPEC_DIGEST_ANNOTATION
# (declared by gputopo.model.claimtemplate, which reads the templates back).

# k8s.io/api resource/v1 (v0.34.4) limits.
MAX_DEVICES_PER_CLAIM = 32  # AllocationResultsMaxSize
MAX_SUBREQUESTS = 8  # FirstAvailableDeviceRequestMaxSize
MAX_CONSTRAINTS = 32  # DeviceConstraintsMaxSize
MAX_SELECTORS = 32  # DeviceSelectorsMaxSize
MAX_CEL_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength
MAX_NAME_LENGTH = 63  # the template's name: a DNS label, so that it also fits label values
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DIGEST_CHARS = 8


def _system_memory_classes() -> tuple[int, ...]:
    return tuple(sorted({g.memory_mib for build in SYSTEMS.values() for g in build("class").gpus if g.memory_mib}))


# The minimum-HBM classes a claim asks for, in MiB (docs/annotations.md, "Claims under DRA").
MEMORY_CLASSES_MIB: tuple[int, ...] = _system_memory_classes()


class ClaimError(ValueError):
    """A request that no ResourceClaim can express; the message names the request's field."""


@dataclass(frozen=True)
class ClaimShape:
    """What of a pod's request a claim carries: the GPU count, the NVLink policy as it applies to that
    count, the minimum HBM per GPU, and which clique encoding the cluster's devices carry."""

    gpus: int
    nvlink: NvlinkPolicy
    min_memory_mib: int | None
    list_attributes: bool
    blocks: bool = False  # the agents publish clique blocks (--dra-blocks)

    @property
    def constrained(self) -> bool:
        return self.gpus >= 2 and self.nvlink is not NvlinkPolicy.IGNORE

    @property
    def block_first(self) -> bool:
        """The claim asks for one whole block first: blocks are published and N is a block size."""
        return self.blocks and self.constrained and self.gpus in BLOCK_SIZES


def memory_class(mib: int, classes: tuple[int, ...] = MEMORY_CLASSES_MIB) -> int:
    """The smallest class of at least `mib` MiB; ClaimError naming the value and the largest class when
    there is none."""
    for c in classes:
        if c >= mib:
            return c
    largest = memory_quantity(classes[-1]) if classes else "none"
    raise ClaimError(
        f"gputopo.io/min-gpu-memory: {memory_quantity(mib)} is above the largest GPU memory class "
        f"({largest}): no known GPU has that much"
    )


def claim_shape(
    request: PodRequest,
    *,
    list_attributes: bool,
    memory_classes: tuple[int, ...] = MEMORY_CLASSES_MIB,
    blocks: bool = False,
) -> ClaimShape:
    """The claim's shape of `request`, its minimum HBM rounded up to one of `memory_classes`; ClaimError
    when its GPU count is 0 or over a claim's limit, or its HBM above every class."""
    n = request.gpus
    if n < 1:
        raise ClaimError(f"nvidia.com/gpu: {n}: a claim asks for at least 1 GPU")
    if n > MAX_DEVICES_PER_CLAIM:
        raise ClaimError(
            f"nvidia.com/gpu: {n}: a ResourceClaim allocates at most {MAX_DEVICES_PER_CLAIM} devices "
            "(resource.k8s.io/v1 AllocationResultsMaxSize)"
        )
    memory = request.min_gpu_memory_mib
    if memory is not None and memory < 1:
        memory = None  # "at least 0 bytes" asks for nothing
    if memory is not None:
        memory = memory_class(memory, memory_classes)
    # One GPU is always "connected": every policy gives the same claim, so they share one template.
    nvlink = request.nvlink if n >= 2 else NvlinkPolicy.IGNORE
    return ClaimShape(n, nvlink, memory, list_attributes, blocks)


def memory_quantity(mib: int) -> str:
    """A MiB amount as the Kubernetes quantity a CEL `quantity()` reads: `80Gi`, `40000Mi`."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def memory_selector(mib: int) -> str:
    """The CEL expression of "at least `mib` MiB of HBM" on our devices' `memory` capacity."""
    return f'device.capacity["{DRIVER}"].{CAPACITY_MEMORY}.compareTo(quantity("{memory_quantity(mib)}")) >= 0'


def _selectors(shape: ClaimShape) -> list[dict[str, Any]]:
    if shape.min_memory_mib is None:
        return []
    return [{"cel": {"expression": memory_selector(shape.min_memory_mib)}}]


def _devices(shape: ClaimShape, name: str) -> dict[str, Any]:
    """An `exactly` request or a subrequest: the class, the count, the selectors."""
    out: dict[str, Any] = {"name": name} if name else {}
    out["deviceClassName"] = DEVICE_CLASS
    out["allocationMode"] = "ExactCount"  # written out: the API server would default it, and compare equal
    out["count"] = shape.gpus
    selectors = _selectors(shape)
    if selectors:
        out["selectors"] = selectors
    return out


def _block(shape: ClaimShape) -> dict[str, Any]:
    """The subrequest for one whole block of `shape.gpus`: its `memory` is N times its smallest GPU's."""
    out: dict[str, Any] = {"name": BLOCK_SUBREQUEST, "deviceClassName": block_class(shape.gpus)}
    out["allocationMode"] = "ExactCount"
    out["count"] = 1
    if shape.min_memory_mib is not None:
        out["selectors"] = [{"cel": {"expression": memory_selector(shape.min_memory_mib * shape.gpus)}}]
    return out


def device_claim(shape: ClaimShape) -> dict[str, Any]:
    """The claim's `spec.devices` (resource.k8s.io/v1 DeviceClaim) for `shape`."""
    if not shape.constrained:
        return {"requests": [{"name": REQUEST, "exactly": _devices(shape, "")}]}
    preferred = shape.nvlink is NvlinkPolicy.PREFERRED
    if shape.list_attributes and not preferred and not shape.block_first:
        return {
            "requests": [{"name": REQUEST, "exactly": _devices(shape, "")}],
            "constraints": [{"requests": [REQUEST], "matchAttribute": qualified(ATTR_CLIQUES)}],
        }
    subrequests: list[dict[str, Any]] = [_block(shape)] if shape.block_first else []
    constraints: list[dict[str, Any]] = []
    if shape.list_attributes:
        subrequests.append(_devices(shape, CLIQUE_SUBREQUEST))
        constraints.append({"requests": [f"{REQUEST}/{CLIQUE_SUBREQUEST}"], "matchAttribute": qualified(ATTR_CLIQUES)})
    else:
        for p in range(PARTITIONS):
            sub = f"p{p}"
            subrequests.append(_devices(shape, sub))
            constraints.append({"requests": [f"{REQUEST}/{sub}"], "matchAttribute": qualified(partition_attribute(p))})
    if preferred:
        subrequests.append(_devices(shape, ANY_SUBREQUEST))
    return {"requests": [{"name": REQUEST, "firstAvailable": subrequests}], "constraints": constraints}


def _digest(devices: Mapping[str, Any]) -> str:
    text = json.dumps(devices, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def template_name(shape: ClaimShape) -> str:
    """The template's name: the shape in words, then a digest of the spec (a DNS label, <= 63)."""
    parts = [NAME_PREFIX, str(shape.gpus)]
    if shape.constrained:
        parts.append("nvlink" if shape.nvlink is NvlinkPolicy.REQUIRED else "nvlink-preferred")
    if shape.min_memory_mib is not None:
        parts.append(memory_quantity(shape.min_memory_mib).lower())
    parts.append(_digest(device_claim(shape))[:_DIGEST_CHARS])
    return "-".join(parts)


@dataclass(frozen=True)
class ClaimTemplate:
    """A ResourceClaimTemplate to ensure in a namespace: its name, its spec's digest, the object."""

    name: str
    digest: str
    devices: Mapping[str, Any]

    def body(self, namespace: str) -> dict[str, Any]:
        """The object to create in `namespace`."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {
                "name": self.name,
                "namespace": namespace,
                "labels": {MANAGED_BY_LABEL: MANAGED_BY},
                "annotations": {SPEC_DIGEST_ANNOTATION: self.digest},
            },
            "spec": {"spec": {"devices": json.loads(json.dumps(self.devices))}},
        }


def memory_classes(extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The memory classes, with `extra` figures (MiB, the cluster's other GPUs as NVML reports them)."""
    return tuple(sorted(set(MEMORY_CLASSES_MIB) | {m for m in extra if m > 0}))


def claim_template(
    request: PodRequest,
    *,
    list_attributes: bool,
    memory_classes: tuple[int, ...] = MEMORY_CLASSES_MIB,
    blocks: bool = False,
) -> ClaimTemplate:
    """The template a pod with `request` gets its claim from. `list_attributes`: the cluster's devices
    carry `nvlinkCliques` (the `DRAListTypeAttributes` gate); else the scalar partitions are used.
    `memory_classes`: what the minimum HBM rounds up to. `blocks`: the agents publish clique blocks, so a
    clique of a block size asks for a whole block first. Raises ClaimError (naming the field) for a
    request no claim can express."""
    shape = claim_shape(request, list_attributes=list_attributes, memory_classes=memory_classes, blocks=blocks)
    devices = device_claim(shape)
    check_spec(devices)
    return ClaimTemplate(template_name(shape), _digest(devices), devices)


def template_named(
    name: str, *, list_attributes: bool, memory_classes: tuple[int, ...] = MEMORY_CLASSES_MIB, blocks: bool = False
) -> ClaimTemplate | None:
    """The template this module makes under `name`, or None when it makes none of that name (another
    encoding, another version's digest, a name someone made up). The candidates are few: the count is in
    the name, then 3 policies times the memory classes."""
    gpus = template_gpus(name)
    if gpus is None or not 1 <= gpus <= MAX_DEVICES_PER_CLAIM:
        return None
    for nvlink in NvlinkPolicy:
        for mib in (None, *memory_classes):
            request = PodRequest(gpus=gpus, nvlink=nvlink, min_gpu_memory_mib=mib)
            template = claim_template(
                request, list_attributes=list_attributes, memory_classes=memory_classes, blocks=blocks
            )
            if template.name == name:
                return template
    return None


def _attribute_names(devices: Mapping[str, Any]) -> Iterator[str]:
    for c in devices.get("constraints", ()):
        yield str(c["matchAttribute"])


def check_spec(devices: Mapping[str, Any]) -> None:
    """Raise ClaimError when a built DeviceClaim breaks a resource/v1 limit or names an attribute that
    is not ours. Every spec this module builds passes; the check keeps it so as the module changes."""
    requests = devices.get("requests", [])
    constraints = devices.get("constraints", [])
    if len(constraints) > MAX_CONSTRAINTS:
        raise ClaimError(f"{len(constraints)} constraints: resource/v1 allows {MAX_CONSTRAINTS}")
    names: set[str] = set()
    for r in requests:
        if not _DNS_LABEL.fullmatch(r["name"]):
            raise ClaimError(f"request name {r['name']!r} is not a DNS label")
        subs = r.get("firstAvailable")
        if subs is None:
            _check_devices(r["exactly"], r["name"])
            names.add(r["name"])
            continue
        if not 1 <= len(subs) <= MAX_SUBREQUESTS:
            raise ClaimError(f"request {r['name']}: {len(subs)} subrequests; resource/v1 allows 1..{MAX_SUBREQUESTS}")
        names.add(r["name"])
        for s in subs:
            if not _DNS_LABEL.fullmatch(s["name"]):
                raise ClaimError(f"subrequest name {s['name']!r} is not a DNS label")
            _check_devices(s, f"{r['name']}/{s['name']}")
            names.add(f"{r['name']}/{s['name']}")
    for c in constraints:
        for ref in c.get("requests", ()):
            if ref not in names:
                raise ClaimError(f"constraint names {ref!r}, which is no request or subrequest of the claim")
    for attr in _attribute_names(devices):
        if not attr.startswith(f"{DRIVER}/"):
            raise ClaimError(f"constraint on {attr!r}: not an attribute of {DRIVER}")


def _check_devices(d: Mapping[str, Any], where: str) -> None:
    if d["deviceClassName"] not in DEVICE_CLASSES:
        raise ClaimError(f"{where}: device class {d['deviceClassName']!r} is not one of {DRIVER}'s")
    if not 1 <= d["count"] <= MAX_DEVICES_PER_CLAIM:
        raise ClaimError(f"{where}: count {d['count']}: resource/v1 allocates 1..{MAX_DEVICES_PER_CLAIM}")
    selectors = d.get("selectors", [])
    if len(selectors) > MAX_SELECTORS:
        raise ClaimError(f"{where}: {len(selectors)} selectors; resource/v1 allows {MAX_SELECTORS}")
    for s in selectors:
        if len(s["cel"]["expression"]) > MAX_CEL_LENGTH:
            raise ClaimError(f"{where}: a CEL selector over {MAX_CEL_LENGTH} characters")
