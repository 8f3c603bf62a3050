"""The `gputopo.io/gpus-in-use` node annotation: which GPUs each pod holds, as the agent sees them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gputopo.model.base import AnnotationError, short_value
from gputopo.model.names import GPUS_IN_USE_ANNOTATION

# Bounds: a node has at most a few dozen GPUs; these only stop a hostile or corrupt value from costing
# the extender real work. Kubernetes UIDs are 36 characters.
MAX_IN_USE_BYTES = 64 * 1024
MAX_IN_USE_PODS = 1024
MAX_POD_UID_LENGTH = 128
MAX_GPU_INDEX = 4096
IN_USE_VERSION = 2


@dataclass(frozen=True)
class GpusInUse:
    """A node's GPUs in use as its agent reports them: per pod UID, plus `other` (GPUs held by pods the
    agent cannot attribute, or used outside pods). No GPU is in two pods."""

    pods: Mapping[str, frozenset[int]] = field(default_factory=dict)
    other: frozenset[int] = frozenset()

    @property
    def all(self) -> frozenset[int]:
        used = set(self.other)
        for gpus in self.pods.values():
            used |= gpus
        return frozenset(used)

    def to_annotation(self) -> str:
        """Version 2, compact, UIDs and indices sorted: unchanged truth always gives the same bytes."""
        pods = {uid: sorted(self.pods[uid]) for uid in sorted(self.pods) if self.pods[uid]}
        return json.dumps({"version": IN_USE_VERSION, "pods": pods, "other": sorted(self.other)}, separators=(",", ":"))


def _indices(text: str, value: Any, gpu_count: int | None, where: str) -> frozenset[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"{where}: not a JSON list of GPU indices")
    limit = MAX_GPU_INDEX if gpu_count is None else gpu_count
    if any(i < 0 or i >= limit for i in value):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"{where}: index out of range for {limit} GPUs")
    return frozenset(value)


def parse_gpus_in_use_report(text: str, gpu_count: int | None = None) -> GpusInUse:
    """Parse `gputopo.io/gpus-in-use`: version 2 `{"version":2,"pods":{UID:[...]},"other":[...]}`, or
    a plain JSON list of indices (version 1, read as all `other`). Raises AnnotationError only."""
    if len(text) > MAX_IN_USE_BYTES:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"longer than {MAX_IN_USE_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # ValueError: bad JSON, or an integer with too many digits
        raise AnnotationError(
            GPUS_IN_USE_ANNOTATION, text, "not a JSON list of GPU indices nor a version 2 object"
        ) from None
    if isinstance(data, list):
        return GpusInUse(other=_indices(text, data, gpu_count, "value"))
    if not isinstance(data, dict):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "not a JSON list of GPU indices nor a version 2 object")
    version = data.get("version")
    if type(version) is not int or version != IN_USE_VERSION:  # not True, not 2.0
        raise AnnotationError(
            GPUS_IN_USE_ANNOTATION,
            text,
            f"unsupported version {version!r}; this gputopo reads a plain list (version 1) or version {IN_USE_VERSION}",
        )
    unknown = sorted(str(k) for k in data if k not in ("version", "pods", "other"))
    if unknown:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "unknown keys " + ", ".join(unknown[:3]))
    other = _indices(text, data.get("other", []), gpu_count, "other")
    raw_pods = data.get("pods", {})
    if not isinstance(raw_pods, dict):
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, "pods is not an object of pod UID to GPU indices")
    if len(raw_pods) > MAX_IN_USE_PODS:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"more than {MAX_IN_USE_PODS} pods")
    pods: dict[str, frozenset[int]] = {}
    owner: dict[int, str] = {}
    for uid, value in raw_pods.items():
        if not uid or len(uid) > MAX_POD_UID_LENGTH:
            raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"pod UID must be 1..{MAX_POD_UID_LENGTH} characters")
        gpus = _indices(text, value, gpu_count, f"pods[{short_value(uid, 40)}]")
        for i in gpus:
            if i in owner:
                raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"GPU {i} is in two pods")
            owner[i] = uid
        if gpus:  # an empty list says nothing; dropped so equal truth compares equal
            pods[uid] = gpus
    both = sorted(other & owner.keys())
    if both:
        raise AnnotationError(GPUS_IN_USE_ANNOTATION, text, f"GPU {both[0]} is both in a pod and in other")
    return GpusInUse(pods=pods, other=other)


def parse_gpus_in_use(text: str, gpu_count: int | None = None) -> frozenset[int]:
    """Every GPU in use on the node (either version), whoever holds it."""
    return parse_gpus_in_use_report(text, gpu_count).all


def format_gpus_in_use(indices: frozenset[int] | set[int] | list[int]) -> str:
    """A version 1 value (a plain list); agents publish version 2 (`GpusInUse.to_annotation`)."""
    return json.dumps(sorted(set(indices)), separators=(",", ":"))
