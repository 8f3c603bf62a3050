"""The extender's only seam to the API server: the `ClusterSource` protocol, its implementation on
the project's Kubernetes layer (`gputopo.kube`), and the informers that keep the cache current.

`KubeSource` lists and watches the kinds the extender reads (nodes, pods, the agents' Leases, Jobs,
PodGroups, DRA's ResourceClaims and ResourceSlices) as raw JSON and makes its three writes (Binding,
Event, and the JSON patch that removes gputopo's scheduling gate from a pod); at bind it reads a DRA
pod's ResourceClaims fresh. `Informer` runs one
list+watch loop per kind in a thread (`gputopo.kube.run_list_watch`, the informer core the agent's pod
view shares) and hands objects to a handler (the cache, which locks):
410 Gone relists, any other failure reconnects, both after a jittered, capped exponential backoff as
client-go's reflector waits (a watch that ends at once counts as a failure too), and the cache keeps
serving meanwhile. The kinds, their paths and scopes are declared once, in `gputopo.kube.kinds.WATCHED`.
A kind the API server may not serve (`optional` there: PodGroups before Kubernetes 1.36 or without the
Workload API) whose list gets 404 counts as listed empty and is looked for again only every
`not_served_recheck_seconds`. The DRA kinds are read only where the chart grants them (`rbac_optional`,
with `agent.dra.enabled`): elsewhere their 403 counts the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from gputopo.kube import JSON as JSON
from gputopo.kube import (
    KIND_NAMES,
    RESOURCECLAIMS,
    Gone,
    KindName,
    Kube,
    KubeError,
    Pacing,
    WatchEvent,
    lease_path,
    node_path,
    pod_path,
    pods_path,
    run_list_watch,
    watched,
)

Kind = KindName  # a name of `gputopo.kube.kinds.WATCHED`, as the extender's signatures say it

NOT_SERVED_RECHECK_SECONDS = 600.0

log = logging.getLogger("gputopo.extender.watch.source")


class ClusterSource(Protocol):
    """Everything the extender asks of the API server. Failures raise `gputopo.kube.KubeError`."""

    def list_objects(self, kind: Kind) -> tuple[list[JSON], str]:
        """All objects of `kind` (leases: only the agents' namespace) and the list's resourceVersion."""
        ...

    def watch(self, kind: Kind, resource_version: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        """Changes after `resource_version`; ends after `timeout_seconds`; raises `Gone` on 410."""
        ...

    def get_pod(self, namespace: str, name: str) -> JSON: ...

    def get_resource_claim(self, namespace: str, name: str) -> JSON:
        """One ResourceClaim as the API server holds it now (the bind reads a DRA pod's allocation)."""
        ...

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
        """POST pods/binding with the placement annotations: one call places and binds."""
        ...

    def create_event(self, namespace: str, event: JSON) -> None: ...

    def patch_pod(self, namespace: str, name: str, ops: list[JSON]) -> None:
        """A JSON patch of the pod (gputopo's scheduling gate removed: gputopo.extender.verbs.groupgates)."""
        ...

    def close(self) -> None: ...


class KubeSource:
    """ClusterSource over `gputopo.kube.Kube`: a kubeconfig file, or in-cluster config when None."""

    def __init__(self, kubeconfig: Path | None, namespace: str, *, request_timeout: float = 10.0) -> None:
        self.api = Kube(kubeconfig, request_timeout=request_timeout)
        self.namespace = namespace

    def _path(self, kind: Kind) -> str:
        declared = watched(kind)
        return declared.path(self.namespace if declared.one_namespace else None)

    def list_objects(self, kind: Kind) -> tuple[list[JSON], str]:
        return self.api.list_items(self._path(kind))

    def watch(self, kind: Kind, resource_version: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        return self.api.watch(self._path(kind), resource_version, timeout_seconds=timeout_seconds)

    def get_pod(self, namespace: str, name: str) -> JSON:
        return self.api.get(pod_path(namespace, name))

    def get_resource_claim(self, namespace: str, name: str) -> JSON:
        return self.api.get(RESOURCECLAIMS.path(namespace, name))

    # `gputopo topo` reads these too, through the same client the extender uses.

    def get_node(self, name: str) -> JSON:
        return self.api.get(node_path(name))

    def get_lease(self, name: str) -> JSON:
        return self.api.get(lease_path(self.namespace, name))

    def list_pods(self, *, field_selector: str = "") -> list[JSON]:
        return self.api.list_items(pods_path(), field_selector=field_selector)[0]

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
        self.api.create_binding(namespace, name, uid, node, annotations=annotations)

    def create_event(self, namespace: str, event: JSON) -> None:
        self.api.create_event(namespace, event)

    def patch_pod(self, namespace: str, name: str, ops: list[JSON]) -> None:
        self.api.json_patch(pod_path(namespace, name), ops)

    def close(self) -> None:
        self.api.close()


# --------------------------------------------------------------------------------------------------
# list + watch loop


class WatchHandler(Protocol):
    def replace(self, kind: Kind, items: list[JSON]) -> None: ...

    def apply(self, kind: Kind, event_type: str, obj: JSON) -> None: ...

    def not_served(self, kind: Kind) -> None: ...

    def heard_from_api(self) -> None: ...


class Informer:
    """One kind's list+watch loop. `run()` is the thread body; `relist()`/`watch_once()` are its steps.

    `pacing` says how long it waits after a failed round (`gputopo.kube.Pacing`: client-go's reflector's
    figures unless a test passes others); `on_relist(kind)` is called as each list is asked for (the
    relist counter)."""

    def __init__(
        self,
        source: ClusterSource,
        kind: Kind,
        handler: WatchHandler,
        *,
        watch_timeout_seconds: int = 300,
        pacing: Pacing | None = None,
        not_served_recheck_seconds: float = NOT_SERVED_RECHECK_SECONDS,
        on_relist: Callable[[Kind], None] | None = None,
    ) -> None:
        self.source = source
        self.kind = kind
        self.handler = handler
        self.watch_timeout_seconds = watch_timeout_seconds
        self.pacing = pacing or Pacing()
        self.on_relist = on_relist
        self.resource_version = ""
        self.relists = 0
        self.synced = threading.Event()
        self.stop = threading.Event()
        self.not_served_recheck_seconds = not_served_recheck_seconds
        self.served = True  # False while an optional kind's list answers 404

    def relist(self) -> None:
        if self.on_relist is not None:
            self.on_relist(self.kind)
        try:
            items, rv = self.source.list_objects(self.kind)
        except KubeError as e:
            declared = watched(self.kind)
            not_here = e.status == 404 or (e.status == 403 and declared.rbac_optional)
            if not not_here or not declared.optional:
                raise
            self._not_served(e)
            return
        if not self.served:
            log.info("the API now serves this kind; watching it", extra={"kind": self.kind})
        self.served = True
        self.handler.replace(self.kind, items)
        self.handler.heard_from_api()
        self.resource_version = rv
        self.relists += 1
        self.synced.set()

    def _not_served(self, error: KubeError) -> None:
        """An optional kind the API server does not serve: none of its objects exist. Said once; the
        next look is `not_served_recheck_seconds` away (never a hot retry), and nothing waits for it."""
        if self.served:
            log.info(
                "the API server does not serve this kind; looking again later",
                extra={"kind": self.kind, "error": str(error), "retry_in_s": self.not_served_recheck_seconds},
            )
        self.served = False
        self.handler.replace(self.kind, [])
        self.handler.not_served(self.kind)
        self.resource_version = ""
        self.synced.set()
        self.stop.wait(self.not_served_recheck_seconds)

    def watch_once(self, timeout_seconds: int | None = None) -> None:
        """Consume one watch until it ends; a 410 Gone relists at once (the next watch starts from
        there). A step for callers that drive the informer themselves: `run()` waits before that relist."""
        try:
            self._watch(timeout_seconds)
        except Gone:
            log.info("watch expired (410 Gone); relisting", extra={"kind": self.kind})
            self.relist()

    def _watch(self, timeout_seconds: int | None = None) -> bool:
        """Consume one watch until it ends (False: nothing to watch); raises `Gone` on 410."""
        if not self.served:
            return False  # relist waited and will look again
        timeout = self.watch_timeout_seconds if timeout_seconds is None else timeout_seconds
        for ev in self.source.watch(self.kind, self.resource_version, timeout_seconds=timeout):
            if self.stop.is_set():
                break
            meta = ev.object.get("metadata") if isinstance(ev.object, dict) else None
            rv = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
            if ev.type != "BOOKMARK":
                self.handler.apply(self.kind, ev.type, ev.object)
            self.handler.heard_from_api()
            if rv:
                self.resource_version = rv
        return True

    def run(self) -> None:
        run_list_watch(
            stop=self.stop,
            needs_list=lambda: not self.synced.is_set() or not self.resource_version,
            relist=self.relist,
            watch_once=self._watch,
            context={"kind": self.kind},
            pacing=self.pacing,
        )


def start_informers(
    source: ClusterSource, handler: WatchHandler, *, kinds: tuple[Kind, ...] = KIND_NAMES, **kw: Any
) -> list[tuple[Informer, threading.Thread]]:
    out = []
    for kind in kinds:
        inf = Informer(source, kind, handler, **kw)
        t = threading.Thread(target=inf.run, name=f"gputopo-watch-{kind}", daemon=True)
        t.start()
        out.append((inf, t))
    return out
