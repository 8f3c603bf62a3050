"""A node-local view of the pods bound to this node: what the device plugin and per-pod reporting read.

`KubeLocalPods` lists and watches pods with `fieldSelector=spec.nodeName=<node>` in a daemon thread
(`gputopo.kube.run_list_watch`, the informer core the extender's informers share: 410 Gone relists,
other errors reconnect, both after client-go's reflector's backoff, and a watch that ends at once
waits too), and `refresh()` does one direct LIST for callers that
suspect the watch lags. `StaticLocalPods` holds a fixed list for tests and `--once`. A malformed pod
object is skipped with one log line (what is kept to log it once is bounded: `MAX_LOGGED`); the watch
thread never dies of one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gputopo.kube import Kube, Pacing, on_node, pods_path, run_list_watch
from gputopo.model import GPU_RESOURCE, PLACEMENT_ANNOTATION, AnnotationError, Placement, parse_placement
from gputopo.model.pod import TERMINAL_PHASES, read_pod
from gputopo.model.podspec import PodSpecError

log = logging.getLogger(__name__)

JSON = dict[str, Any]
MAX_LOGGED = 1024  # (pod, problem) pairs remembered as logged
MAX_LOGGED_KEY = 256  # characters of each kept


@dataclass(frozen=True)
class LocalPod:
    """What the device plugin reads of a pod bound to this node (built from gputopo.model.pod.PodInfo)."""

    uid: str
    namespace: str
    name: str
    phase: str  # status.phase, "" if absent
    gpus_requested: int  # Kubernetes' effective request of the plugin's resource (gputopo.model.podspec)
    container_gpus: tuple[tuple[str, int], ...]  # (container name, GPUs), app containers in spec order, only > 0
    placement: Placement | None  # gputopo.io/placement when it names THIS node, else None
    created: float  # metadata.creationTimestamp as epoch seconds

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class LocalPods(Protocol):
    def pods(self) -> Sequence[LocalPod]:
        """Non-terminated pods bound to this node."""
        ...

    def get(self, namespace: str, name: str) -> LocalPod | None: ...

    def refresh(self) -> None:
        """One direct LIST now (used when the view may lag)."""
        ...


class MalformedPodError(ValueError):
    """A pod object this view cannot read; the message names the field."""


def parse_local_pod(
    obj: Mapping[str, Any], node: str, resource: str = GPU_RESOURCE
) -> tuple[LocalPod, AnnotationError | None]:
    """The LocalPod of a Pod object, read by the project's one Pod reader (gputopo.model.pod.read_pod, the
    extender's too), plus the placement annotation's error if it could not be read. A pod that reader
    refuses, or one without a UID (the view is keyed by it), raises MalformedPodError naming the field."""
    try:
        info = read_pod(obj, resource=resource)
    except PodSpecError as e:
        raise MalformedPodError(str(e)) from None
    if not info.uid:
        raise MalformedPodError("Pod.metadata.uid is missing")
    placement, error = None, None
    text = info.annotations.get(PLACEMENT_ANNOTATION)
    if text is not None:
        try:
            parsed = parse_placement(text)
            placement = parsed if parsed.node == node else None
        except AnnotationError as e:
            error = e
    pod = LocalPod(
        uid=info.uid,
        namespace=info.namespace,
        name=info.name,
        phase=info.phase,
        gpus_requested=info.request.total,
        container_gpus=tuple((c, n) for c, n in info.request.containers if n > 0),
        placement=placement,
        created=info.created,
    )
    return pod, error


class _Store:
    """uid → LocalPod under one lock; malformed objects and bad placements are logged once each."""

    def __init__(self, node: str, resource: str) -> None:
        self.node = node
        self.resource = resource
        self._lock = threading.Lock()
        self._pods: dict[str, LocalPod] = {}
        self._logged: set[tuple[str, str]] = set()

    def _parse(self, obj: Mapping[str, Any]) -> LocalPod | None:
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        ident = str(meta.get("uid") or meta.get("name") or "?") if isinstance(meta, Mapping) else "?"
        try:
            pod, error = parse_local_pod(obj, self.node, self.resource)
        except MalformedPodError as e:
            self._log_once(ident, str(e), "skipping a malformed pod object")
            return None
        if error is not None:
            self._log_once(ident, error.value, "ignoring an unreadable placement annotation", str(error))
        return pod

    def _log_once(self, ident: str, key: str, message: str, error: str | None = None) -> None:
        # What is kept to log once is bounded: a key cut short (a placement's text may be 256 KiB, rewritten
        # at will where the chart's policy is off), and forgotten whole past MAX_LOGGED pods' worth (such a
        # flood is then logged again, never kept).
        seen = (ident[:MAX_LOGGED_KEY], key[:MAX_LOGGED_KEY])
        if seen in self._logged:
            return
        if len(self._logged) >= MAX_LOGGED:
            self._logged.clear()
        self._logged.add(seen)
        log.warning(message, extra={"pod": ident, "error": error or key})

    def replace(self, objs: Iterable[Mapping[str, Any]]) -> None:
        parsed = [p for p in (self._parse(o) for o in objs) if p is not None]
        with self._lock:
            self._pods = {p.uid: p for p in parsed if p.phase not in TERMINAL_PHASES}

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        pod = self._parse(obj)
        if pod is None:
            return
        with self._lock:
            if event_type == "DELETED" or pod.phase in TERMINAL_PHASES:
                self._pods.pop(pod.uid, None)
            else:
                self._pods[pod.uid] = pod

    def pods(self) -> list[LocalPod]:
        with self._lock:
            return list(self._pods.values())

    def get(self, namespace: str, name: str) -> LocalPod | None:
        with self._lock:
            return next((p for p in self._pods.values() if p.namespace == namespace and p.name == name), None)


class StaticLocalPods:
    """A fixed set of Pod objects (or LocalPods); `set_objects` replaces them (tests change it mid-run)."""

    def __init__(
        self, node: str, objects: Iterable[Mapping[str, Any] | LocalPod] = (), resource: str = GPU_RESOURCE
    ) -> None:
        self._store = _Store(node, resource)
        self.refreshes = 0
        self.set_objects(objects)

    def set_objects(self, objects: Iterable[Mapping[str, Any] | LocalPod]) -> None:
        items = list(objects)
        self._store.replace(o for o in items if not isinstance(o, LocalPod))
        for p in items:
            if isinstance(p, LocalPod) and p.phase not in TERMINAL_PHASES:
                self._store._pods[p.uid] = p

    def pods(self) -> Sequence[LocalPod]:
        return self._store.pods()

    def get(self, namespace: str, name: str) -> LocalPod | None:
        return self._store.get(namespace, name)

    def refresh(self) -> None:
        self.refreshes += 1

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# The API server side


class PodSource(Protocol):
    """Pods of one node from the API server: list, then watch from the list's resourceVersion."""

    def list_pods(self, node: str) -> tuple[list[JSON], str]: ...

    def watch_pods(self, node: str, resource_version: str, timeout_seconds: int) -> Iterator[tuple[str, JSON]]:
        """(event type, object) until the watch ends; raises `gputopo.kube.Gone` on 410."""
        ...

    def close(self) -> None: ...


