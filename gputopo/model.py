"""Wire models of every gputopo annotation and label (docs/annotations.md describes them for users).

These are the only shapes that cross process boundaries between the agent, the extender, the CLI and
the simulator. They validate strictly: an unknown schema version or a malformed value is an error that
names the annotation and the value, never a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from enum import IntEnum, StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PREFIX = "gputopo.io/"
TOPOLOGY_ANNOTATION = "gputopo.io/topology"
GPUS_IN_USE_ANNOTATION = "gputopo.io/gpus-in-use"
PLACEMENT_ANNOTATION = "gputopo.io/placement"

LABEL_NVLINK_DOMAIN = "gputopo.io/nvlink-domain"
LABEL_NVSWITCH = "gputopo.io/nvswitch"
LABEL_RDMA = "gputopo.io/rdma"
LABEL_GPU_MEMORY_GIB = "gputopo.io/gpu-memory-gib"
NODE_LABEL_KEYS = (LABEL_NVLINK_DOMAIN, LABEL_NVSWITCH, LABEL_RDMA, LABEL_GPU_MEMORY_GIB)

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
)
# Written by gputopo itself; present on pods but not part of the user's request.
POD_OUTPUT_ANNOTATIONS = (PLACEMENT_ANNOTATION,)

GPU_RESOURCE = "nvidia.com/gpu"
SCHEMA_VERSION = 1


class AnnotationError(ValueError):
    """A gputopo annotation or label whose value cannot be used; the message names both."""

    def __init__(self, key: str, value: str, why: str) -> None:
        self.key = key
        self.value = value
        self.why = why
        super().__init__(f"invalid annotation {key}={_short(value)}: {why}")


def _short(value: str, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 4] + '…"'


class _Wire(BaseModel):
    """Base for wire models: camelCase aliases, both spellings accepted, unknown keys rejected."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------------
# Ordered link and distance types (one score table lives in gputopo.engine.scoring).


class PcieDistance(StrEnum):
    """nvidia-smi's PCIe distance legend, nearest first."""

    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"

    @property
    def rank(self) -> int:
        return _PCIE_RANK[self]


_PCIE_RANK = {d: i for i, d in enumerate(PcieDistance)}


class LinkType(IntEnum):
    """How two GPUs talk, weakest first; NVLink pairs carry their link count separately."""

    CROSS_CPU = 0  # SYS
    SAME_CPU = 1  # NODE
    HOST_BRIDGE = 2  # PHB
    MULTI_SWITCH = 3  # PXB
    SINGLE_SWITCH = 4  # PIX
    NVLINK = 5


class Health(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"


class LinkState(StrEnum):
    DOWN = "down"
    DEGRADED = "degraded"


class LinkLayer(StrEnum):
    INFINIBAND = "InfiniBand"
    ETHERNET = "Ethernet"  # RoCE


# --------------------------------------------------------------------------------------------------
# gputopo.io/topology

# Value bounds. They stop a corrupt or hostile document from costing the extender real work or breaking
# arithmetic (a 0 MiB GPU divides by zero in scoring, an infinite rate poisons every comparison), while
# leaving wide headroom over real hardware:
# - 64 GPUs per node: the largest single hosts ship 16 (DGX-2, HGX-2), NVL72 trays hold 4 per host;
#   64 also keeps the NVLink matrix at 4,096 entries and GPU bitmasks small.
# - 64 NVLink links between two GPUs or per GPU: an H100/B200 has 18 in all.
# - 100,000 Gb/s for an NVLink link or a NIC: today's fastest NICs run at 800 Gb/s (1.6 Tb/s next).
# - 1 PiB of memory per GPU: the largest HBM today is 288 GB.
# - 64 NICs per node, 256 characters per name or identifier, 1,024 per free-text detail.
MAX_GPUS_PER_NODE = 64
MAX_NVLINKS = 64
MAX_LINK_GBPS = 100_000.0
MAX_GPU_MEMORY_MIB = 1024**3
MAX_NICS_PER_NODE = 64
MAX_NAME_LENGTH = 256
MAX_TEXT_LENGTH = 1024
MAX_REASONS = 32

_Name = Annotated[str, Field(max_length=MAX_NAME_LENGTH)]
_Text = Annotated[str, Field(max_length=MAX_TEXT_LENGTH)]
_Gbps = Annotated[float, Field(ge=0, le=MAX_LINK_GBPS, allow_inf_nan=False)]
_NumaNode = Annotated[int, Field(ge=-1, le=4096)]  # -1: the kernel does not know


class GpuInfo(_Wire):
    index: Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)]
    uuid: _Name
    model: _Name
    memory_mib: Annotated[int, Field(alias="memoryMiB", ge=0, le=MAX_GPU_MEMORY_MIB)]
    pci_bus_id: _Name = Field(alias="pciBusId", default="")
    numa_node: _NumaNode | None = Field(alias="numaNode", default=None)
    health: Health = Health.OK
    reasons: Annotated[tuple[_Text, ...], Field(max_length=MAX_REASONS)] = ()

    @model_validator(mode="after")
    def _memory_known_unless_failed(self) -> GpuInfo:
        # A GPU that fell off the bus reports no memory; it is never chosen, so 0 is harmless there.
        # Anywhere else 0 MiB is a corrupt report (and would divide by zero in scoring).
        if self.memory_mib == 0 and self.health is not Health.FAILED:
            raise ValueError(f"GPU {self.index}: memoryMiB must be > 0 unless the GPU is failed")
        return self


