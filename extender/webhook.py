"""Mutating admission webhook: opt a pod in to the gputopo scheduler by annotation alone.

The Helm chart's optional ``MutatingWebhookConfiguration`` (``webhook.enabled``) sends pod
CREATE requests to the extender at ``POST /mutate``. A pod that carries at least one
``gputopo.io/`` annotation and names no scheduler of its own (``spec.schedulerName`` absent,
empty or ``default-scheduler``, which the API server fills in before admission) gets a JSONPatch
that sets ``spec.schedulerName`` to ``gputopo-scheduler``. Everything else is admitted unchanged.

The webhook never denies: it only mutates. Its match conditions in the chart repeat the same
test, so the API server rarely calls it for pods it would leave alone; this function still
decides on its own and is safe to call with any AdmissionReview.

This module is pure (no I/O). The extender mounts it, e.g.::

    @app.post("/mutate")
    def mutate(review: dict[str, Any]) -> dict[str, Any]:
        return mutate_pod(review)

and, when :func:`mutate_pod` raises :class:`ValueError` (a malformed review), answers
:func:`error_review` if the request's uid can be read (the pod is admitted unchanged, the reason is in
``status`` and in a warning), and HTTP 400 only when it cannot.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gputopo.model import PREFIX, SCHEDULER_NAME

__all__ = [
    "ADMISSION_API_VERSION",
    "DEFAULT_SCHEDULER",
    "AdmissionRequest",
    "AdmissionResponse",
    "AdmissionReview",
    "error_review",
    "is_opted_in",
    "mutate_pod",
    "review_uid",
    "scheduler_name_patch",
]

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"
DEFAULT_SCHEDULER = "default-scheduler"


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


def mutate_pod(admission_review: dict[str, Any], scheduler_name: str = SCHEDULER_NAME) -> dict[str, Any]:
    """Answer one AdmissionReview (v1): allow, and patch the scheduler name of opted-in pods.

    Raises :class:`ValueError` (a pydantic ``ValidationError``, or for a review without a request)
    when the input is not an AdmissionReview v1 request; the HTTP layer answers 400 then.
    """
    try:
        review = AdmissionReview.model_validate(admission_review)
    except ValidationError as exc:
        raise ValueError(f"not an admission.k8s.io/v1 AdmissionReview: {_describe(exc)}") from exc
    request = review.request
    if request is None:
        raise ValueError("AdmissionReview has no request")

    response = AdmissionResponse(uid=request.uid, allowed=True)
    is_pod = request.kind.kind == "Pod" or request.resource.resource == "pods"
    if (
        is_pod
        and request.sub_resource == ""
        and request.operation == "CREATE"
        and request.object is not None
        and is_opted_in(request.object)
    ):
        patch = json.dumps(scheduler_name_patch(scheduler_name), separators=(",", ":"))
        response.patch_type = "JSONPatch"
        response.patch = base64.b64encode(patch.encode()).decode()

    return _answer(response)


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
