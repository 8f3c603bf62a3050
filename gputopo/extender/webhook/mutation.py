"""Mutating admission webhook: opt a pod in to the gputopo scheduler by annotation alone.

The Helm chart's optional ``MutatingWebhookConfiguration`` (``webhook.enabled``) sends pod
CREATE requests to the extender at ``POST /mutate``. A pod that carries at least one
``gputopo.io/`` annotation and names no scheduler of its own (``spec.schedulerName`` absent,
empty or ``default-scheduler``, which the API server fills in before admission) gets a JSONPatch
that sets ``spec.schedulerName`` to ``gputopo-scheduler``. Everything else is admitted unchanged.

Outside DRA mode the webhook never denies: it only mutates. Its match conditions in the chart repeat the same
test, so the API server rarely calls it for pods it would leave alone; this function still
decides on its own and is safe to call with any AdmissionReview.

This module is pure (no I/O). The extender mounts it, e.g.::

    @app.post("/mutate")
    def mutate(review: dict[str, Any]) -> dict[str, Any]:
        return mutate_pod(review)

and, when :func:`mutate_pod` raises :class:`ValueError` (a malformed review), answers
:func:`error_review` if the request's uid can be read (the pod is admitted unchanged, the reason is in
``status`` and in a warning), and HTTP 400 only when it cannot.

**DRA mode** (``--dra``, docs/annotations.md "Claims under DRA"): the node's GPUs are DRA devices, so a
pod's ``nvidia.com/gpu`` count becomes a ResourceClaim that asks for a clique. :func:`admit_pod` answers
an opted-in pod (a ``gputopo.io/`` annotation under no scheduler of its own or under gputopo's, or a
known controller's group labels under gputopo's scheduler) with a patch that removes the containers'
``nvidia.com/gpu`` limits and requests, gives those containers ``resources.claims: [{name: gpus}]`` and
the pod ``spec.resourceClaims: [{name: gpus, resourceClaimTemplateName: <name>}]``, and says which
template (gputopo.engine.dra.claims) that is. The webhook writes nothing: the caller only checks that no
other spec sits under that name, and the extender creates the template once the pod exists
(gputopo/extender/webhook/claimtemplates.py), so a review that no real pod follows leaves nothing behind. A pod that
already has claims keeps them as they are. Here the webhook may deny: a request no claim can express (a
bad ``gputopo.io/nvlink`` or ``min-gpu-memory``, a ``min-gpu-memory`` above the largest memory class,
more GPUs than a claim holds, an unreadable ``nvidia.com/gpu``) is refused with the reason, since
admitted unchanged it would ask for a resource no DRA node serves. So is a review whose namespace is not a
DNS-1123 label or whose pod name is not a DNS-1123 subdomain (gputopo.model.k8snames): the API server never
sends one, and its namespace would go into the path of the template read; it is refused before any request.

**Group gate** (``--group-gate``, docs/annotations.md "While a gang is gated"): a member of a group under
gputopo's scheduler (after this webhook's own patch) gets the ``gputopo.io/group-complete`` scheduling gate, so
it waits outside kube-scheduler's queue until the extender lifts it for the whole group
(gputopo/extender/verbs/groupgates.py); a pod another holder keeps back (Kueue's gates, a native PodGroup) or a JobSet
under exclusive placement gets none (gputopo.model.gates.admission_gate). A gate in a list the pod's author
wrote is appended, never replacing theirs.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gputopo.engine.dra.claims import MEMORY_CLASSES_MIB, REQUEST, ClaimError, ClaimTemplate, claim_template
from gputopo.extender.wire import WireError, pod_gpus
from gputopo.model import ANN_MIN_GPU_MEMORY, ANN_NVLINK, GPU_RESOURCE, PREFIX, SCHEDULER_NAME, AnnotationError
from gputopo.model.gates import admission_gate, gate_names, gate_patch
from gputopo.model.jobs import JOBSET_EXCLUSIVE, JOBSET_NODE_SELECTOR, group_identity
from gputopo.model.k8snames import InvalidName, check_name, check_namespace
from gputopo.model.request import ANN_GROUP, parse_pod_request

__all__ = [
    "ADMISSION_API_VERSION",
    "CLAIM_NAME",
    "DEFAULT_SCHEDULER",
    "Admission",
    "AdmissionRequest",
    "AdmissionResponse",
    "AdmissionReview",
    "DraMode",
    "admit_pod",
    "claim_patch",
    "error_review",
    "group_gate_patch",
    "is_opted_in",
    "mutate_pod",
    "names_problem",
    "refusal",
    "review_uid",
    "scheduler_name_patch",
]

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"
DEFAULT_SCHEDULER = "default-scheduler"
CLAIM_NAME = REQUEST  # the pod's claim and the claim's one request share the name "gpus"


class GroupVersionKind(BaseModel):
    model_config = ConfigDict(extra="allow")

    group: str = ""
    version: str = ""
    kind: str = ""


class GroupVersionResource(BaseModel):
    model_config = ConfigDict(extra="allow")

    group: str = ""
    version: str = ""
    resource: str = ""


class AdmissionRequest(BaseModel):
    """The ``request`` of an AdmissionReview (admission.k8s.io/v1); unknown keys are kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    uid: str = Field(min_length=1)
    kind: GroupVersionKind = Field(default_factory=GroupVersionKind)
    resource: GroupVersionResource = Field(default_factory=GroupVersionResource)
    sub_resource: str = Field(default="", alias="subResource")
    operation: str = ""
    namespace: str = ""
    name: str = ""
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = Field(default=None, alias="oldObject")
    dry_run: bool = Field(default=False, alias="dryRun")