class NvlinkInfo(_Wire):
    generation: Annotated[int, Field(ge=0, le=64)] = 0
    gbps_per_link: _Gbps = Field(alias="gbpsPerLink", default=0.0)
    nvswitch: bool = False
    links: Annotated[
        tuple[
            Annotated[tuple[Annotated[int, Field(ge=0, le=MAX_NVLINKS)], ...], Field(max_length=MAX_GPUS_PER_NODE)], ...
        ],
        Field(max_length=MAX_GPUS_PER_NODE),
    ] = ()

    @field_validator("links")
    @classmethod
    def _square_symmetric(cls, links: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        n = len(links)
        # Every row's length first: the symmetry check below reads links[j][i] for rows not seen yet.
        for i, row in enumerate(links):
            if len(row) != n:
                raise ValueError(f"links row {i} has {len(row)} entries, expected {n}")
        for i, row in enumerate(links):
            if row[i] != 0:
                raise ValueError(f"links[{i}][{i}] must be 0")
            for j, v in enumerate(row):
                if v < 0:
                    raise ValueError(f"links[{i}][{j}] is negative")
                if links[j][i] != v:
                    raise ValueError(f"links is not symmetric at [{i}][{j}]")
        return links


class DegradedLink(_Wire):
    gpu: Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)]
    link: Annotated[int, Field(ge=0, lt=MAX_NVLINKS)]
    state: LinkState
    detail: _Text = ""


class FabricInfo(_Wire):
    clique: _Name


class NicInfo(_Wire):
    name: _Name
    link_layer: LinkLayer = Field(alias="linkLayer")
    state: _Name
    rate_gbps: _Gbps = Field(alias="rateGbps")
    numa_node: _NumaNode | None = Field(alias="numaNode", default=None)
    pci_bus_id: _Name = Field(alias="pciBusId", default="")
    gpu_affinity: Annotated[tuple[PcieDistance, ...], Field(max_length=MAX_GPUS_PER_NODE)] = Field(
        alias="gpuAffinity", default=()
    )

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"

    @property
    def rdma_kind(self) -> str:
        return "infiniband" if self.link_layer is LinkLayer.INFINIBAND else "roce"


