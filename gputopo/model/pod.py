"""A Pod object's fields, read once: the one Pod reader of the project. Pure: no I/O.

The extender's `PodInfo` (gputopo.extender.wire re-exports it), the agent's `LocalPod`
(gputopo.agent.pods) and the claim-template keeper (gputopo.extender.webhook.claimtemplates) are all
built from `read_pod`, so every side accepts, refuses and reads the same Pod the same way. The GPU
request follows Kubernetes' rules (`gputopo.model.podspec`). A field that cannot be read raises
`PodSpecError` naming it (`Pod.spec.containers[0]...`, `Pod.metadata.annotations[...]`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gputopo.model.blockrequest import read_block_ask
from gputopo.model.dra import pod_claim_gpus
from gputopo.model.gates import gate_names
from gputopo.model.k8snames import parse_time
from gputopo.model.names import GPU_RESOURCE
from gputopo.model.podspec import PodGpus, PodSpecError, read_pod_gpus, short_repr

TERMINAL_PHASES = ("Succeeded", "Failed")
NO_GPUS = PodGpus(0, ())
MAX_POD_CLAIMS = 32  # the API server's cap on a pod's spec.resourceClaims
# A nodeSelector gputopo plans with: Kueue writes one key per topology level (at most 16 levels). A tenant's
# template may add its own; past these bounds the selector is not kept and the member's group is told why.
MAX_SELECTOR_KEYS = 64
MAX_SELECTOR_BYTES = 16 * 1024
KUEUE_TOPOLOGY_GATE = "kueue.x-k8s.io/topology"  # Kueue's TAS gate, removed when the selector is written
# An object name (DNS subdomain): a claim name read off a pod becomes an API path at bind.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class PodInfo:
    """What gputopo reads from a Pod object."""

    name: str
    namespace: str
    uid: str  # "" when the object has none (a review's pod before it is created)
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    # The GPUs it asks for: its nvidia.com/gpu request, else its gputopo claim templates' (DRA), else its block's.
    gpus: int = 0
    # `gputopo.io/gpu-clique<N>: 1` (gputopo.model.blockrequest): N, the GPUs of the one whole block it asks
    # for; 0 for none. `block_problem`: why what it asks through those resources cannot be placed.
    block: int = 0
    block_problem: str = ""
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
    # The pre-made ResourceClaims its spec.resourceClaims name directly (resourceClaimName).
    named_claims: tuple[str, ...] = ()
    # The ResourceClaim objects it uses: named in spec.resourceClaims, made from a template
    # (status.resourceClaimStatuses) or for an extended resource (status.extendedResourceClaimStatus).
    # The bind reads their allocation, which names the pod's GPUs under DRA.
    claim_names: tuple[str, ...] = ()
    # The device plugin's view: the request of the resource asked for alone, with each app container's count.
    request: PodGpus = NO_GPUS
    deleting: bool = False  # metadata.deletionTimestamp is set
    created: float = 0.0  # metadata.creationTimestamp in epoch seconds (0.0: none)

    @property
    def terminated(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def read_pod(pod: Any, where: str = "Pod", resource: str = GPU_RESOURCE) -> PodInfo:
    """The fields of a Pod object gputopo uses; PodSpecError names a missing or malformed one (`where`
    starts the field's name). `resource`: the device plugin's resource (nvidia.com/gpu)."""
    if not isinstance(pod, Mapping):
        raise PodSpecError(f"{where} must be a Pod object")
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        raise PodSpecError(f"{where}.metadata is missing")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise PodSpecError(f"{where}.metadata.name is missing")
    spec = pod.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise PodSpecError(f"{where}.spec must be an object")
    status = pod.get("status") or {}
    if not isinstance(status, Mapping):
        raise PodSpecError(f"{where}.status must be an object")
    request = read_pod_gpus(spec, f"{where}.spec", resource)
    gpus = request.total or pod_claim_gpus(spec)
    block = read_block_ask(spec, f"{where}.spec", gpus)
    return PodInfo(
        name=name,
        namespace=_opt_str(meta.get("namespace"), f"{where}.metadata.namespace") or "default",
        uid=_opt_str(meta.get("uid"), f"{where}.metadata.uid"),
        annotations=string_map(meta.get("annotations"), f"{where}.metadata.annotations"),
        labels=string_map(meta.get("labels"), f"{where}.metadata.labels"),
        # Under DRA the webhook moved the count into a claim template of gputopo's (nvidia.com/gpu is gone).
        gpus=gpus or block.size,
        block=block.size,
        block_problem=block.problem,
        scheduler_name=_opt_str(spec.get("schedulerName"), f"{where}.spec.schedulerName"),
        node_name=_opt_str(spec.get("nodeName"), f"{where}.spec.nodeName"),
        phase=_opt_str(status.get("phase"), f"{where}.status.phase"),
        priority=_priority(spec.get("priority")),
        pod_group=_pod_group(spec.get("schedulingGroup"), f"{where}.spec.schedulingGroup"),
        claim_templates=_claim_templates(spec.get("resourceClaims"), f"{where}.spec.resourceClaims"),
        claim_names=_claim_names(spec, status, where),
        named_claims=_named_claims(spec.get("resourceClaims")),
        request=request,
        deleting=bool(meta.get("deletionTimestamp")),
        created=_created(meta.get("creationTimestamp"), f"{where}.metadata.creationTimestamp"),
        **_placement_limits(spec, f"{where}.spec"),
    )


def pod_gpus(spec: Mapping[str, Any], where: str = "Pod.spec") -> int:
    """The GPUs a Pod spec asks for, as `PodInfo.gpus` reads them: nvidia.com/gpu by Kubernetes' rules
    (gputopo.model.podspec), else the count in gputopo's claim templates. A block's GPUs are not counted:
    the webhook moves only these into a claim of its own; kube-scheduler makes a block's."""
    return read_pod_gpus(spec, where).total or pod_claim_gpus(spec)


def string_map(value: Any, where: str) -> dict[str, str]:
    """Labels and annotations: Kubernetes only has string values, and gputopo reads them as text."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PodSpecError(f"{where} must be an object of strings")
    for k, v in value.items():
        if not isinstance(v, str):
            raise PodSpecError(f"{where}[{short_repr(k)}] must be a string, not {type(v).__name__}")
    return dict(value)


def _opt_str(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise PodSpecError(f"{where} must be a string")
    return value


def _created(value: Any, where: str) -> float:
    if value is None or value == "":
        return 0.0
    epoch = parse_time(value)
    if epoch is None:
        raise PodSpecError(f"{where} is not an RFC 3339 time: {short_repr(value)}")
    return epoch


def _claim_templates(value: Any, where: str) -> tuple[str, ...]:
    """The template names of spec.resourceClaims (a claim named directly is `_named_claims`')."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_POD_CLAIMS:
        raise PodSpecError(f"{where} must be a list of at most {MAX_POD_CLAIMS} claims")
    out = []
    for i, claim in enumerate(value):
        name = claim.get("resourceClaimTemplateName") if isinstance(claim, Mapping) else None
        if name is not None:
            out.append(_opt_str(name, f"{where}[{i}].resourceClaimTemplateName"))
    return tuple(n for n in out if n)


def _named_claims(value: Any) -> tuple[str, ...]:
    """The names spec.resourceClaims gives directly (resourceClaimName), each once; `_claim_names` refuses an
    unreadable list or name first."""
    if not isinstance(value, list):
        return ()
    names = (c.get("resourceClaimName") for c in value if isinstance(c, Mapping))
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))