class AdmissionStatus(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str = ""
    code: int | None = None


class AdmissionResponse(BaseModel):
    """The ``response`` of an AdmissionReview; ``patch`` is base64 of a JSONPatch document."""

    model_config = ConfigDict(populate_by_name=True)

    uid: str
    allowed: bool = True
    patch_type: Literal["JSONPatch"] | None = Field(default=None, alias="patchType")
    patch: str | None = None
    warnings: list[str] | None = None
    status: AdmissionStatus | None = None


class AdmissionReview(BaseModel):
    """An AdmissionReview as the API server sends it (request) or expects it back (response)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    api_version: Literal["admission.k8s.io/v1"] = Field(default="admission.k8s.io/v1", alias="apiVersion")
    kind: Literal["AdmissionReview"] = "AdmissionReview"
    request: AdmissionRequest | None = None
    response: AdmissionResponse | None = None


def _has_gputopo_annotation(annotations: Any) -> bool:
    if not isinstance(annotations, Mapping):  # absent, or not the object Kubernetes would send
        return False
    return any(isinstance(k, str) and k.startswith(PREFIX) for k in annotations)


def is_opted_in(pod: Mapping[str, Any]) -> bool:
    """True when the pod carries a ``gputopo.io/`` annotation and no scheduler of its own."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(metadata, Mapping) or not isinstance(spec, Mapping):
        return False
    if not _has_gputopo_annotation(metadata.get("annotations")):
        return False
    return spec.get("schedulerName") in (None, "", DEFAULT_SCHEDULER)


def scheduler_name_patch(scheduler_name: str = SCHEDULER_NAME) -> list[dict[str, str]]:
    """The JSONPatch (RFC 6902) that sets ``spec.schedulerName``.

    ``add`` on an existing member replaces it (RFC 6902 §4.1), so one operation covers a pod
    with or without the field.
    """
    return [{"op": "add", "path": "/spec/schedulerName", "value": scheduler_name}]


@dataclass(frozen=True)
class DraMode:
    """The webhook's DRA settings: `list_attributes` when the devices carry `nvlinkCliques`;
    `memory_classes` what a minimum HBM rounds up to (gputopo.engine.dra.claims); `blocks` when the agents
    publish clique blocks, so a clique of a block size asks for a whole block first."""

    list_attributes: bool = False
    memory_classes: tuple[int, ...] = MEMORY_CLASSES_MIB
    blocks: bool = False


@dataclass(frozen=True)
class Admission:
    """An answer to one review, and (DRA mode) the template its patch names in `namespace`; `dry_run`:
    the API server will not persist the pod."""

    answer: dict[str, Any]
    uid: str
    namespace: str = ""
    template: ClaimTemplate | None = None
    dry_run: bool = False


def mutate_pod(admission_review: dict[str, Any], scheduler_name: str = SCHEDULER_NAME) -> dict[str, Any]:
    """Answer one AdmissionReview (v1): allow, and patch the scheduler name of opted-in pods.

    Raises :class:`ValueError` (a pydantic ``ValidationError``, or for a review without a request)
    when the input is not an AdmissionReview v1 request; the HTTP layer answers 400 then.
    """
    return admit_pod(admission_review, scheduler_name).answer


def admit_pod(
    admission_review: dict[str, Any],
    scheduler_name: str = SCHEDULER_NAME,
    dra: DraMode | None = None,
    *,
    group_gate: bool = False,
) -> Admission:
    """:func:`mutate_pod`, and with `dra` the claim: see the module's docstring. Raises ValueError as
    mutate_pod does; a pod whose request no claim can express gets a refusal, not an exception."""
    try:
        review = AdmissionReview.model_validate(admission_review)
    except ValidationError as exc:
        raise ValueError(f"not an admission.k8s.io/v1 AdmissionReview: {_describe(exc)}") from exc
    request = review.request
    if request is None:
        raise ValueError("AdmissionReview has no request")

    response = AdmissionResponse(uid=request.uid, allowed=True)
    is_pod = request.kind.kind == "Pod" or request.resource.resource == "pods"
    pod = request.object
    if not (is_pod and request.sub_resource == "" and request.operation == "CREATE" and pod is not None):
        return Admission(_answer(response), request.uid)
    ops: list[dict[str, Any]] = []
    if is_opted_in(pod):
        ops.extend(scheduler_name_patch(scheduler_name))
    if group_gate:
        ops.extend(group_gate_patch(pod, scheduler_name, opted_in=bool(ops)))
    template: ClaimTemplate | None = None
    namespace = request.namespace or _str_at(pod, "metadata", "namespace")
    if dra is not None:
        bad = names_problem(request, pod)
        if bad:
            return Admission(refusal(request.uid, bad), request.uid)
    if dra is not None and _claims_gpus(pod, scheduler_name) and not _has_claims(pod):
        try:
            template = _claim(pod, dra)
        except (ClaimError, AnnotationError, WireError) as e:
            return Admission(refusal(request.uid, str(e)), request.uid)
        if template is not None:
            if not namespace:
                return Admission(refusal(request.uid, "the pod has no namespace to put its claim in"), request.uid)
            ops.extend(claim_patch(pod, template.name))
    if ops:
        patch = json.dumps(ops, separators=(",", ":"))
        response.patch_type = "JSONPatch"
        response.patch = base64.b64encode(patch.encode()).decode()
    return Admission(_answer(response), request.uid, namespace, template, request.dry_run)


def names_problem(request: AdmissionRequest, pod: Mapping[str, Any]) -> str:
    """Why the review's namespace or name cannot be a real pod's ("" when they can): every namespace it
    gives (the request's, the pod's) a DNS-1123 label, every name a DNS-1123 subdomain; empty ones are
    left to the API server (a pod with `generateName` has no name yet)."""
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    try:
        for what, value in (("namespace", request.namespace), ("metadata.namespace", meta.get("namespace"))):
            if value is not None and value != "":
                check_namespace(value, f"the review's {what}")
        for what, value in (("name", request.name), ("metadata.name", meta.get("name"))):
            if value is not None and value != "":
                check_name(value, f"the review's {what}")
    except InvalidName as e:
        return str(e)
    return ""


def group_gate_patch(pod: Mapping[str, Any], scheduler_name: str, *, opted_in: bool) -> list[dict[str, Any]]:
    """The JSONPatch that adds gputopo's scheduling gate to a group member under gputopo's scheduler
    (`opted_in`: this webhook sets that scheduler); none for any other pod (gputopo.model.gates says which)."""
    metadata, spec = pod.get("metadata"), pod.get("spec")
    if not isinstance(metadata, Mapping) or not isinstance(spec, Mapping):
        return []
    labels = _str_map(metadata.get("labels"))
    annotations = _str_map(metadata.get("annotations"))
    pod_group = _str_at(spec, "schedulingGroup", "podGroupName")
    group = annotations.get(ANN_GROUP) or group_identity(labels, pod_group)
    gates = gate_names(spec)
    why_not = admission_gate(
        scheduler=scheduler_name if opted_in else _str_at(spec, "schedulerName"),
        ours=scheduler_name,
        group=group,
        gates=gates,
        pod_group=pod_group,
        exclusive=JOBSET_EXCLUSIVE in annotations and JOBSET_NODE_SELECTOR not in annotations,
    )
    if why_not is not None:
        return []
    return gate_patch(isinstance(spec.get("schedulingGates"), list) and bool(spec.get("schedulingGates")))


def _str_at(obj: Mapping[str, Any], *keys: str) -> str:
    cur: Any = obj
    for k in keys:
        cur = cur.get(k) if isinstance(cur, Mapping) else None
    return cur if isinstance(cur, str) else ""


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def _claims_gpus(pod: Mapping[str, Any], scheduler_name: str) -> bool:
    """The pod is gputopo's in DRA mode: annotated under no scheduler of its own or under ours, or a
    known controller's group member under ours (the extender infers its group from the labels)."""
    metadata = pod.get("metadata")
    spec = pod.get("spec")
    if not isinstance(metadata, Mapping) or not isinstance(spec, Mapping):
        return False
    scheduler = spec.get("schedulerName")
    ours = scheduler == scheduler_name
    if _has_gputopo_annotation(metadata.get("annotations")):
        return ours or scheduler in (None, "", DEFAULT_SCHEDULER)
    if not ours:
        return False
    pod_group = _str_at(spec, "schedulingGroup", "podGroupName")
    return group_identity(_str_map(metadata.get("labels")), pod_group) is not None


def _has_claims(pod: Mapping[str, Any]) -> bool:
    """The pod names claims already (its own, or a container's): the user wrote them, they stay."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return False
    if spec.get("resourceClaims"):
        return True
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for c in containers if isinstance(containers, list) else ():
            resources = c.get("resources") if isinstance(c, Mapping) else None
            if isinstance(resources, Mapping) and resources.get("claims"):
                return True
    return False


def _claim(pod: Mapping[str, Any], dra: DraMode) -> ClaimTemplate | None:
    """The template of the pod's claim (None when it asks for no GPU). Raises ClaimError,
    AnnotationError or WireError naming what cannot be expressed."""
    spec = pod.get("spec")
    gpus = pod_gpus(spec if isinstance(spec, Mapping) else {})
    if gpus == 0:
        return None
    raw = pod.get("metadata", {}).get("annotations")
    annotations = raw if isinstance(raw, Mapping) else {}
    wanted: dict[str, str] = {}
    for key in (ANN_NVLINK, ANN_MIN_GPU_MEMORY):
        if key in annotations:
            value = annotations[key]
            if not isinstance(value, str):
                raise AnnotationError(key, str(value)[:60], "must be a string")
            wanted[key] = value
    # Only what a claim carries is read here: the extender reads (and reports) the rest of the request.
    request = parse_pod_request(wanted, gpus)
    return claim_template(
        request, list_attributes=dra.list_attributes, memory_classes=dra.memory_classes, blocks=dra.blocks
    )


def claim_patch(pod: Mapping[str, Any], template_name: str) -> list[dict[str, Any]]:
    """The JSONPatch that moves the containers' GPUs into one claim from `template_name`: each container
    that asks for `nvidia.com/gpu` loses it from limits and requests and references the claim instead
    (every container that references it sees all its devices, as under NVIDIA's DRA driver)."""
    ops: list[dict[str, Any]] = []
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    resource = GPU_RESOURCE.replace("~", "~0").replace("/", "~1")  # RFC 6901 escaping
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for i, c in enumerate(containers if isinstance(containers, list) else ()):
            resources = c.get("resources") if isinstance(c, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            had = False
            for kind in ("limits", "requests"):
                values = resources.get(kind)
                if isinstance(values, Mapping) and GPU_RESOURCE in values:
                    ops.append({"op": "remove", "path": f"/spec/{key}/{i}/resources/{kind}/{resource}"})
                    had = True
            if had and pod_gpus({"containers": [c]}) > 0:
                ops.append({"op": "add", "path": f"/spec/{key}/{i}/resources/claims", "value": [{"name": CLAIM_NAME}]})
    claim = {"name": CLAIM_NAME, "resourceClaimTemplateName": template_name}
    ops.append({"op": "add", "path": "/spec/resourceClaims", "value": [claim]})
    return ops


def refusal(uid: str, message: str, code: int = 400) -> dict[str, Any]:
    """A denial (DRA mode only): the API server refuses the pod and shows `message` to the client."""
    status = AdmissionStatus(code=code, message=f"gputopo webhook: {message}")
    return _answer(AdmissionResponse(uid=uid, allowed=False, status=status))


def _answer(response: AdmissionResponse) -> dict[str, Any]:
    out = AdmissionReview(response=response)
    return out.model_dump(by_alias=True, exclude_none=True, include={"api_version", "kind", "response"})


def _describe(exc: ValidationError) -> str:
    """The first problems, each with its field path, on one line (the full text repeats the input)."""
    parts = []
    for e in exc.errors()[:3]:
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"{loc}: {e['msg']}" if loc else str(e["msg"]))
    return "; ".join(parts)


def review_uid(review: Any) -> str | None:
    """``request.uid`` of a review too malformed to answer normally; None when there is none to read."""
    request = review.get("request") if isinstance(review, Mapping) else None
    uid = request.get("uid") if isinstance(request, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


# The API server shows warnings to the client and asks that each stay within 120 characters.
_WARNING_LIMIT = 120


def error_review(uid: str, message: str) -> dict[str, Any]:
    """The answer to a review with a uid that :func:`mutate_pod` could not read.

    The webhook never denies, so the pod is allowed unchanged (what ``failurePolicy: Ignore`` does when
    the webhook is down); ``status`` carries the reason for the audit log and a warning tells the client.
    """
    warning = f"gputopo webhook: {message}"
    if len(warning) > _WARNING_LIMIT:
        warning = warning[: _WARNING_LIMIT - 1] + "…"
    status = AdmissionStatus(code=400, message=message)
    return _answer(AdmissionResponse(uid=uid, allowed=True, status=status, warnings=[warning]))