class NodeTopology(_Wire):
    """The `gputopo.io/topology` document: what one node's GPUs, links and NICs look like."""

    version: Literal[1] = 1
    gpus: Annotated[tuple[GpuInfo, ...], Field(max_length=MAX_GPUS_PER_NODE)]
    nvlink: NvlinkInfo = NvlinkInfo()
    degraded_links: Annotated[tuple[DegradedLink, ...], Field(max_length=MAX_GPUS_PER_NODE * MAX_NVLINKS)] = Field(
        alias="degradedLinks", default=()
    )
    fabric: FabricInfo | None = None
    nics: Annotated[tuple[NicInfo, ...], Field(max_length=MAX_NICS_PER_NODE)] = ()

    @model_validator(mode="before")
    @classmethod
    def _known_version(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "version" in data and data["version"] != SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema version {data['version']!r}; this gputopo reads version {SCHEMA_VERSION}"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> NodeTopology:
        n = len(self.gpus)
        if [g.index for g in self.gpus] != list(range(n)):
            raise ValueError("gpus must be listed by index 0..n-1")
        if self.nvlink.links and len(self.nvlink.links) != n:
            raise ValueError(f"nvlink.links is {len(self.nvlink.links)}x{len(self.nvlink.links)}, expected {n}x{n}")
        for d in self.degraded_links:
            if d.gpu >= n:
                raise ValueError(f"degradedLinks names GPU {d.gpu}, node has {n}")
        for nic in self.nics:
            if nic.gpu_affinity and len(nic.gpu_affinity) != n:
                raise ValueError(f"nic {nic.name} gpuAffinity has {len(nic.gpu_affinity)} entries, expected {n}")
        return self

    def link_count(self, i: int, j: int) -> int:
        return self.nvlink.links[i][j] if self.nvlink.links else 0

    def to_annotation(self) -> str:
        """Compact, deterministic JSON: the same topology always gives the same bytes."""
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"))


def _format_validation(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts[:3]) + (f" (and {len(parts) - 3} more)" if len(parts) > 3 else "")


# All of a node's annotations share the API server's 256 KiB limit; a topology of 64 GPUs and NICs needs
# about 40 KiB.
MAX_TOPOLOGY_BYTES = 256 * 1024


def parse_topology(text: str) -> NodeTopology:
    """Parse a `gputopo.io/topology` annotation value; raise AnnotationError naming what is wrong."""
    if len(text) > MAX_TOPOLOGY_BYTES:
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, f"longer than {MAX_TOPOLOGY_BYTES} bytes")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, f"not JSON ({e.msg} at position {e.pos})") from None
    except (ValueError, RecursionError):  # an integer with too many digits, or nesting deeper than Python's stack
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, "not JSON (a number too long or nesting too deep)") from None
    if not isinstance(data, dict):
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, "must be a JSON object")
    try:
        return NodeTopology.model_validate(data)
    except ValidationError as e:
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, _format_validation(e)) from None


# --------------------------------------------------------------------------------------------------
# gputopo.io/gpus-in-use


# Bounds: a node has at most a few dozen GPUs; these only stop a hostile or corrupt value from costing
# the extender real work. Kubernetes UIDs are 36 characters.
MAX_IN_USE_BYTES = 64 * 1024
MAX_IN_USE_PODS = 1024
MAX_POD_UID_LENGTH = 128
MAX_GPU_INDEX = 4096
IN_USE_VERSION = 2


@dataclass(frozen=True)
class GpusInUse:
    """A node's GPUs in use as its agent reports them: per pod UID, plus `other` (GPUs held by pods the
    agent cannot attribute, or used outside pods). No GPU is in two pods."""

    pods: Mapping[str, frozenset[int]] = field(default_factory=dict)
    other: frozenset[int] = frozenset()

    @property
    def all(self) -> frozenset[int]:
        used = set(self.other)
        for gpus in self.pods.values():
            used |= gpus
        return frozenset(used)

    def to_annotation(self) -> str:
        """Version 2, compact, UIDs and indices sorted: unchanged truth always gives the same bytes."""
        pods = {uid: sorted(self.pods[uid]) for uid in sorted(self.pods) if self.pods[uid]}
        return json.dumps({"version": IN_USE_VERSION, "pods": pods, "other": sorted(self.other)}, separators=(",", ":"))


def _indices(text: str, value: Any, gpu_count: int | None, where: str) -> frozenset[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"{where}: not a JSON list of GPU indices")
    limit = MAX_GPU_INDEX if gpu_count is None else gpu_count
    if any(i < 0 or i >= limit for i in value):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"{where}: index out of range for {limit} GPUs")
    return frozenset(value)