def _claim_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _OBJECT_NAME.fullmatch(value):
        raise PodSpecError(f"{where} must be an object name (a DNS subdomain of at most 253 characters)")
    return value


def _claim_names(spec: Mapping[str, Any], status: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """The names of the ResourceClaim objects the pod uses (each once), from its spec and status."""
    names: list[str] = []
    for key, holder, at in (
        ("resourceClaims", spec, f"{where}.spec.resourceClaims"),
        ("resourceClaimStatuses", status, f"{where}.status.resourceClaimStatuses"),
    ):
        value = holder.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > MAX_POD_CLAIMS:
            raise PodSpecError(f"{at} must be a list of at most {MAX_POD_CLAIMS} claims")
        for i, entry in enumerate(value):
            if not isinstance(entry, Mapping):
                raise PodSpecError(f"{at}[{i}] must be an object")
            if entry.get("resourceClaimName") is not None:  # a template's claim not made yet has none
                names.append(_claim_name(entry["resourceClaimName"], f"{at}[{i}].resourceClaimName"))
    extended = status.get("extendedResourceClaimStatus")
    if extended is not None:
        at = f"{where}.status.extendedResourceClaimStatus"
        if not isinstance(extended, Mapping):
            raise PodSpecError(f"{at} must be an object")
        names.append(_claim_name(extended.get("resourceClaimName"), f"{at}.resourceClaimName"))
    return tuple(dict.fromkeys(names))


def _placement_limits(spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """spec.nodeSelector and Kueue's topology gate, as PodInfo's fields; nothing for a pod with neither."""
    out: dict[str, Any] = {}
    raw, gates = spec.get("nodeSelector"), spec.get("schedulingGates")
    if raw:
        selector = string_map(raw, f"{where}.nodeSelector")
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
        raise PodSpecError(f"{where} must be an object")
    return _opt_str(value.get("podGroupName"), f"{where}.podGroupName")


def _priority(value: Any) -> int:
    """spec.priority, an int32 the API server sets; anything else counts as the default, 0 (it only
    orders victims, so an odd value must not make the pod unreadable)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -(2**31) <= value < 2**31 else 0
