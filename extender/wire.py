"""kube-scheduler's extender wire types (`k8s.io/kube-scheduler/extender/v1`), as pydantic models.

Request keys are the Go field names (`Pod`, `Nodes`, `NodeNames`, …) because the upstream structs have no
json tags; older extenders used lower-case tags (`pod`, `nodenames`). Go's decoder matches keys
case-insensitively, so every model here does too on input; output always uses the Go field names.
The embedded Pod stays a loose dict: only `pod_info()` reads what the extender needs from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gputopo.model import GPU_RESOURCE

JSON = dict[str, Any]


class WireError(ValueError):
    """A request that does not have the protocol's shape; the message names the field (HTTP 400)."""


class _GoStruct(BaseModel):
    """Keys match case-insensitively on input (like Go's encoding/json); output uses the Go names."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    _by_lower: ClassVar[dict[str, str]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        by_lower = {name.lower(): f.alias or name for name, f in cls.model_fields.items()}
        by_lower.update({(f.alias or name).lower(): f.alias or name for name, f in cls.model_fields.items()})
        by_lower.update(
            {(f.alias or name).lower().replace("_", ""): f.alias or name for name, f in cls.model_fields.items()}
        )
        cls._by_lower = by_lower

    @model_validator(mode="before")
    @classmethod
    def _fold_case(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        out: JSON = {}
        for key, value in data.items():
            canonical = cls._by_lower.get(str(key).lower()) if isinstance(key, str) else None
            if canonical is None:
                continue
            if canonical in out and key != canonical:
                continue  # the exact spelling wins, as in Go
            out[canonical] = value
        return out

    def to_wire(self) -> JSON:
        return self.model_dump(by_alias=True, mode="json")


class NodeList(_GoStruct):
    """`Nodes` (a v1.NodeList) when the extender is not nodeCacheCapable; items stay raw Node objects."""

    items: list[JSON] | None = Field(default=None, alias="items")
    metadata: JSON | None = Field(default=None, alias="metadata")

    def names(self) -> list[str]:
        out = []
        for i, item in enumerate(self.items or []):
            name = (item.get("metadata") or {}).get("name")
            if not isinstance(name, str) or not name:
                raise WireError(f"Nodes.items[{i}].metadata.name is missing")
            out.append(name)
        return out


class ExtenderArgs(_GoStruct):
    pod: JSON = Field(alias="Pod")
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")

    def candidate_names(self) -> list[str]:
        if self.node_names is not None:
            return self.node_names
        if self.nodes is not None:
            return self.nodes.names()
        return []


class ExtenderFilterResult(_GoStruct):
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")
    failed_nodes: dict[str, str] = Field(default_factory=dict, alias="FailedNodes")
    failed_and_unresolvable_nodes: dict[str, str] = Field(default_factory=dict, alias="FailedAndUnresolvableNodes")
    error: str = Field(default="", alias="Error")


class HostPriority(_GoStruct):
    host: str = Field(alias="Host")
    score: int = Field(alias="Score", ge=0, le=10)


class ExtenderBindingArgs(_GoStruct):
    pod_name: str = Field(alias="PodName", min_length=1)
    pod_namespace: str = Field(alias="PodNamespace", min_length=1)
    pod_uid: str = Field(default="", alias="PodUID")
    node: str = Field(alias="Node", min_length=1)


class ExtenderBindingResult(_GoStruct):
    error: str = Field(default="", alias="Error")


class MetaPod(_GoStruct):
    uid: str = Field(alias="UID")


class MetaVictims(_GoStruct):
    pods: list[MetaPod] = Field(default_factory=list, alias="Pods")
    num_pdb_violations: int = Field(default=0, alias="NumPDBViolations")


class Victims(_GoStruct):
    pods: list[JSON] = Field(default_factory=list, alias="Pods")
    num_pdb_violations: int = Field(default=0, alias="NumPDBViolations")


class ExtenderPreemptionArgs(_GoStruct):
    pod: JSON = Field(alias="Pod")
    node_name_to_victims: dict[str, Victims | None] | None = Field(default=None, alias="NodeNameToVictims")
    node_name_to_meta_victims: dict[str, MetaVictims | None] | None = Field(default=None, alias="NodeNameToMetaVictims")

    def meta_victims(self) -> dict[str, MetaVictims]:
        """Candidates as UIDs; full Victims (nodeCacheCapable: false) are reduced to their pods' UIDs."""
        if self.node_name_to_meta_victims is not None:
            return {n: v or MetaVictims() for n, v in self.node_name_to_meta_victims.items()}
        out: dict[str, MetaVictims] = {}
        for node, victims in (self.node_name_to_victims or {}).items():
            pods = [
                MetaPod(uid=str((p.get("metadata") or {}).get("uid", ""))) for p in (victims.pods if victims else [])
            ]
            out[node] = MetaVictims(pods=pods, num_pdb_violations=victims.num_pdb_violations if victims else 0)
        return out