def parse_gpus_in_use_report(text: str, gpu_count: int | None = None) -> GpusInUse:
    """Parse `gputopo.io/gpus-in-use`: version 2 `{"version":2,"pods":{UID:[...]},"other":[...]}`, or
    a plain JSON list of indices (version 1, read as all `other`). Raises AnnotationError only."""
    if len(text) > MAX_IN_USE_BYTES:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"longer than {MAX_IN_USE_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # ValueError: bad JSON, or an integer with too many digits
        raise AnnotationError(
            GPUS_IN_USE_ANNOTATION, text, "not a JSON list of GPU indices nor a version 2 object"
        ) from None
    if isinstance(data, list):
        return GpusInUse(other=_indices(text, data, gpu_count, "value"))
    if not isinstance(data, dict):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "not a JSON list of GPU indices nor a version 2 object")
    version = data.get("version")
    if type(version) is not int or version != IN_USE_VERSION:  # not True, not 2.0
        raise AnnotationError(
            GPUS_IN_USE_ANNOTATION,
            text,
            f"unsupported version {version!r}; this gputopo reads a plain list (version 1) or version {IN_USE_VERSION}",
        )
    unknown = sorted(str(k) for k in data if k not in ("version", "pods", "other"))
    if unknown:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "unknown keys " + ", ".join(unknown[:3]))
    other = _indices(text, data.get("other", []), gpu_count, "other")
    raw_pods = data.get("pods", {})
    if not isinstance(raw_pods, dict):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "pods is not an object of pod UID to GPU indices")
    if len(raw_pods) > MAX_IN_USE_PODS:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"more than {MAX_IN_USE_PODS} pods")
    pods: dict[str, frozenset[int]] = {}
    owner: dict[int, str] = {}
    for uid, value in raw_pods.items():
        if not uid or len(uid) > MAX_POD_UID_LENGTH:
            raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"pod UID must be 1..{MAX_POD_UID_LENGTH} characters")
        gpus = _indices(text, value, gpu_count, f"pods[{_short(uid, 40)}]")
        for i in gpus:
            if i in owner:
                raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"GPU {i} is in two pods")
            owner[i] = uid
        if gpus:  # an empty list says nothing; dropped so equal truth compares equal
            pods[uid] = gpus
    both = sorted(other & owner.keys())
    if both:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"GPU {both[0]} is both in a pod and in other")
    return GpusInUse(pods=pods, other=other)


def parse_gpus_in_use(text: str, gpu_count: int | None = None) -> frozenset[int]:
    """Every GPU in use on the node (either version), whoever holds it."""
    return parse_gpus_in_use_report(text, gpu_count).all


def format_gpus_in_use(indices: frozenset[int] | set[int] | list[int]) -> str:
    """A version 1 value (a plain list); agents publish version 2 (`GpusInUse.to_annotation`)."""
    return json.dumps(sorted(set(indices)), separators=(",", ":"))


# --------------------------------------------------------------------------------------------------
# Node labels


def largest_clique_size(topology: NodeTopology) -> int:
    """Size of the largest fully NVLink-connected GPU set (1 when there is no NVLink at all)."""
    from gputopo.engine.cliques import max_clique_size  # local: the engine imports this module

    n = len(topology.gpus)
    adj = [0] * n
    for i in range(n):
        for j in range(n):
            if i != j and topology.link_count(i, j) > 0:
                adj[i] |= 1 << j
    return max_clique_size(tuple(adj), (1 << n) - 1)


def node_labels(topology: NodeTopology) -> dict[str, str]:
    """The `gputopo.io/*` node labels the agent publishes, derived from the topology only."""
    active = [n for n in topology.nics if n.active]
    kinds = {n.rdma_kind for n in active}
    rdma = "infiniband" if "infiniband" in kinds else ("roce" if "roce" in kinds else "none")
    memory = min((g.memory_mib for g in topology.gpus), default=0)
    return {
        LABEL_NVLINK_DOMAIN: str(largest_clique_size(topology) if topology.gpus else 0),
        LABEL_NVSWITCH: "true" if topology.nvlink.nvswitch else "false",
        LABEL_RDMA: rdma,
        LABEL_GPU_MEMORY_GIB: str(round(memory / 1024)),
    }


