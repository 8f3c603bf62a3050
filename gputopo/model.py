"""Wire models of every gputopo annotation and label (design.md, "Node annotations" and "Pod annotations").

These are the only shapes that cross process boundaries between the agent, the extender, the CLI and
the simulator. They validate strictly: an unknown schema version or a malformed value is an error that
names the annotation and the value, never a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
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


class GpuInfo(_Wire):
    index: Annotated[int, Field(ge=0)]
    uuid: str
    model: str
    memory_mib: Annotated[int, Field(alias="memoryMiB", ge=0)]
    pci_bus_id: str = Field(alias="pciBusId", default="")
    numa_node: int | None = Field(alias="numaNode", default=None)
    health: Health = Health.OK
    reasons: tuple[str, ...] = ()


class NvlinkInfo(_Wire):
    generation: Annotated[int, Field(ge=0)] = 0
    gbps_per_link: Annotated[float, Field(alias="gbpsPerLink", ge=0)] = 0.0
    nvswitch: bool = False
    links: tuple[tuple[int, ...], ...] = ()

    @field_validator("links")
    @classmethod
    def _square_symmetric(cls, links: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        n = len(links)
        for i, row in enumerate(links):
            if len(row) != n:
                raise ValueError(f"links row {i} has {len(row)} entries, expected {n}")
            if row[i] != 0:
                raise ValueError(f"links[{i}][{i}] must be 0")
            for j, v in enumerate(row):
                if v < 0:
                    raise ValueError(f"links[{i}][{j}] is negative")
                if links[j][i] != v:
                    raise ValueError(f"links is not symmetric at [{i}][{j}]")
        return links


class DegradedLink(_Wire):
    gpu: Annotated[int, Field(ge=0)]
    link: Annotated[int, Field(ge=0)]
    state: LinkState
    detail: str = ""


class FabricInfo(_Wire):
    clique: str


class NicInfo(_Wire):
    name: str
    link_layer: LinkLayer = Field(alias="linkLayer")
    state: str
    rate_gbps: Annotated[float, Field(alias="rateGbps", ge=0)]
    numa_node: int | None = Field(alias="numaNode", default=None)
    pci_bus_id: str = Field(alias="pciBusId", default="")
    gpu_affinity: tuple[PcieDistance, ...] = Field(alias="gpuAffinity", default=())

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"

    @property
    def rdma_kind(self) -> str:
        return "infiniband" if self.link_layer is LinkLayer.INFINIBAND else "roce"


class NodeTopology(_Wire):
    """The `gputopo.io/topology` document: what one node's GPUs, links and NICs look like."""

    version: Literal[1] = 1
    gpus: tuple[GpuInfo, ...]
    nvlink: NvlinkInfo = NvlinkInfo()
    degraded_links: tuple[DegradedLink, ...] = Field(alias="degradedLinks", default=())
    fabric: FabricInfo | None = None
    nics: tuple[NicInfo, ...] = ()

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


def parse_topology(text: str) -> NodeTopology:
    """Parse a `gputopo.io/topology` annotation value; raise AnnotationError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, f"not JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(data, dict):
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, "must be a JSON object")
    try:
        return NodeTopology.model_validate(data)
    except ValidationError as e:
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, _format_validation(e)) from None


# --------------------------------------------------------------------------------------------------
# gputopo.io/gpus-in-use


def parse_gpus_in_use(text: str, gpu_count: int | None = None) -> frozenset[int]:
    """Parse `gputopo.io/gpus-in-use`: a JSON list of GPU indices."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "not a JSON list of GPU indices") from None
    if not isinstance(data, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in data):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "not a JSON list of GPU indices")
    if any(i < 0 or (gpu_count is not None and i >= gpu_count) for i in data):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"index out of range for {gpu_count} GPUs")
    return frozenset(data)


def format_gpus_in_use(indices: frozenset[int] | set[int] | list[int]) -> str:
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


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_QUANTITY_FACTORS = {
    None: 1,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$")


def parse_quantity_bytes(text: str) -> int:
    """Kubernetes quantity (`80Gi`, `100G`, `81920Mi`) to bytes; ValueError otherwise."""
    m = _QUANTITY.match(text.strip())
    if not m:
        raise ValueError("not a Kubernetes quantity such as 80Gi")
    return int(float(m.group(1)) * _QUANTITY_FACTORS[m.group(2)])


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

    @property
    def is_group(self) -> bool:
        return self.group is not None


def is_gputopo_pod(annotations: Mapping[str, str] | None) -> bool:
    """True when the pod opted in (design.md: at least one `gputopo.io/` annotation of the request)."""
    return bool(annotations) and any(
        k.startswith(PREFIX) and k not in POD_OUTPUT_ANNOTATIONS for k in (annotations or {})
    )


def _enum(key: str, value: str, enum: type[StrEnum]) -> Any:
    try:
        return enum(value.strip())
    except ValueError:
        raise AnnotationError(key, value, "must be one of " + ", ".join(e.value for e in enum)) from None


def _int(key: str, value: str, lo: int, hi: int | None = None) -> int:
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
        size = fields.get("group_size")
        if size is None:
            raise AnnotationError(ANN_STAGE, ann[ANN_STAGE], f"needs {ANN_GROUP} and {ANN_GROUP_SIZE}")
        fields["stage"] = _int(ANN_STAGE, ann[ANN_STAGE], 0, size - 1)
    if gpus < 0:
        raise AnnotationError(GPU_RESOURCE, str(gpus), "GPU count must not be negative")
    return PodRequest(**fields)


# --------------------------------------------------------------------------------------------------
# gputopo.io/placement


class RunnerUp(_Wire):
    node: str
    score: int
    why: str


class Placement(_Wire):
    """What gputopo decided for a pod; written at bind time and read back to rebuild assumed GPUs."""

    node: str
    gpus: tuple[int, ...]
    score: int
    reason: str
    runner_up: RunnerUp | None = Field(alias="runnerUp", default=None)
    group: str | None = None
    stage: int | None = None

    def to_annotation(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"))


def parse_placement(text: str) -> Placement:
    try:
        return Placement.model_validate_json(text)
    except ValidationError as e:
        raise AnnotationError(PLACEMENT_ANNOTATION, text, _format_validation(e)) from None
