"""A ResourceClaimTemplate object (resource.k8s.io/v1), read once: the project's one reader of them. Pure.

Three parts of the extender read templates, all through here: the templates informer
(gputopo.extender.watch.computedomains: which templates ask for an IMEX channel, and the ComputeDomain UID
NVIDIA's driver labels them with; and, through gputopo.model.claimask, what a hand-written template asks of
gputopo's devices), the webhook's check of a template of gputopo's name
(gputopo.extender.webhook.templatecheck: the claim spec it holds) and the keeper's collector
(gputopo.extender.webhook.claimtemplates: the identity and preconditions of gputopo's own templates).
gputopo.engine.dra.claims builds the templates gputopo writes, stamped with the labels and the spec
digest named here.

`template_meta` reads the metadata alone; `read_claim_template` reads it and the claim spec. A field that
cannot be read raises `TemplateError`, whose message names the object and the field
(`ResourceClaimTemplate ns/name: spec.spec.devices.requests[0] is not an object`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gputopo.model.dra import TEMPLATE_PREFIX
from gputopo.model.podspec import short_repr

# NVIDIA's ComputeDomain IMEX channel: the device class of the one request of each ComputeDomain's
# channel template, and the label its kubelet plugin sets to the ComputeDomain's UID on that template
# and on each node whose channel serves it.
CHANNEL_DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"
COMPUTE_DOMAIN_LABEL = "resource.nvidia.com/computeDomain"
# What gputopo stamps on the templates it makes: who made them, and the digest of the spec they were made
# from (the API server may add defaults to a stored spec). The digest is never trusted for the content:
# anyone who may write a template can copy it, so the webhook compares the spec itself.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gputopo"
SPEC_DIGEST_ANNOTATION = "gputopo.io/claim-spec-digest"
MAX_REQUESTS = 128  # resource.k8s.io's cap on a claim's requests (and on a request's firstAvailable)

Key = tuple[str, str]  # (namespace, name)


class TemplateError(ValueError):
    """A ResourceClaimTemplate this reader cannot use; the message names the object and the field."""


@dataclass(frozen=True)
class TemplateMeta:
    """A template's identity and what gputopo and NVIDIA's driver write on it."""

    namespace: str
    name: str
    uid: str = ""  # the API server sets it; "" in an object made by hand
    resource_version: str = ""
    managed_by: str = ""  # MANAGED_BY_LABEL's value
    compute_domain_uid: str | None = None  # COMPUTE_DOMAIN_LABEL's value; None without one
    digest: str = ""  # SPEC_DIGEST_ANNOTATION's value: which spec gputopo made it from (never trusted)

    @property
    def key(self) -> Key:
        return self.namespace, self.name

    @property
    def gputopos(self) -> bool:
        """Named and labelled as a template gputopo makes (gputopo.engine.dra.claims)."""
        return self.managed_by == MANAGED_BY and self.name.startswith(TEMPLATE_PREFIX + "-")


@dataclass(frozen=True)
class ClaimTemplateInfo:
    """A template's metadata and its claim spec (`spec.spec`), with the device classes it asks for."""

    meta: TemplateMeta
    claim_spec: Mapping[str, Any]  # spec.spec ({} when absent)
    devices: Mapping[str, Any]  # spec.spec.devices ({} when absent)
    device_classes: tuple[str, ...]  # each request's deviceClassName, exactly or among firstAvailable

    @property
    def channel(self) -> bool:
        """Whether it asks for a ComputeDomain's IMEX channel (NVIDIA's channel template)."""
        return CHANNEL_DEVICE_CLASS in self.device_classes


def _label(obj: Any) -> str:
    """How an error names the object: `ResourceClaimTemplate ns/name` as far as it can be read."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    namespace = meta.get("namespace") if isinstance(meta, Mapping) else None
    parts = [p if len(p) <= 80 else p[:79] + "…" for p in (namespace, name) if isinstance(p, str) and p]
    return "ResourceClaimTemplate " + ("/".join(parts) or "(unnamed)")


def _map(value: Any, where: str, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TemplateError(f"{what}: {where} is not an object")
    return value


def _list(value: Any, where: str, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_REQUESTS:
        raise TemplateError(f"{what}: {where} is not a list of at most {MAX_REQUESTS}")
    return value


def _strings(value: Any, where: str, what: str) -> Mapping[str, str]:
    """Labels and annotations: Kubernetes only has string values."""
    strings = _map(value, where, what)
    for k, v in strings.items():
        if not isinstance(v, str):
            raise TemplateError(f"{what}: {where}[{short_repr(k)}] must be a string, not {type(v).__name__}")
    return strings


def _opt_str(value: Any, where: str, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TemplateError(f"{what}: {where} must be a string")
    return value


def template_meta(obj: Any) -> TemplateMeta:
    """A ResourceClaimTemplate's metadata; TemplateError naming the field when it cannot be read."""
    what = _label(obj)
    meta = _map(_map(obj, "the object", what).get("metadata"), "metadata", what)
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        raise TemplateError(f"{what}: metadata.name or metadata.namespace is missing or not a string")
    labels = _strings(meta.get("labels"), "metadata.labels", what)
    annotations = _strings(meta.get("annotations"), "metadata.annotations", what)
    return TemplateMeta(
        namespace=namespace,
        name=name,
        uid=_opt_str(meta.get("uid"), "metadata.uid", what),
        resource_version=_opt_str(meta.get("resourceVersion"), "metadata.resourceVersion", what),
        managed_by=labels.get(MANAGED_BY_LABEL, ""),
        compute_domain_uid=labels.get(COMPUTE_DOMAIN_LABEL) or None,
        digest=annotations.get(SPEC_DIGEST_ANNOTATION, ""),
    )


def read_claim_template(obj: Any) -> ClaimTemplateInfo:
    """A ResourceClaimTemplate's metadata and claim spec; TemplateError naming the field when either
    cannot be read. A deviceClassName that is not a string names no class (it is left out)."""
    meta = template_meta(obj)
    what = _label(obj)
    claim_spec = _map(_map(obj.get("spec"), "spec", what).get("spec"), "spec.spec", what)
    devices = _map(claim_spec.get("devices"), "spec.spec.devices", what)
    classes: list[Any] = []
    for i, request in enumerate(_list(devices.get("requests"), "spec.spec.devices.requests", what)):
        where = f"spec.spec.devices.requests[{i}]"
        request = _map(request, where, what)
        classes.append(_map(request.get("exactly"), f"{where}.exactly", what).get("deviceClassName"))
        for j, alternative in enumerate(_list(request.get("firstAvailable"), f"{where}.firstAvailable", what)):
            classes.append(_map(alternative, f"{where}.firstAvailable[{j}]", what).get("deviceClassName"))
    return ClaimTemplateInfo(meta, claim_spec, devices, tuple(c for c in classes if isinstance(c, str)))
