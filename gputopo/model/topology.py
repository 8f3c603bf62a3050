"""The `gputopo.io/topology` node annotation: GPUs, NVLink, degraded links, fabric and NICs of a node."""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import IntEnum, StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError, field_validator, model_validator

from gputopo.model.base import AnnotationError, Wire, format_validation_error
from gputopo.model.names import SCHEMA_VERSION, TOPOLOGY_ANNOTATION

# --------------------------------------------------------------------------------------------------
# Ordered link and distance types (one score table lives in gputopo.engine.state.scoring).


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

Name = Annotated[str, Field(max_length=MAX_NAME_LENGTH)]
Text = Annotated[str, Field(max_length=MAX_TEXT_LENGTH)]
_Gbps = Annotated[float, Field(ge=0, le=MAX_LINK_GBPS, allow_inf_nan=False)]
_LinkCount = Annotated[int, Strict(), Field(ge=0, le=MAX_NVLINKS)]
_NumaNode = Annotated[int, Strict(), Field(ge=-1, le=4096)]  # -1: the kernel does not know


class FabricState(StrEnum):
    """NVML's GPU fabric registration state (nvmlGpuFabricState_t)."""

    NOT_SUPPORTED = "not-supported"
    NOT_STARTED = "not-started"
    IN_PROGRESS = "in-progress"
    COMPLETED = "completed"


class FabricHealth(StrEnum):
    """A GPU's multi-node NVLink fabric as placement reads it; anything not shown healthy is unknown."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNKNOWN = "unknown"


class GpuFabric(Wire):
    """One GPU's NVML fabric info as the agent publishes it: registration state, its return status
    (0 = success) and the raw `healthMask` (decoded by `gputopo.model.decode_health`)."""

    state: FabricState
    status: Annotated[int, Strict(), Field(ge=0, le=0xFFFFFFFF)] = 0
    health_mask: Annotated[int, Strict(), Field(alias="healthMask", ge=0, le=0xFFFFFFFF)] = 0


class GpuInfo(Wire):
    index: Annotated[int, Strict(), Field(ge=0, lt=MAX_GPUS_PER_NODE)]
    uuid: Name
    model: Name
    memory_mib: Annotated[int, Strict(), Field(alias="memoryMiB", ge=0, le=MAX_GPU_MEMORY_MIB)]
    pci_bus_id: Name = Field(alias="pciBusId", default="")
    numa_node: _NumaNode | None = Field(alias="numaNode", default=None)
    health: Health = Health.OK
    reasons: Annotated[tuple[Text, ...], Field(max_length=MAX_REASONS)] = ()
    fabric: GpuFabric | None = None  # multi-node NVLink fabric (NVL72 trays); None where NVML reports none

    @model_validator(mode="after")
    def _memory_known_unless_failed(self) -> GpuInfo:
        # A GPU that fell off the bus reports no memory; it is never chosen, so 0 is harmless there.
        # Anywhere else 0 MiB is a corrupt report (and would divide by zero in scoring).
        if self.memory_mib == 0 and self.health is not Health.FAILED:
            raise ValueError(f"GPU {self.index}: memoryMiB must be > 0 unless the GPU is failed")
        return self


class NvlinkInfo(Wire):
    generation: Annotated[int, Strict(), Field(ge=0, le=64)] = 0
    gbps_per_link: _Gbps = Field(alias="gbpsPerLink", default=0.0)
    nvswitch: bool = False
    links: Annotated[
        tuple[
            Annotated[tuple[_LinkCount, ...], Field(max_length=MAX_GPUS_PER_NODE)],
            ...,
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


class DegradedLink(Wire):
    gpu: Annotated[int, Strict(), Field(ge=0, lt=MAX_GPUS_PER_NODE)]
    link: Annotated[int, Strict(), Field(ge=0, lt=MAX_NVLINKS)]
    state: LinkState
    detail: Text = ""


class FabricInfo(Wire):
    clique: Name


class NicInfo(Wire):
    name: Name
    link_layer: LinkLayer = Field(alias="linkLayer")
    state: Name
    rate_gbps: _Gbps = Field(alias="rateGbps")
    numa_node: _NumaNode | None = Field(alias="numaNode", default=None)
    pci_bus_id: Name = Field(alias="pciBusId", default="")
    gpu_affinity: Annotated[tuple[PcieDistance, ...], Field(max_length=MAX_GPUS_PER_NODE)] = Field(
        alias="gpuAffinity", default=()
    )

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"

    @property
    def rdma_kind(self) -> str:
        return "infiniband" if self.link_layer is LinkLayer.INFINIBAND else "roce"


class NodeTopology(Wire):
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
        raise AnnotationError(TOPOLOGY_ANNOTATION, text, format_validation_error(e)) from None
