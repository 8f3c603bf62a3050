"""A pod's placement request: its GPU count and its `gputopo.io/*` annotations, validated."""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

from gputopo.model.base import AnnotationError, LabelError
from gputopo.model.dra import block_resource
from gputopo.model.jobs import InferredGroup
from gputopo.model.k8snames import ascii_int
from gputopo.model.names import GPU_RESOURCE, PLACEMENT_ANNOTATION, PREFIX
from gputopo.model.quantity import MAX_QUANTITY, parse_quantity_bytes
from gputopo.model.topology import NicInfo

# The annotations a pod opts in with (docs/annotations.md).
ANN_NVLINK = "gputopo.io/nvlink"
ANN_MIN_GPU_MEMORY = "gputopo.io/min-gpu-memory"
ANN_GROUP = "gputopo.io/group"
ANN_GROUP_SIZE = "gputopo.io/group-size"
ANN_STAGE = "gputopo.io/stage"
ANN_NETWORK = "gputopo.io/network"
ANN_SPREAD = "gputopo.io/spread"
ANN_REQUIRED_TIER = "gputopo.io/required-tier"
ANN_PREFERRED_TIER = "gputopo.io/preferred-tier"
ANN_MESSAGE_SIZE = "gputopo.io/message-size"
ANN_TP_SIZE = "gputopo.io/tp-size"
POD_OPT_IN_ANNOTATIONS = (
    ANN_NVLINK,
    ANN_MIN_GPU_MEMORY,
    ANN_GROUP,
    ANN_GROUP_SIZE,
    ANN_STAGE,
    ANN_NETWORK,
    ANN_SPREAD,
    ANN_REQUIRED_TIER,
    ANN_PREFERRED_TIER,
    ANN_MESSAGE_SIZE,
    ANN_TP_SIZE,
)
# Written by gputopo itself; present on pods but not part of the user's request.
POD_OUTPUT_ANNOTATIONS = (PLACEMENT_ANNOTATION,)


class NvlinkPolicy(StrEnum):
    REQUIRED = "required"
    PREFERRED = "preferred"
    IGNORE = "ignore"


class NetworkKind(StrEnum):
    INFINIBAND = "infiniband"
    ROCE = "roce"
    RDMA = "rdma"
    ANY = "any"

    def accepts(self, nic: NicInfo) -> bool:
        if not nic.active:
            return False
        if self is NetworkKind.ANY or self is NetworkKind.RDMA:
            return True
        return nic.rdma_kind == self.value


class Spread(StrEnum):
    NODE = "node"
    NONE = "none"


