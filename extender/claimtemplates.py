"""The webhook's one write under DRA: the ResourceClaimTemplate a pod's claim is made from, ensured in the
pod's namespace through the extender's Kubernetes client (gputopo.kube).

`ClaimTemplates.ensure` creates the template; 409 means one of that name exists, and it is read back: the
same spec (by gputopo's digest annotation, or by content when the annotation is gone) is fine, another
spec raises `TemplateConflict` naming it. Templates are shared by every pod of the same shape in a
namespace, so a namespace and name once ensured is remembered for `ttl_seconds`: a Job's thousand pods
cost one create, and a template deleted by hand is made again within the TTL.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gputopo.engine.draclaims import SPEC_DIGEST_ANNOTATION, ClaimTemplate
from gputopo.kube import JSON, KubeError

DEFAULT_TTL_SECONDS = 60.0
DEFAULT_MAX_ENTRIES = 4096


def templates_path(namespace: str, name: str = "") -> str:
    base = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
    return f"{base}/{name}" if name else base


class TemplateApi(Protocol):
    """What `ensure` asks of the API client (`gputopo.kube.Kube` is one). Failures raise KubeError."""

    def get(self, path: str) -> JSON: ...

    def create(self, path: str, body: Mapping[str, Any]) -> JSON: ...


class TemplateConflict(Exception):
    """A ResourceClaimTemplate of our name holds another spec; the message names it."""


def _contains(have: Any, want: Any) -> bool:
    """`have` holds everything `want` says (the API server may add defaulted fields, never drop ours)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and _contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(_contains, have, want))
    return bool(have == want)


def same_template(existing: Mapping[str, Any], template: ClaimTemplate) -> bool:
    """True when `existing` (a ResourceClaimTemplate read back) was made from `template`'s spec."""
    meta = existing.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if isinstance(annotations, Mapping) and annotations.get(SPEC_DIGEST_ANNOTATION) == template.digest:
        return True
    spec = existing.get("spec")
    inner = spec.get("spec") if isinstance(spec, Mapping) else None
    devices = inner.get("devices") if isinstance(inner, Mapping) else None
    return _contains(devices, template.devices)


class ClaimTemplates:
    """Ensures templates, remembering the ones it made or found for `ttl_seconds` (thread-safe)."""

    def __init__(
        self,
        api: TemplateApi,
        *,
        clock: Callable[[], float] = time.monotonic,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.api = api
        self.clock = clock
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()
        self.creates = 0  # templates this process created (tests and metrics read it)

    def _fresh(self, key: tuple[str, str]) -> bool:
        with self._lock:
            at = self._seen.get(key)
            return at is not None and self.clock() - at < self.ttl_seconds

    def _remember(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._seen[key] = self.clock()
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)

    def ensure(self, namespace: str, template: ClaimTemplate) -> None:
        """Make sure `template` exists in `namespace`. Raises TemplateConflict (another spec under our
        name) or KubeError (the API server refused or could not be reached)."""
        key = (namespace, template.name)
        if self._fresh(key):
            return
        try:
            self.api.create(templates_path(namespace), template.body(namespace))
            self.creates += 1
        except KubeError as e:
            if e.status != 409:
                raise
            existing = self.api.get(templates_path(namespace, template.name))
            if not same_template(existing, template):
                raise TemplateConflict(
                    f"ResourceClaimTemplate {namespace}/{template.name} exists with another spec; "
                    "it is not the one gputopo makes for this shape: delete or rename it"
                ) from None
        self._remember(key)