# --------------------------------------------------------------------------------------------------
# Pod annotations


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


# Kubernetes quantities (resource.Quantity's grammar): a signed decimal, then a binary suffix (Ki..Ei), a
# decimal suffix (n, u, m, k, M..E) or an exponent (e3). The shape and length are checked first, so no
# value (400 digits, NaN, inf, 1e999999) costs real work; the Kubernetes client's parser then gives the
# exact Decimal, and anything beyond int64 (how the API server and kubelet account resources) is refused.
MAX_QUANTITY_CHARS = 64
MAX_QUANTITY = 2**63 - 1
_QUANTITY = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,3})?$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$")


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity (`2`, `500m`, `80Gi`, `1e3`) as an exact Decimal, finite and within ±(2^63-1).

    Raises ValueError saying why; the work is bounded whatever the input."""
    if len(text) > MAX_QUANTITY_CHARS:
        raise ValueError(f"not a Kubernetes quantity: longer than {MAX_QUANTITY_CHARS} characters")
    stripped = text.strip()
    if not _QUANTITY.match(stripped):
        raise ValueError("not a Kubernetes quantity such as 2, 500m or 80Gi")
    # Imported here: the client package takes ~0.2 s to import, and most CLI commands never parse one.
    from kubernetes.utils.quantity import parse_quantity as parse_k8s_quantity

    value = parse_k8s_quantity(stripped)
    if not isinstance(value, Decimal) or not value.is_finite() or abs(value) > MAX_QUANTITY:
        raise ValueError(f"out of range: a Kubernetes quantity is at most {MAX_QUANTITY}")
    return value


def parse_quantity_bytes(text: str) -> int:
    """Kubernetes quantity (`80Gi`, `100G`, `81920Mi`) to whole bytes, rounded up as Kubernetes does;
    ValueError (saying why) otherwise, negative amounts included."""
    value = parse_quantity(text)
    if value < 0:
        raise ValueError("must not be negative")
    return int(value.to_integral_value(rounding=ROUND_CEILING))


# `gputopo.io/message-size`: the bytes of one all-reduce the communication estimate assumes. 1 GiB by
# default; at most 1 TiB (a larger single collective exceeds any GPU's memory, so it is a typo).
DEFAULT_MESSAGE_BYTES = 1 << 30
MAX_MESSAGE_BYTES = 1 << 40


def format_mib(mib: int) -> str:
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


class PodRequest(BaseModel):
    """A pod's placement request: its GPU count plus its parsed `gputopo.io/*` annotations."""

    model_config = ConfigDict(frozen=True)

    gpus: int
    nvlink: NvlinkPolicy = NvlinkPolicy.REQUIRED
    min_gpu_memory_mib: int | None = None
    group: str | None = None
    group_size: int | None = None
    stage: int | None = None
    network: NetworkKind = NetworkKind.ANY
    spread: Spread = Spread.NODE
    required_tier: str | None = None
    preferred_tier: str | None = None
    message_bytes: int = DEFAULT_MESSAGE_BYTES

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


def _int(key: str, value: str, lo: int, hi: int | None = None) -> int:
    if len(value) > 32:  # before int(): its cost grows with the square of the digits
        raise AnnotationError(key, value, "must be an integer" + (f" between {lo} and {hi}" if hi is not None else ""))
    try:
        v = int(value.strip())
    except ValueError:
        raise AnnotationError(key, value, "must be an integer") from None
    if v < lo or (hi is not None and v > hi):
        raise AnnotationError(key, value, f"must be between {lo} and {hi}" if hi is not None else f"must be >= {lo}")
    return v


