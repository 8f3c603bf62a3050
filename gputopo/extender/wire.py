"""kube-scheduler's extender wire types (`k8s.io/kube-scheduler/extender/v1`), as pydantic models.

Request keys are the Go field names (`Pod`, `Nodes`, `NodeNames`, …) because the upstream structs have no
json tags; older extenders used lower-case tags (`pod`, `nodenames`). Go's decoder matches keys
case-insensitively, so every model here does too on input; output always uses the Go field names.
The embedded Pod stays a loose dict: only `pod_info()` reads what the extender needs from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gputopo.model import GPU_RESOURCE
from gputopo.model.dra import pod_claim_gpus
from gputopo.model.gates import gate_names
from gputopo.model.podspec import PodSpecError, read_pod_gpus
from gputopo.model.podspec import short_repr as _short

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


# Candidate nodes per call. The largest clusters run 65,000 nodes (GKE); past that a call is not from a
# real scheduler, and its cost (about 10 µs per unknown name, on the event loop) is refused up front.
MAX_CANDIDATE_NODES = 100_000


class NodeList(_GoStruct):
    """`Nodes` (a v1.NodeList) when the extender is not nodeCacheCapable; items stay raw Node objects."""

    items: list[JSON] | None = Field(default=None, alias="items", max_length=MAX_CANDIDATE_NODES)
    metadata: JSON | None = Field(default=None, alias="metadata")

    def names(self) -> list[str]:
        out = []
        for i, item in enumerate(self.items or []):
            meta = item.get("metadata")
            name = meta.get("name") if isinstance(meta, Mapping) else None
            if not isinstance(name, str) or not name:
                raise WireError(f"Nodes.items[{i}].metadata.name is missing")
            out.append(name)
        return out


class ExtenderArgs(_GoStruct):
    pod: JSON = Field(alias="Pod")
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames", max_length=MAX_CANDIDATE_NODES)

    def candidate_names(self) -> list[str]:
        if self.node_names is not None:
            return self.node_names
        if self.nodes is not None:
            return self.nodes.names()
        return []


# pydantic-core refuses JSON nested deeper than this; the fast path below keeps the same bound.
MAX_JSON_DEPTH = 200
_FAST_KEYS = frozenset(("Pod", "Nodes", "NodeNames"))


def _depth_within(value: Any, limit: int) -> bool:
    """Whether `value` nests at most `limit` arrays/objects deep (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return True


def fast_extender_args(body: bytes) -> ExtenderArgs | None:
    """kube-scheduler's own filter/prioritize request (Go-cased keys, `NodeNames` a list of strings,
    `Nodes` null), decoded by orjson without validating the embedded Pod through pydantic (`pod_info`
    checks what is read from it). None for anything else, including every malformed body: the caller
    then parses with `ExtenderArgs`, whose errors name the field (HTTP 400) exactly as before."""
    # Each nesting level needs one bracket: with fewer than MAX_JSON_DEPTH of them (strings included) the
    # depth bound holds without walking the document. Near the bound, pydantic-core decides.
    shallow = body.count(b"{") + body.count(b"[") < MAX_JSON_DEPTH
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not data.keys() <= _FAST_KEYS or data.get("Nodes") is not None:
        return None
    pod, names = data.get("Pod"), data.get("NodeNames")
    if not isinstance(pod, dict) or not isinstance(names, list) or len(names) > MAX_CANDIDATE_NODES:
        return None
    try:
        "".join(names)  # a TypeError unless every name is a string: C-level, a quarter of a type-set's time
    except TypeError:
        return None
    if not shallow and not _depth_within(pod, MAX_JSON_DEPTH - 2):
        return None
    if _float_gpu_count(pod):
        return None
    return ExtenderArgs.model_construct(pod=pod, nodes=None, node_names=names)


def _float_gpu_count(pod: dict[str, Any]) -> bool:
    """Whether a container's GPU count decoded as a float: orjson reads an integer literal past 64 bits
    as one, pydantic-core as an int, and the error for it should read the same either way."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return False
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        for c in containers if isinstance(containers, list) else ():
            resources = c.get("resources") if isinstance(c, dict) else None
            for kind in ("limits", "requests"):
                values = resources.get(kind) if isinstance(resources, dict) else None
                if isinstance(values, dict) and isinstance(values.get(GPU_RESOURCE), float):
                    return True
    return False


class ExtenderBindingArgs(_GoStruct):
    pod_name: str = Field(alias="PodName", min_length=1)
    pod_namespace: str = Field(alias="PodNamespace", min_length=1)
    pod_uid: str = Field(default="", alias="PodUID")
    node: str = Field(alias="Node", min_length=1)


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
            pods = [MetaPod(uid=_victim_uid(p)) for p in (victims.pods if victims else [])]
            out[node] = MetaVictims(pods=pods, num_pdb_violations=victims.num_pdb_violations if victims else 0)
        return out


def _victim_uid(pod: JSON) -> str:
    """A victim Pod's UID, "" when it has none: this runs on the fallback path too, so it must not raise."""
    meta = pod.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""


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
    priority: int = 0  # spec.priority (admission resolves priorityClassName into it); preemption ranks by it
    pod_group: str = ""  # spec.schedulingGroup.podGroupName: a native PodGroup's member (Kubernetes >= 1.36)
    # spec.nodeSelector, sorted: where a group member may go (Kueue TAS writes its domain there). Only the
    # nodeSelector is read: Kueue writes nothing else, and required node affinity stays kube-scheduler's.
    node_selector: tuple[tuple[str, str], ...] = ()
    selector_problem: str = ""  # why node_selector was not kept (over the bounds); its group cannot plan
    topology_gated: bool = False  # still held by Kueue's topology gate: its domain is not written yet
    gates: tuple[str, ...] = ()  # spec.schedulingGates' names (gputopo.model.gates reads them): gputopo's gate
    # The ResourceClaimTemplates its spec.resourceClaims name (a ComputeDomain's IMEX channel is one).
    claim_templates: tuple[str, ...] = ()
    # The ResourceClaim objects it uses: named in spec.resourceClaims, made from a template
    # (status.resourceClaimStatuses) or for an extended resource (status.extendedResourceClaimStatus).
    # The bind reads their allocation, which names the pod's GPUs under DRA.
    claim_names: tuple[str, ...] = ()

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_gpus(spec: Mapping[str, Any], where: str = "Pod.spec") -> int:
    """The pod's GPUs by Kubernetes' rules (gputopo.model.podspec: requests default from limits, init
    containers one at a time, sidecars beside the app containers)."""
    try:
        gpus = read_pod_gpus(spec, where).total
    except PodSpecError as e:
        raise WireError(str(e)) from None
    # Under DRA the webhook moved the count into a claim template of gputopo's (nvidia.com/gpu is gone).
    return gpus or pod_claim_gpus(spec)


def _str_map(value: Any, where: str) -> dict[str, str]:
    """Labels and annotations: Kubernetes only has string values, and the engine reads them as text."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise WireError(f"{where} must be an object of strings")
    for k, v in value.items():
        if not isinstance(v, str):
            raise WireError(f"{where}[{_short(k)}] must be a string, not {type(v).__name__}")
    return dict(value)


def _opt_str(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WireError(f"{where} must be a string")
    return value


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
    if not isinstance(status, Mapping):
        raise WireError(f"{where}.status must be an object")
    return PodInfo(
        name=name,
        namespace=_opt_str(meta.get("namespace"), f"{where}.metadata.namespace") or "default",
        uid=_opt_str(meta.get("uid"), f"{where}.metadata.uid"),
        annotations=_str_map(meta.get("annotations"), f"{where}.metadata.annotations"),
        labels=_str_map(meta.get("labels"), f"{where}.metadata.labels"),
        gpus=pod_gpus(spec, f"{where}.spec"),
        scheduler_name=_opt_str(spec.get("schedulerName"), f"{where}.spec.schedulerName"),
        node_name=_opt_str(spec.get("nodeName"), f"{where}.spec.nodeName"),
        phase=_opt_str(status.get("phase"), f"{where}.status.phase"),
        priority=_priority(spec.get("priority")),
        pod_group=_pod_group(spec.get("schedulingGroup"), f"{where}.spec.schedulingGroup"),
        claim_templates=_claim_templates(spec.get("resourceClaims"), f"{where}.spec.resourceClaims"),
        claim_names=_claim_names(spec, status, where),
        **_placement_limits(spec, f"{where}.spec"),
    )


MAX_POD_CLAIMS = 32  # the API server's cap on a pod's spec.resourceClaims


def _claim_templates(value: Any, where: str) -> tuple[str, ...]:
    """The template names of spec.resourceClaims (a claim named directly, resourceClaimName, is not read)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_POD_CLAIMS:
        raise WireError(f"{where} must be a list of at most {MAX_POD_CLAIMS} claims")
    out = []
    for i, claim in enumerate(value):
        name = claim.get("resourceClaimTemplateName") if isinstance(claim, Mapping) else None
        if name is not None:
            out.append(_opt_str(name, f"{where}[{i}].resourceClaimTemplateName"))
    return tuple(n for n in out if n)


# An object name (DNS subdomain): a claim name read off a pod becomes an API path at bind.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _claim_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _OBJECT_NAME.fullmatch(value):
        raise WireError(f"{where} must be an object name (a DNS subdomain of at most 253 characters)")
    return value


def _claim_names(spec: Mapping[str, Any], status: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """The names of the ResourceClaim objects the pod uses (each once), from its spec and status."""
    names: list[str] = []
    for key, field_, holder in (
        ("resourceClaims", "resourceClaimName", spec),
        ("resourceClaimStatuses", "resourceClaimName", status),
    ):
        value = holder.get(key)
        at = f"{where}.{'spec' if holder is spec else 'status'}.{key}"
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > MAX_POD_CLAIMS:
            raise WireError(f"{at} must be a list of at most {MAX_POD_CLAIMS} claims")
        for i, entry in enumerate(value):
            if not isinstance(entry, Mapping):
                raise WireError(f"{at}[{i}] must be an object")
            if entry.get(field_) is not None:  # a template's claim not made yet has none
                names.append(_claim_name(entry[field_], f"{at}[{i}].{field_}"))
    extended = status.get("extendedResourceClaimStatus")
    if extended is not None:
        at = f"{where}.status.extendedResourceClaimStatus"
        if not isinstance(extended, Mapping):
            raise WireError(f"{at} must be an object")
        names.append(_claim_name(extended.get("resourceClaimName"), f"{at}.resourceClaimName"))
    return tuple(dict.fromkeys(names))


# A nodeSelector gputopo plans with: Kueue writes one key per topology level (at most 16 levels). A tenant's
# template may add its own; past these bounds the selector is not kept and the member's group is told why.
MAX_SELECTOR_KEYS = 64
MAX_SELECTOR_BYTES = 16 * 1024
KUEUE_TOPOLOGY_GATE = "kueue.x-k8s.io/topology"  # Kueue's TAS gate, removed when the selector is written


def _placement_limits(spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """spec.nodeSelector and Kueue's topology gate, as PodInfo's fields; nothing for a pod with neither."""
    out: dict[str, Any] = {}
    raw, gates = spec.get("nodeSelector"), spec.get("schedulingGates")
    if raw:
        selector = _str_map(raw, f"{where}.nodeSelector")
        size = sum(len(k) + len(v) for k, v in selector.items())
        if len(selector) > MAX_SELECTOR_KEYS or size > MAX_SELECTOR_BYTES:
            out["selector_problem"] = (
                f"{where}.nodeSelector has {len(selector)} keys ({size} bytes); gputopo plans a group with "
                f"at most {MAX_SELECTOR_KEYS} keys ({MAX_SELECTOR_BYTES // 1024} KiB)"
            )
        else:
            out["node_selector"] = tuple(sorted(selector.items()))
    if gates and isinstance(gates, list):
        out["topology_gated"] = any(isinstance(g, Mapping) and g.get("name") == KUEUE_TOPOLOGY_GATE for g in gates)
        out["gates"] = gate_names(spec)
    return out


def _pod_group(value: Any, where: str) -> str:
    """spec.schedulingGroup.podGroupName ("" when absent); the name is checked where it is used."""
    if value is None:
        return ""
    if not isinstance(value, Mapping):
        raise WireError(f"{where} must be an object")
    return _opt_str(value.get("podGroupName"), f"{where}.podGroupName")


def _priority(value: Any) -> int:
    """spec.priority, an int32 the API server sets; anything else counts as the default, 0 (it only
    orders victims, so an odd value must not make the pod unreadable)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -(2**31) <= value < 2**31 else 0
