"""kube-scheduler's extender wire types (`k8s.io/kube-scheduler/extender/v1`), as pydantic models.

Request keys are the Go field names (`Pod`, `Nodes`, `NodeNames`, …) because the upstream structs have no
json tags; older extenders used lower-case tags (`pod`, `nodenames`). Go's decoder matches keys
case-insensitively, so every model here does too on input; output always uses the Go field names.
The embedded Pod stays a loose dict: only `pod_info()` reads what the extender needs from it, with the
project's one Pod reader (`gputopo.model.pod.read_pod`, which the agent's pod view uses too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gputopo.model import GPU_RESOURCE
from gputopo.model.dra import BLOCK_SIZES, block_resource
from gputopo.model.pod import PodInfo as PodInfo  # the extender reads pods as the model does
from gputopo.model.pod import pod_gpus as read_spec_gpus
from gputopo.model.pod import read_pod
from gputopo.model.podspec import PodSpecError

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
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return checked_args(data, brackets(body))


def brackets(raw: bytes) -> int:
    """The `{` and `[` bytes in `raw`, strings included: at least its nesting depth."""
    return raw.count(b"{") + raw.count(b"[")


def checked_args(data: Any, opened: int, names_checked: bool = False) -> ExtenderArgs | None:
    """`fast_extender_args` of a decoded body: `opened` is `brackets` of the body it was decoded from;
    `names_checked`: its `NodeNames` are known to be a list of strings within the bound."""
    if not isinstance(data, dict) or not data.keys() <= _FAST_KEYS or data.get("Nodes") is not None:
        return None
    pod, names = data.get("Pod"), data.get("NodeNames")
    if not isinstance(pod, dict) or not isinstance(names, list):
        return None
    if not names_checked and not strings_within_bound(names):
        return None
    # Each nesting level needs one bracket: with fewer than MAX_JSON_DEPTH of them (strings included) the
    # depth bound holds without walking the document. Near the bound, pydantic-core decides.
    if opened >= MAX_JSON_DEPTH and not _depth_within(pod, MAX_JSON_DEPTH - 2):
        return None
    if _float_gpu_count(pod):
        return None
    return ExtenderArgs.model_construct(pod=pod, nodes=None, node_names=names)


def strings_within_bound(names: list[Any]) -> bool:
    """Whether `names` are all strings and at most MAX_CANDIDATE_NODES of them."""
    if len(names) > MAX_CANDIDATE_NODES:
        return False
    try:
        "".join(names)  # a TypeError unless every name is a string: C-level, a quarter of a type-set's time
    except TypeError:
        return False
    return True


# The counts a pod's GPUs are read from: nvidia.com/gpu and the block resources whose counts are read (a
# name under the block prefix with another size is refused without reading its count).
_COUNTED = (GPU_RESOURCE, *(block_resource(s) for s in BLOCK_SIZES))


def _float_gpu_count(pod: dict[str, Any]) -> bool:
    """Whether a container's GPU or block count decoded as a float: orjson reads an integer literal past
    64 bits as one, pydantic-core as an int, and the error for it should read the same either way."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return False
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        for c in containers if isinstance(containers, list) else ():
            resources = c.get("resources") if isinstance(c, dict) else None
            for kind in ("limits", "requests"):
                values = resources.get(kind) if isinstance(resources, dict) else None
                if isinstance(values, dict) and any(isinstance(values.get(k), float) for k in _COUNTED):
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


# What the extender reads from a Pod object: the project's one Pod reader (gputopo.model.pod), its
# errors as WireError (HTTP 400 on the verbs, a BadObject in the watch).


def pod_gpus(spec: Mapping[str, Any], where: str = "Pod.spec") -> int:
    """The pod's GPUs by Kubernetes' rules (gputopo.model.podspec: requests default from limits, init
    containers one at a time, sidecars beside the app containers), else its gputopo claim templates'."""
    try:
        return read_spec_gpus(spec, where)
    except PodSpecError as e:
        raise WireError(str(e)) from None


def pod_info(pod: Any, where: str = "Pod") -> PodInfo:
    """The fields of a Pod object the extender uses (gputopo.model.pod.read_pod); WireError names a missing
    or malformed one."""
    try:
        return read_pod(pod, where)
    except PodSpecError as e:
        raise WireError(str(e)) from None
