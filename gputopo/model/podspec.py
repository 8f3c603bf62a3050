"""A Pod spec's GPU request, read by Kubernetes' rules: the GPU count of the one Pod reader (gputopo.model.pod).

A container's count is its request for the resource, which defaults from its limit (an extended
resource's request must equal its limit when both are given). The pod's count is Kubernetes'
effective request (k8s.io/component-helpers resource.PodRequests): the app containers' sum plus the
sidecars' (init containers with `restartPolicy: Always`, which keep running beside them), or, when
larger, the peak while init containers run one by one (each beside the sidecars started before it).
A count is a Kubernetes quantity (a string such as "4" or "2k", or a JSON number) that is a whole,
non-negative number within int64; anything else raises `PodSpecError` naming the field. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from gputopo.model.names import GPU_RESOURCE
from gputopo.model.quantity import MAX_QUANTITY, parse_quantity

SIDECAR_RESTART_POLICY = "Always"  # an init container with it is a sidecar (Kubernetes >= 1.29)


class PodSpecError(ValueError):
    """A Pod field this reader (or gputopo.model.pod's) cannot use; the message names the field and the value."""


class PodGpus(NamedTuple):
    """What a Pod spec asks of one resource."""

    total: int  # Kubernetes' effective request: what the node must have free
    containers: tuple[tuple[str, int], ...]  # (name, count) of every app container, in spec order


def short_repr(value: Any, limit: int = 40) -> str:
    """`value`'s repr, cut to `limit` characters: messages quote what they refuse, briefly."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_COUNTS: dict[str, int] = {}  # quantity text -> whole count, for texts that parsed as such


def quantity_count(raw: Any, where: str) -> int:
    """One container's count of an extended resource at field `where`. NaN, infinities, 1e400 and
    400-digit strings are refused by the shared quantity parser, fast, with the field named."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise PodSpecError(f"{where}: {short_repr(raw)} is not a Kubernetes quantity")
    if isinstance(raw, float) and not math.isfinite(raw):
        raise PodSpecError(f"{where}: {raw!r} is not a finite number of GPUs")
    text = raw if isinstance(raw, str) else repr(raw)
    known = _COUNTS.get(text)
    if known is not None:
        return known
    try:
        value = parse_quantity(text)
    except ValueError as e:
        raise PodSpecError(f"{where}: {short_repr(raw)}: {e}") from None
    if value < 0 or value != value.to_integral_value():
        raise PodSpecError(f"{where}: {short_repr(raw)} is not a whole, non-negative number of GPUs")
    if len(_COUNTS) < 1024:  # a pod is read up to five times per scheduling (verbs, watch, bind)
        _COUNTS[text] = int(value)
    return int(value)


def container_count(resources: Any, where: str, resource: str = GPU_RESOURCE) -> int:
    """A container's request of `resource` from its `resources` (None: none); `where` names the container."""
    if resources is None:
        return 0
    if not isinstance(resources, Mapping):
        raise PodSpecError(f"{where}.resources must be an object")
    request = limit = None
    for kind in ("requests", "limits"):
        values = resources.get(kind)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise PodSpecError(f"{where}.resources.{kind} must be an object")
        if resource in values:
            raw = values[resource]
            known = _COUNTS.get(raw) if isinstance(raw, str) else None  # before the field's name is built
            n = known if known is not None else quantity_count(raw, f"{where}.resources.{kind}.{resource}")
            if kind == "requests":
                request = n
            else:
                limit = n
    if request is None:
        return limit or 0
    if limit is not None and limit != request:
        raise PodSpecError(
            f"{where}.resources.requests.{resource}: {request} differs from the limit {limit}"
            " (an extended resource's request must equal its limit)"
        )
    return request


def _containers(spec: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    value = spec.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise PodSpecError(f"{where}.{key} must be a list of containers")
    for i, c in enumerate(value):
        if not isinstance(c, Mapping):
            raise PodSpecError(f"{where}.{key}[{i}] must be a container object")
    return value


def read_pod_gpus(spec: Mapping[str, Any], where: str = "spec", resource: str = GPU_RESOURCE) -> PodGpus:
    """The Pod spec's request of `resource` (nvidia.com/gpu by default); `where` names the spec in errors."""
    apps = []
    for i, c in enumerate(_containers(spec, "containers", where)):
        n = container_count(c.get("resources"), f"{where}.containers[{i}]", resource)
        apps.append((str(c.get("name") or f"#{i}"), n))
    sidecars = peak = 0
    for i, c in enumerate(_containers(spec, "initContainers", where)):
        n = container_count(c.get("resources"), f"{where}.initContainers[{i}]", resource)
        if c.get("restartPolicy") == SIDECAR_RESTART_POLICY:
            sidecars += n  # started in order and kept running: each later container runs beside it
            peak = max(peak, sidecars)
        else:
            peak = max(peak, sidecars + n)
    total = max(sum(n for _, n in apps) + sidecars, peak)
    if total > MAX_QUANTITY:
        raise PodSpecError(f"{where}: the containers ask for more than {MAX_QUANTITY} GPUs in all")
    return PodGpus(total, tuple(apps))