class ExtenderPreemptionResult(_GoStruct):
    node_name_to_meta_victims: dict[str, MetaVictims] = Field(default_factory=dict, alias="NodeNameToMetaVictims")


# --------------------------------------------------------------------------------------------------
# What the extender reads from a Pod object


@dataclass(frozen=True)
class PodInfo:
    name: str
    namespace: str
    uid: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0
    scheduler_name: str = ""
    node_name: str = ""
    phase: str = ""

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _gpu_quantity(resources: Any, where: str) -> int:
    if not isinstance(resources, Mapping):
        return 0
    for kind in ("limits", "requests"):  # the limit is the count (design.md); requests only as a fallback
        values = resources.get(kind)
        if isinstance(values, Mapping) and GPU_RESOURCE in values:
            raw = values[GPU_RESOURCE]
            try:
                number = float(str(raw))
            except ValueError:
                raise WireError(f"{where}.resources.{kind}.{GPU_RESOURCE}: {raw!r} is not a number") from None
            if number < 0 or number != int(number):
                raise WireError(f"{where}.resources.{kind}.{GPU_RESOURCE}: {raw!r} is not a whole number of GPUs")
            return int(number)
    return 0


def pod_gpus(spec: Mapping[str, Any], where: str = "Pod.spec") -> int:
    """Sum of the containers' nvidia.com/gpu limits; init containers run first, so the pod needs the
    larger of that sum and the largest init container's count (Kubernetes' effective request)."""
    total = 0
    for i, c in enumerate(spec.get("containers") or []):
        if isinstance(c, Mapping):
            total += _gpu_quantity(c.get("resources"), f"{where}.containers[{i}]")
    init = 0
    for i, c in enumerate(spec.get("initContainers") or []):
        if isinstance(c, Mapping):
            init = max(init, _gpu_quantity(c.get("resources"), f"{where}.initContainers[{i}]"))
    return max(total, init)


def _str_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise WireError(f"{where} must be an object of strings")
    return {str(k): str(v) for k, v in value.items()}


def pod_info(pod: Mapping[str, Any], where: str = "Pod") -> PodInfo:
    """The fields of a Pod object the extender uses; WireError names a missing or malformed one."""
    if not isinstance(pod, Mapping):
        raise WireError(f"{where} must be a Pod object")
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        raise WireError(f"{where}.metadata is missing")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise WireError(f"{where}.metadata.name is missing")
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise WireError(f"{where}.spec must be an object")
    status = pod.get("status") or {}
    return PodInfo(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        annotations=_str_map(meta.get("annotations"), f"{where}.metadata.annotations"),
        labels=_str_map(meta.get("labels"), f"{where}.metadata.labels"),
        gpus=pod_gpus(spec, f"{where}.spec"),
        scheduler_name=str(spec.get("schedulerName") or ""),
        node_name=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or "") if isinstance(status, Mapping) else "",
    )
