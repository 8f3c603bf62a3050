"""The webhook's read of a pod's ResourceClaimTemplate: whether the template of its name, if it exists,
holds the spec gputopo's builder makes (`same_template`, by content, never by the digest annotation,
which anyone who can write the template can copy). The template is fetched with the extender's one
Kubernetes client (`gputopo.kube`, at `RESOURCECLAIMTEMPLATES`' path) and read by the one
ResourceClaimTemplate reader (`gputopo.model.claimtemplate`). Read-only:
`gputopo.extender.webhook.claimtemplates` keeps the templates themselves."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gputopo.engine.dra.claims import ClaimTemplate
from gputopo.kube import JSON, RESOURCECLAIMTEMPLATES, KubeError
from gputopo.model.claimtemplate import TemplateError, read_claim_template

DEFAULT_TTL_SECONDS = 60.0
DEFAULT_MAX_ENTRIES = 4096


def templates_path(namespace: str, name: str = "") -> str:
    """The templates of `namespace` (or the one named): InvalidName for a namespace or name Kubernetes would
    refuse, before any request."""
    return RESOURCECLAIMTEMPLATES.path(namespace, name)


class TemplateReader(Protocol):
    """What `check` asks of the API client (`gputopo.kube.Kube` is one). Failures raise KubeError."""

    def get(self, path: str) -> JSON: ...


class TemplateConflict(Exception):
    """A ResourceClaimTemplate of our name holds another spec; the message names it."""


def _empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _same(have: Any, want: Any) -> bool:
    """`have` says what `want` says: every key of `want` equal, and any other key of `have` empty (what the
    API server defaults, e.g. `tolerations: []`); a key with content we did not write (an extra
    selector, a toleration, admin access) makes them differ."""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        if not all(k in have and _same(have[k], v) for k, v in want.items()):
            return False
        return all(_empty(v) for k, v in have.items() if k not in want)
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(_same, have, want))
    return bool(have == want)


def same_template(existing: Mapping[str, Any], template: ClaimTemplate) -> bool:
    """True when `existing` (a ResourceClaimTemplate read back, by gputopo.model.claimtemplate) holds
    `template`'s spec; one that reader refuses holds another. Its digest annotation is not compared: a
    copied digest over other content is another spec."""
    try:
        read = read_claim_template(existing)
    except TemplateError:
        return False
    if not read.claim_spec or not all(k == "devices" or _empty(v) for k, v in read.claim_spec.items()):
        return False  # a claim spec with more than devices (none today) is not ours
    return _same(read.devices, template.devices)


def conflict(namespace: str, template: ClaimTemplate) -> TemplateConflict:
    """The refusal of a pod whose template name holds another spec in `namespace`."""
    return TemplateConflict(
        f"ResourceClaimTemplate {namespace}/{template.name} exists with another spec; "
        "it is not the one gputopo makes for this shape: delete or rename it"
    )


class ClaimTemplates:
    """The webhook's read of a pod's template (`check`), remembered for `ttl_seconds` (thread-safe)."""

    def __init__(
        self,
        api: TemplateReader,
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

    def check(self, namespace: str, template: ClaimTemplate) -> None:
        """Raise TemplateConflict when `namespace` holds another spec under `template`'s name; absent is
        fine (the keeper makes it once the pod exists). KubeError when it cannot be read."""
        key = (namespace, template.name)
        if self._fresh(key):
            return
        try:
            existing = self.api.get(templates_path(namespace, template.name))
        except KubeError as e:
            if e.status != 404:
                raise
        else:
            if not same_template(existing, template):
                raise conflict(namespace, template)
        self._remember(key)