_NAME = re.compile(r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$")


# `gputopo.io/message-size`: the bytes of one all-reduce the communication estimate assumes. 1 GiB by
# default; at most 1 TiB (a larger single collective exceeds any GPU's memory, so it is a typo).
DEFAULT_MESSAGE_BYTES = 1 << 30
MAX_MESSAGE_BYTES = 1 << 40


class PodRequest(BaseModel):
    """A pod's placement request: its GPU count plus its parsed `gputopo.io/*` annotations."""

    model_config = ConfigDict(frozen=True)

    gpus: int
    nvlink: NvlinkPolicy = NvlinkPolicy.REQUIRED
    min_gpu_memory_mib: int | None = None
    group: str | None = None
    group_size: int | None = None
    # The size is a minimum (a native PodGroup's minCount, mutable on 1.37): once that many members
    # exist, every member present is planned, and later ones join around those placed.
    group_size_at_least: bool = False
    stage: int | None = None
    network: NetworkKind = NetworkKind.ANY
    spread: Spread = Spread.NODE
    required_tier: str | None = None
    preferred_tier: str | None = None
    message_bytes: int = DEFAULT_MESSAGE_BYTES
    # GPUs per tensor-parallel group (`gputopo.io/tp-size`): consecutive members (in stage order) whose
    # GPUs add up to it form one TP group, which must lie in one NVLink domain. None: each member's own.
    tp_size: int | None = None
    # The ComputeDomain whose IMEX channel the pod claims (namespace/ResourceClaimTemplate), read from the
    # pod's resource claims by the extender, never from an annotation: its pods share one NVLink domain.
    compute_domain: str | None = None
    # One whole clique block of `gpus` (`gputopo.io/gpu-clique<N>: 1`, gputopo.model.blockrequest): the
    # allocator hands out one of the blocks the node publishes, so the engine chooses among those.
    block: bool = False

    @property
    def is_group(self) -> bool:
        return self.group is not None


def is_gputopo_pod(annotations: Mapping[str, str] | None) -> bool:
    """True when the pod opted in: at least one `gputopo.io/` annotation of the request."""
    return bool(annotations) and any(
        k.startswith(PREFIX) and k not in POD_OUTPUT_ANNOTATIONS for k in (annotations or {})
    )


def _enum(key: str, value: str, enum: type[StrEnum]) -> Any:
    try:
        return enum(value.strip())
    except ValueError:
        raise AnnotationError(key, value, "must be one of " + ", ".join(e.value for e in enum)) from None


def _int(key: str, value: str, lo: int, hi: int) -> int:
    """ASCII digits only, from `lo` to `hi` (gputopo.model.k8snames.ascii_int): `int()` would also take
    `٤`, `1_0`, `+4` and ` 4 `, which Kubernetes' own parsers refuse."""
    v = ascii_int(value, lo, hi)
    if v is None:
        raise AnnotationError(key, value, f"must be an integer between {lo} and {hi} (ASCII digits only)")
    return v


def parse_pod_request(
    annotations: Mapping[str, str] | None,
    gpus: int,
    tiers: tuple[str, ...] = ("spine", "leaf", "nvlink-domain"),
    inferred: InferredGroup | None = None,
    block: int = 0,
) -> PodRequest:
    """Validate a pod's `gputopo.io/*` annotations. Raises AnnotationError on the first bad one.

    `inferred`: the group the pod's controller labels give (gputopo.model.jobs, with its size known);
    each of `group`, `group-size` and `stage` given as an annotation overrides its inferred value.
    `block`: the pod asks one whole block of that many GPUs (`gpus` is then the same count), which is one
    NVLink clique whatever it says: a `gputopo.io/nvlink` other than `required` contradicts it."""
    ann = {k: v for k, v in (annotations or {}).items() if k.startswith(PREFIX)}
    for key, value in ann.items():
        if key not in POD_OPT_IN_ANNOTATIONS and key not in POD_OUTPUT_ANNOTATIONS:
            raise AnnotationError(key, value, "unknown gputopo annotation; known: " + ", ".join(POD_OPT_IN_ANNOTATIONS))
    fields: dict[str, Any] = {"gpus": gpus}
    if ANN_NVLINK in ann:
        fields["nvlink"] = _enum(ANN_NVLINK, ann[ANN_NVLINK], NvlinkPolicy)
    if block:
        if fields.get("nvlink", NvlinkPolicy.REQUIRED) is not NvlinkPolicy.REQUIRED:
            raise AnnotationError(
                ANN_NVLINK, ann[ANN_NVLINK], f"a {block}-GPU block ({block_resource(block)}) is one NVLink clique"
            )
        fields["block"] = True
    if ANN_MIN_GPU_MEMORY in ann:
        v = ann[ANN_MIN_GPU_MEMORY]
        try:
            fields["min_gpu_memory_mib"] = -(-parse_quantity_bytes(v) // (1024 * 1024))
        except ValueError as e:
            raise AnnotationError(ANN_MIN_GPU_MEMORY, v, str(e)) from None
    if ANN_MESSAGE_SIZE in ann:
        v = ann[ANN_MESSAGE_SIZE]
        try:
            size = parse_quantity_bytes(v)
        except ValueError as e:
            raise AnnotationError(ANN_MESSAGE_SIZE, v, str(e)) from None
        if not 1 <= size <= MAX_MESSAGE_BYTES:
            raise AnnotationError(ANN_MESSAGE_SIZE, v, "must be between 1 byte and 1Ti")
        fields["message_bytes"] = size
    if ANN_TP_SIZE in ann:
        fields["tp_size"] = _tp_size(ann[ANN_TP_SIZE], gpus)
    if ANN_NETWORK in ann:
        fields["network"] = _enum(ANN_NETWORK, ann[ANN_NETWORK], NetworkKind)
    if ANN_SPREAD in ann:
        fields["spread"] = _enum(ANN_SPREAD, ann[ANN_SPREAD], Spread)
    for key, name in ((ANN_REQUIRED_TIER, "required_tier"), (ANN_PREFERRED_TIER, "preferred_tier")):
        if key in ann:
            t = ann[key].strip()
            if t not in tiers:
                raise AnnotationError(key, ann[key], "unknown tier; configured tiers: " + ", ".join(tiers))
            fields[name] = t
    if ANN_REQUIRED_TIER not in ann and inferred is not None and inferred.required_tier is not None:
        fields["required_tier"] = inferred.required_tier  # a PodGroup's topology constraint
    fields.update(_group_fields(ann, inferred))
    if not 0 <= gpus <= MAX_QUANTITY:
        raise AnnotationError(GPU_RESOURCE, str(gpus), f"GPU count must be between 0 and {MAX_QUANTITY}")
    return PodRequest(**fields)


def _tp_size(value: str, gpus: int) -> int:
    """`gputopo.io/tp-size`: a TP group is whole pods (a multiple of the pod's GPUs) or lies in one pod
    (a divisor of them); a pod without GPUs (a driver) takes part in none, so any size passes there."""
    tp = _int(ANN_TP_SIZE, value, 1, 4096)
    if gpus > 0 and tp % gpus and gpus % tp:
        raise AnnotationError(
            ANN_TP_SIZE, value, f"must be a multiple of the pod's {gpus} GPUs (whole pods) or divide them"
        )
    return tp


def _group_fields(ann: Mapping[str, str], inferred: InferredGroup | None) -> dict[str, Any]:
    """`group`, `group_size`, `stage` (and the spread an inferred gang implies) from the annotations,
    each overriding what the controller's labels give (`inferred`)."""
    fields: dict[str, Any] = {}
    if ANN_GROUP in ann:
        g = ann[ANN_GROUP].strip()
        if not _NAME.fullmatch(g):
            raise AnnotationError(ANN_GROUP, ann[ANN_GROUP], "must be a DNS-1123 name (lower case, digits, - . _)")
        fields["group"] = g
        if ANN_GROUP_SIZE not in ann and (inferred is None or inferred.size is None):
            raise AnnotationError(ANN_GROUP, ann[ANN_GROUP], f"needs {ANN_GROUP_SIZE} as well")
    elif inferred is not None:
        fields["group"] = inferred.group
        if ANN_SPREAD not in ann:
            # A controller's gang packs members that take part of a node (docs/annotations.md, "Jobs");
            # members of whole nodes are one per node either way.
            fields["spread"] = Spread.NONE
    if ANN_GROUP_SIZE in ann:
        if "group" not in fields:
            raise AnnotationError(ANN_GROUP_SIZE, ann[ANN_GROUP_SIZE], f"needs {ANN_GROUP} as well")
        fields["group_size"] = _int(ANN_GROUP_SIZE, ann[ANN_GROUP_SIZE], 1, 4096)
    elif inferred is not None and inferred.size is not None:
        fields["group_size"] = inferred.size
        if inferred.at_least:
            fields["group_size_at_least"] = True
    group_size = fields.get("group_size")
    if ANN_STAGE in ann:
        if group_size is None:
            raise AnnotationError(ANN_STAGE, ann[ANN_STAGE], f"needs {ANN_GROUP} and {ANN_GROUP_SIZE}")
        fields["stage"] = _int(ANN_STAGE, ann[ANN_STAGE], 0, group_size - 1)
    elif inferred is not None and inferred.rank is not None and group_size is not None:
        if inferred.rank >= group_size:
            raise LabelError(
                inferred.rank_label,
                str(inferred.rank),
                f"rank {inferred.rank} is not below {ANN_GROUP_SIZE} {group_size}",
            )
        fields["stage"] = inferred.rank
    if "group" in fields and group_size is None:  # an inferred group whose size is not known yet
        why = inferred.waiting if inferred is not None else "needs a size"
        raise AnnotationError(ANN_GROUP_SIZE, "", f"group {fields['group']}: size not known: {why}")
    return fields