class KubePodSource:
    """PodSource on the agent's one Kubernetes client (`gputopo.kube.Kube`, shared with the rest of
    the agent), as raw JSON."""

    def __init__(self, kube: Kube, request_timeout: float = 10.0) -> None:
        self._api = kube
        self._timeout = request_timeout

    def list_pods(self, node: str) -> tuple[list[JSON], str]:
        return self._api.list_items(pods_path(), field_selector=on_node(node), timeout=self._timeout)

    def watch_pods(self, node: str, resource_version: str, timeout_seconds: int) -> Iterator[tuple[str, JSON]]:
        events = self._api.watch(
            pods_path(), resource_version, timeout_seconds=timeout_seconds, field_selector=on_node(node)
        )
        for ev in events:
            yield ev.type, ev.object

    def close(self) -> None:
        # Ends a watch blocked in a read, so the thread that runs it can stop now; the client (and its
        # pool) belongs to the agent, which closes it last.
        self._api.abort_watches()


def _rv(obj: Mapping[str, Any]) -> int | None:
    meta = obj.get("metadata")
    text = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return int(text) if isinstance(text, str) and text.isascii() and text.isdigit() else None


class KubeLocalPods:
    """LocalPods kept current by a list+watch thread; `close()` stops the thread. `pacing` says how
    long it waits after a failed round (`gputopo.kube.Pacing`: client-go's reflector's figures unless a
    test passes others)."""

    def __init__(
        self,
        node: str,
        source: PodSource,
        *,
        resource: str = GPU_RESOURCE,
        watch_timeout_s: int = 300,
        pacing: Pacing | None = None,
        start: bool = True,
    ) -> None:
        self.node = node
        self._source = source
        self._store = _Store(node, resource)
        self._watch_timeout = watch_timeout_s
        self._pacing = pacing or Pacing()
        self._rv = ""
        self._list_rv: int | None = None  # events older than the latest LIST are stale (see refresh)
        self._list_lock = threading.Lock()
        self.synced = threading.Event()
        self.relists = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gputopo-pods-{node}", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def pods(self) -> Sequence[LocalPod]:
        return self._store.pods()

    def get(self, namespace: str, name: str) -> LocalPod | None:
        return self._store.get(namespace, name)

    def refresh(self) -> None:
        """One LIST, applied now; failures are logged and the view stays as it was."""
        try:
            self._relist()
        except Exception as e:
            log.warning("pod list failed; keeping the watched view", extra={"node": self.node, "error": str(e)})

    def _relist(self) -> None:
        items, rv = self._source.list_pods(self.node)
        with self._list_lock:
            self._store.replace(items)
            self._rv = rv
            self._list_rv = int(rv) if rv.isascii() and rv.isdigit() else None
            self.relists += 1
        self.synced.set()

    def _watch_once(self) -> None:
        """Consume one watch until it ends; raises `Gone` on 410 (the loop relists after its wait)."""
        for etype, obj in self._source.watch_pods(self.node, self._rv, self._watch_timeout):
            if self._stop.is_set():
                return
            with self._list_lock:
                rv = _rv(obj)
                # A refresh() from another thread may have listed past this event already.
                stale = rv is not None and self._list_rv is not None and rv <= self._list_rv
                if etype in ("ADDED", "MODIFIED", "DELETED") and not stale:
                    self._store.apply(etype, obj)
                if rv is not None and not stale:
                    self._rv = str(rv)

    def _run(self) -> None:
        run_list_watch(
            stop=self._stop,
            needs_list=lambda: not self.synced.is_set() or not self._rv,
            relist=self._relist,
            watch_once=self._watch_once,
            context={"node": self.node},
            pacing=self._pacing,
        )

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        # Aborts a watch in progress. A watch whose request is sent but whose stream is not yet
        # registered misses one abort, so abort again until the thread has ended (bounded).
        deadline = time.monotonic() + timeout_s
        self._source.close()
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.05)
            self._source.close()
