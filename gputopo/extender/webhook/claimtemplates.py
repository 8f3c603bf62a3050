"""The ResourceClaimTemplates of gputopo's DRA claims: read at admission, written only for real pods.

The webhook (gputopo/extender/webhook/mutation.py) only answers a patch naming a template; it never writes. Anyone who
reaches its port could send it a review, so a write there would follow a forged or later refused pod.
Writes follow objects the API server holds instead:

- `ClaimTemplates.check` (the webhook, read-only): a template of the pod's name that exists with
  another spec refuses the pod, naming it (`TemplateConflict`); one that does not exist yet is fine.
  Answers are remembered for `ttl_seconds` per namespace and name (bounded), so a Job's thousand pods
  cost one read.
- `TemplateKeeper` (the extender's pod informer, `pod_changed`/`pods_replaced`): a pod that exists,
  is not terminated, runs under gputopo's scheduler and names a template that gputopo's builder makes
  under that name (`gputopo.engine.dra.claims.template_named`) gets it created in its namespace, at most
  `max_per_namespace` of gputopo's templates per namespace. kube-controller-manager's resourceclaim
  controller retries a pod whose template is missing, so the pod's claim follows within seconds.
- `TemplateKeeper.collect` (every `pass_seconds`, once the pod informer has listed): deletes gputopo's
  templates (label `app.kubernetes.io/managed-by: gputopo`, name `gputopo-gpus-...`) that no pod in
  their namespace has named for `grace_seconds`, at most `max_deletes_per_pass` per pass, with the
  uid and resourceVersion it listed as preconditions. A template deleted just as a pod names it again
  is made again for that pod (the keeper forgets what it deleted).

A template's spec is compared by content, never by the digest annotation, which anyone who can write
the template can copy (`same_template`). Templates are fetched with the extender's one Kubernetes client
(`gputopo.kube`, at `RESOURCECLAIMTEMPLATES`' paths) and read by the one template reader,
`gputopo.model.claimtemplate`; the pods that name them by the one Pod reader, `gputopo.model.pod`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gputopo.engine.dra.claims import ClaimTemplate, template_named
from gputopo.extender.webhook.mutation import DraMode

# The webhook's read-only check lives in its own module; its names stay importable from here.
from gputopo.extender.webhook.templatecheck import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL_SECONDS,
    ClaimTemplates,
    TemplateConflict,
    TemplateReader,
    conflict,
    same_template,
    templates_path,
)
from gputopo.kube import JSON, RESOURCECLAIMTEMPLATES, KubeError
from gputopo.model import SCHEDULER_NAME
from gputopo.model.claimtemplate import MANAGED_BY, MANAGED_BY_LABEL, TemplateError, TemplateMeta, template_meta
from gputopo.model.dra import TEMPLATE_PREFIX
from gputopo.model.pod import read_pod
from gputopo.model.podspec import PodSpecError

__all__ = [
    "ClaimTemplates",
    "KeeperLimits",
    "TemplateApi",
    "TemplateConflict",
    "TemplateKeeper",
    "TemplateReader",
    "same_template",
    "templates_path",
]

DEFAULT_GRACE_SECONDS = 300.0
DEFAULT_PASS_SECONDS = 60.0
DEFAULT_MAX_PER_NAMESPACE = 64
DEFAULT_MAX_DELETES_PER_PASS = 50
ALL_TEMPLATES = RESOURCECLAIMTEMPLATES.path()

log = logging.getLogger("gputopo.extender.webhook.claimtemplates")


class TemplateApi(TemplateReader, Protocol):
    """What the keeper asks of the API client as well."""

    def create(self, path: str, body: Mapping[str, Any]) -> JSON: ...

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> JSON: ...

    def list_items(self, path: str, *, label_selector: str = "") -> tuple[list[JSON], str]: ...


# --------------------------------------------------------------------------------------------------
# the keeper: templates follow the pods the API server holds


Key = tuple[str, str]  # (namespace, template name)


@dataclass(frozen=True, kw_only=True)
class KeeperLimits:
    """How often and how much the keeper acts (module doc): a template no pod names is deleted after
    `grace_seconds`, in passes every `pass_seconds`, at most `max_deletes_per_pass` a pass; at most
    `max_per_namespace` of gputopo's templates per namespace; a template made is not checked again for
    `ttl_seconds`; at most `max_pending` templates wait to be made."""

    grace_seconds: float = DEFAULT_GRACE_SECONDS
    pass_seconds: float = DEFAULT_PASS_SECONDS
    ttl_seconds: float = DEFAULT_TTL_SECONDS * 10
    max_per_namespace: int = DEFAULT_MAX_PER_NAMESPACE
    max_deletes_per_pass: int = DEFAULT_MAX_DELETES_PER_PASS
    max_pending: int = DEFAULT_MAX_ENTRIES


KEEPER_LIMITS = KeeperLimits()


class TemplateKeeper:
    """Creates the templates real pods name and deletes the ones no pod names (see the module doc).

    The pod hooks run on the informer's thread and only record; the API calls run on the keeper's own
    thread (`run`), so an API server that is slow to answer never holds up the pod informer."""

    def __init__(
        self,
        api: TemplateApi,
        *,
        claims: DraMode,
        scheduler_name: str = SCHEDULER_NAME,
        ready: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        limits: KeeperLimits = KEEPER_LIMITS,
    ) -> None:
        self.api = api
        # The claims' encoding, memory classes and blocks: what the webhook builds with (gputopo.engine.dra.claims).
        self.list_attributes = claims.list_attributes
        self.memory_classes = claims.memory_classes
        self.blocks = claims.blocks
        self.scheduler_name = scheduler_name
        self.ready = ready
        self.clock = clock
        self.limits = limits
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.stop = threading.Event()
        # pod uid -> the templates it names (every live pod, whatever its scheduler: in use is in use)
        self._refs: dict[str, tuple[Key, ...]] = {}
        self._users: collections.Counter[Key] = collections.Counter()
        self._wanted: set[Key] = set()  # named by a live pod of gputopo's scheduler
        self._pending: OrderedDict[Key, None] = OrderedDict()
        self._ensured: dict[Key, float] = {}
        self._known: dict[str, set[str]] = {}  # namespace -> gputopo's templates there (last list + creates)
        self._unused_since: dict[Key, float] = {}
        self._builds: dict[str, ClaimTemplate | None] = {}
        self._said: set[Key] = set()  # refusals already logged (keeper thread only)
        self.creates = 0
        self.deletes = 0
        self.refused = 0  # over the per-namespace cap

    # ------------------------------------------------------------------ pod hooks (informer thread)

    def _uses(self, obj: Any) -> tuple[str, tuple[Key, ...], bool]:
        """(uid, the templates the pod names while it lives, whether gputopo should ensure them), read by
        the project's one Pod reader; a pod it refuses, or one without a UID, names nothing."""
        try:
            pod = read_pod(obj)
        except PodSpecError:
            return "", (), False
        if not pod.uid or pod.terminated:
            return pod.uid, (), False
        keys = tuple((pod.namespace, n) for n in pod.claim_templates if n.startswith(TEMPLATE_PREFIX + "-"))
        return pod.uid, keys, pod.scheduler_name == self.scheduler_name and not pod.deleting

    def _set(self, uid: str, keys: tuple[Key, ...]) -> None:
        old = self._refs.pop(uid, ())
        self._users.subtract(old)
        if keys:
            self._refs[uid] = keys
            self._users.update(keys)
        for k in old:
            if self._users[k] <= 0:
                del self._users[k]
                self._wanted.discard(k)

    def pod_changed(self, obj: Any, *, deleted: bool = False) -> None:
        uid, keys, ensure = self._uses(obj)
        if not uid:
            return
        with self._lock:
            self._set(uid, () if deleted else keys)
            if not deleted and ensure:
                self._want(keys)
        if not deleted and ensure and keys:
            self._wake.set()

    def pods_replaced(self, items: Iterable[Any]) -> None:
        with self._lock:
            self._refs.clear()
            self._users.clear()
            self._wanted.clear()
            for obj in items:
                uid, keys, ensure = self._uses(obj)
                if uid:
                    self._set(uid, keys)
                    if ensure:
                        self._want(keys)
        self._wake.set()

    def _want(self, keys: tuple[Key, ...]) -> None:
        """Under the lock: queue the templates not ensured lately."""
        now = self.clock()
        for k in keys:
            self._wanted.add(k)
            at = self._ensured.get(k)
            if (at is not None and now - at < self.limits.ttl_seconds) or k in self._pending:
                continue
            if len(self._pending) < self.limits.max_pending:  # the collector's pass picks up what did not fit
                self._pending[k] = None

    # ------------------------------------------------------------------ the keeper's thread

    def _template(self, name: str) -> ClaimTemplate | None:
        if name not in self._builds:
            if len(self._builds) >= DEFAULT_MAX_ENTRIES:
                self._builds.clear()
            self._builds[name] = template_named(
                name, list_attributes=self.list_attributes, memory_classes=self.memory_classes, blocks=self.blocks
            )
        return self._builds[name]

    def ensure_pending(self) -> int:
        """Create the queued templates; returns how many it created."""
        made = 0
        while not self.stop.is_set():
            with self._lock:
                if not self._pending:
                    return made
                key, _ = self._pending.popitem(last=False)
                if key not in self._wanted:
                    continue  # its pods went meanwhile
            made += self._ensure(key)
        return made

    def _ensure(self, key: Key) -> int:
        namespace, name = key
        template = self._template(name)
        if template is None:
            if self._first(key):
                log.info(
                    "a pod names a gputopo template this gputopo does not make; not creating it",
                    extra={"namespace": namespace, "template": name},
                )
            self._mark(key)
            return 0
        with self._lock:
            known = self._known.setdefault(namespace, set())
            full = name not in known and len(known) >= self.limits.max_per_namespace
        if full:
            self.refused += 1
            if self._first(key):
                log.warning(
                    "namespace holds the most gputopo claim templates allowed; not creating another",
                    extra={"namespace": namespace, "template": name, "max": self.limits.max_per_namespace},
                )
            return 0
        try:
            self.api.create(templates_path(namespace), template.body(namespace))
        except KubeError as e:
            if e.status != 409:
                log.warning(
                    "cannot create a claim template",
                    extra={"namespace": namespace, "template": name, "error": str(e)[:200]},
                )
                return 0
            try:
                existing = self.api.get(templates_path(namespace, name))
            except KubeError as e2:
                log.warning(
                    "cannot read a claim template",
                    extra={"namespace": namespace, "template": name, "error": str(e2)[:200]},
                )
                return 0
            if not same_template(existing, template):
                log.warning(str(conflict(namespace, template)), extra={"namespace": namespace, "template": name})
            self._mark(key)
            return 0
        self.creates += 1
        self._mark(key)
        return 1

    def _first(self, key: Key) -> bool:
        """True the first time `key` is refused (each pass tries it again; the log says it once)."""
        if key in self._said:
            return False
        if len(self._said) >= DEFAULT_MAX_ENTRIES:
            self._said.clear()
        self._said.add(key)
        return True

    def _mark(self, key: Key) -> None:
        with self._lock:
            self._ensured[key] = self.clock()
            self._known.setdefault(key[0], set()).add(key[1])
            if len(self._ensured) > DEFAULT_MAX_ENTRIES:
                oldest = min(self._ensured, key=self._ensured.__getitem__)
                del self._ensured[oldest]

    def collect(self) -> int:
        """One pass: list gputopo's templates, delete those unused for the grace period (bounded), queue
        the ones a pod of ours names but that are missing. Returns how many it deleted. Nothing is deleted
        before the pod informer has listed (`ready`): until then every template would look unused."""
        if not self.ready():
            return 0
        items, _ = self.api.list_items(ALL_TEMPLATES, label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}")
        now = self.clock()
        listed: dict[Key, TemplateMeta] = {}
        for obj in items:
            try:
                meta = template_meta(obj)
            except TemplateError as e:  # the API server validates what it stores: a forged or broken list
                log.debug("skipping an unreadable claim template", extra={"error": str(e)[:200]})
                continue
            if meta.gputopos:  # the list asked for our label; the name says it too
                listed[meta.key] = meta
        with self._lock:
            known: dict[str, set[str]] = {}
            for ns, name in listed:
                known.setdefault(ns, set()).add(name)
            self._known = known
            doomed: list[Key] = []
            for key in listed:
                if self._users.get(key, 0) > 0:
                    self._unused_since.pop(key, None)
                    continue
                since = self._unused_since.setdefault(key, now)
                if now - since >= self.limits.grace_seconds and len(doomed) < self.limits.max_deletes_per_pass:
                    doomed.append(key)
            for key in list(self._unused_since):
                if key not in listed:
                    del self._unused_since[key]
            for key in self._wanted - set(listed):  # deleted by hand, or a create that failed
                self._ensured.pop(key, None)
                if len(self._pending) < self.limits.max_pending:
                    self._pending[key] = None
        deleted = 0
        for key in doomed:
            meta = listed[key]
            preconditions = {k: v for k, v in (("uid", meta.uid), ("resourceVersion", meta.resource_version)) if v}
            with self._lock:
                if self._users.get(key, 0) > 0:  # a pod named it since the list
                    self._unused_since.pop(key, None)
                    continue
            try:
                self.api.delete(templates_path(*key), {"preconditions": preconditions})
            except KubeError as e:
                if e.status not in (404, 409):
                    log.warning(
                        "cannot delete an unused claim template",
                        extra={"namespace": key[0], "template": key[1], "error": str(e)[:200]},
                    )
                continue
            deleted += 1
            with self._lock:
                self._unused_since.pop(key, None)
                self._ensured.pop(key, None)  # a pod naming it again gets it made again
                self._known.get(key[0], set()).discard(key[1])
        self.deletes += deleted
        if deleted:
            log.info("deleted unused claim templates", extra={"count": deleted})
        return deleted

    def run(self) -> None:
        """The keeper's thread: create what pods ask for as they appear; collect every `pass_seconds`."""
        next_pass = self.clock()
        while not self.stop.is_set():
            self._wake.clear()
            try:
                self.ensure_pending()
                if self.clock() >= next_pass:
                    next_pass = self.clock() + self.limits.pass_seconds
                    self.collect()
                    self.ensure_pending()
            except KubeError as e:
                log.warning("claim template pass failed; trying again later", extra={"error": str(e)[:200]})
            except Exception:  # one bad pass must not end the thread that keeps templates
                log.exception("claim template pass failed")
            self._wake.wait(max(0.0, min(self.limits.pass_seconds, next_pass - self.clock())))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="gputopo-claim-templates", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.stop.set()
        self._wake.set()