def parse_pod_request(
    annotations: Mapping[str, str] | None, gpus: int, tiers: tuple[str, ...] = ("spine", "leaf", "nvlink-domain")
) -> PodRequest:
    """Validate a pod's `gputopo.io/*` annotations. Raises AnnotationError on the first bad one."""
    ann = {k: v for k, v in (annotations or {}).items() if k.startswith(PREFIX)}
    for key, value in ann.items():
        if key not in POD_OPT_IN_ANNOTATIONS and key not in POD_OUTPUT_ANNOTATIONS:
            raise AnnotationError(key, value, "unknown gputopo annotation; known: " + ", ".join(POD_OPT_IN_ANNOTATIONS))
    fields: dict[str, Any] = {"gpus": gpus}
    if ANN_NVLINK in ann:
        fields["nvlink"] = _enum(ANN_NVLINK, ann[ANN_NVLINK], NvlinkPolicy)
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
    if ANN_GROUP in ann:
        g = ann[ANN_GROUP].strip()
        if not _NAME.match(g):
            raise AnnotationError(ANN_GROUP, ann[ANN_GROUP], "must be a DNS-1123 name (lower case, digits, - . _)")
        fields["group"] = g
        if ANN_GROUP_SIZE not in ann:
            raise AnnotationError(ANN_GROUP, ann[ANN_GROUP], f"needs {ANN_GROUP_SIZE} as well")
    if ANN_GROUP_SIZE in ann:
        if ANN_GROUP not in ann:
            raise AnnotationError(ANN_GROUP_SIZE, ann[ANN_GROUP_SIZE], f"needs {ANN_GROUP} as well")
        fields["group_size"] = _int(ANN_GROUP_SIZE, ann[ANN_GROUP_SIZE], 1, 4096)
    if ANN_STAGE in ann:
        group_size = fields.get("group_size")
        if group_size is None:
            raise AnnotationError(ANN_STAGE, ann[ANN_STAGE], f"needs {ANN_GROUP} and {ANN_GROUP_SIZE}")
        fields["stage"] = _int(ANN_STAGE, ann[ANN_STAGE], 0, group_size - 1)
    if not 0 <= gpus <= MAX_QUANTITY:
        raise AnnotationError(GPU_RESOURCE, str(gpus), f"GPU count must be between 0 and {MAX_QUANTITY}")
    return PodRequest(**fields)


# --------------------------------------------------------------------------------------------------
# gputopo.io/placement


# Anyone who can edit a pod can write this annotation, and its GPU indices become bit positions: bound
# them to a node's GPUs, and the texts to a few sentences.
_Sentence = Annotated[str, Field(max_length=4 * MAX_TEXT_LENGTH)]
_Score = Annotated[int, Field(ge=-MAX_QUANTITY, le=MAX_QUANTITY)]


class RunnerUp(_Wire):
    node: _Name
    score: _Score
    why: _Sentence


_Millis = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]


class CommEstimate(_Wire):
    """Predicted communication times of a placement (docs/cost-model.md), in milliseconds."""

    message_bytes: Annotated[int, Field(alias="messageBytes", ge=1, le=MAX_MESSAGE_BYTES)]
    # The pod's all-reduce over its own GPUs; absent for one GPU.
    all_reduce_ms: _Millis | None = Field(alias="allReduceMs", default=None)
    # The same all-reduce on the runner-up node's GPUs.
    runner_up_all_reduce_ms: _Millis | None = Field(alias="runnerUpAllReduceMs", default=None)
    # A group member: the transfer to the next stage (the last stage: from the previous one).
    stage_transfer_ms: _Millis | None = Field(alias="stageTransferMs", default=None)
    # A group member: the all-reduce across the group's members (one rank per member, over the NICs).
    group_all_reduce_ms: _Millis | None = Field(alias="groupAllReduceMs", default=None)


class Placement(_Wire):
    """What gputopo decided for a pod; written at bind time and read back to rebuild assumed GPUs."""

    node: _Name
    gpus: Annotated[tuple[Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)], ...], Field(max_length=MAX_GPUS_PER_NODE)]
    score: _Score
    reason: _Sentence
    runner_up: RunnerUp | None = Field(alias="runnerUp", default=None)
    group: _Name | None = None
    stage: Annotated[int, Field(ge=0, le=4096)] | None = None
    estimate: CommEstimate | None = None

    def to_annotation(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"))


def parse_placement(text: str) -> Placement:
    try:
        return Placement.model_validate_json(text)
    except ValidationError as e:
        raise AnnotationError(PLACEMENT_ANNOTATION, text, _format_validation(e)) from None
