"""An in-memory ClusterSource for unit tests and demos: objects, resourceVersions, watches, 410 Gone.

It behaves like the API server where the extender depends on it: list returns a resourceVersion,
watch replays changes after it (or raises Gone once `compact()` dropped them), a Binding sets
`spec.nodeName` and copies its annotations onto the pod (409 when already bound), and events
are recorded (409 for a second event of the same name). `down = True` makes every call fail like an
unreachable API server.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from gputopo.extender.watch.source import JSON, Kind
from gputopo.kube import KIND_NAMES, Gone, KubeError, WatchEvent
from gputopo.model import DEFAULT_NAMESPACE


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta["name"])


class FakeSource:
    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.namespace = namespace
        self._lock = threading.Condition()
        self._rv = 0
        self._objects: dict[Kind, dict[tuple[str, str], JSON]] = {k: {} for k in KIND_NAMES}
        self._log: dict[Kind, list[tuple[int, WatchEvent]]] = {k: [] for k in KIND_NAMES}
        self._compacted: dict[Kind, int] = dict.fromkeys(KIND_NAMES, 0)
        self.not_served: set[Kind] = set()  # kinds whose list and watch answer 404 (an API not served)
        self.bindings: list[tuple[str, str, str, str]] = []
        self.events: list[JSON] = []
        self.binding_annotations: list[dict[str, str]] = []
        self.calls: list[str] = []
        self.down = False
        self.fail_binding: KubeError | None = None
        self.patches: list[tuple[str, str, list[JSON]]] = []  # (namespace, name, ops) of each pod patch applied
        self.closed = False

    # ------------------------------------------------------------------ test helpers

    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.down:
            raise KubeError(0, "connection refused (fake API server is down)")

    def _store(self, kind: Kind, etype: str, obj: JSON) -> JSON:
        with self._lock:
            self._rv += 1
            obj = copy.deepcopy(obj)
            obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
            if etype == "DELETED":
                self._objects[kind].pop(_key(obj), None)
            else:
                self._objects[kind][_key(obj)] = obj
            self._log[kind].append((self._rv, WatchEvent(etype, copy.deepcopy(obj))))
            self._lock.notify_all()
            return copy.deepcopy(obj)

    def put(self, kind: Kind, obj: JSON) -> JSON:
        """Create or replace an object (ADDED or MODIFIED event)."""
        exists = _key(obj) in self._objects[kind]
        return self._store(kind, "MODIFIED" if exists else "ADDED", obj)

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        obj = self._objects[kind].get((namespace, name))
        if obj is not None:
            self._store(kind, "DELETED", obj)

    def get(self, kind: Kind, namespace: str, name: str) -> JSON | None:
        obj = self._objects[kind].get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def compact(self) -> None:
        """Forget the watch history: watches from older resourceVersions now get 410 Gone."""
        with self._lock:
            for kind in self._log:
                self._log[kind].clear()
                self._compacted[kind] = self._rv

    # ------------------------------------------------------------------ ClusterSource

    def list_objects(self, kind: Kind) -> tuple[list[JSON], str]:
        self._check(f"list {kind}")
        if kind in self.not_served:
            raise KubeError(404, "the server could not find the requested resource", "NotFound")
        with self._lock:
            items = [copy.deepcopy(o) for o in self._objects[kind].values()]
            if kind == "leases":
                items = [o for o in items if o["metadata"].get("namespace") == self.namespace]
            return items, str(self._rv)

    def watch(self, kind: Kind, resource_version: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        self._check(f"watch {kind}")
        since = int(resource_version or 0)
        with self._lock:
            if since < self._compacted[kind]:
                raise Gone(410, f"too old resource version: {since} ({self._compacted[kind]})", "Expired")
        while True:
            with self._lock:
                pending = [ev for rv, ev in self._log[kind] if rv > since]
                if not pending:
                    if timeout_seconds <= 0 or not self._lock.wait(timeout_seconds):
                        return
                    continue
            for ev in pending:
                if kind == "leases" and ev.object["metadata"].get("namespace") != self.namespace:
                    since = int(ev.object["metadata"]["resourceVersion"])
                    continue
                since = int(ev.object["metadata"]["resourceVersion"])
                yield ev
            if timeout_seconds <= 0:
                return

    def get_pod(self, namespace: str, name: str) -> JSON:
        self._check(f"get pod {namespace}/{name}")
        obj = self.get("pods", namespace, name)
        if obj is None:
            raise KubeError(404, f'pods "{name}" not found', "NotFound")
        return obj

    def get_resource_claim(self, namespace: str, name: str) -> JSON:
        self._check(f"get resourceclaim {namespace}/{name}")
        obj = self.get("resourceclaims", namespace, name)
        if obj is None:
            raise KubeError(404, f'resourceclaims.resource.k8s.io "{name}" not found', "NotFound")
        return obj

    def list_pods(self, *, field_selector: str = "") -> list[JSON]:
        self._check(f"list pods {field_selector}")
        out = []
        for obj in self._objects["pods"].values():
            if field_selector:
                key, _, value = field_selector.partition("=")
                assert key == "spec.nodeName", key
                if (obj.get("spec") or {}).get("nodeName") != value:
                    continue
            out.append(copy.deepcopy(obj))
        return out

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
        self._check(f"bind {namespace}/{name} {node}")
        if self.fail_binding is not None:
            raise self.fail_binding
        obj = self.get("pods", namespace, name)
        if obj is None:
            raise KubeError(404, f'pods "{name}" not found', "NotFound")
        if uid and obj["metadata"].get("uid") != uid:
            raise KubeError(409, "Precondition failed: UID in precondition does not match", "Conflict")
        if (obj.get("spec") or {}).get("nodeName"):
            raise KubeError(409, f'pod {name} is already assigned to node "{obj["spec"]["nodeName"]}"', "Conflict")
        obj.setdefault("spec", {})["nodeName"] = node
        if annotations:  # as the API server does: the Binding's annotations land on the pod, same write
            obj["metadata"]["annotations"] = {**(obj["metadata"].get("annotations") or {}), **annotations}
        self.bindings.append((namespace, name, uid, node))
        self.binding_annotations.append(dict(annotations or {}))
        self.put("pods", obj)

    def create_event(self, namespace: str, event: JSON) -> None:
        self._check(f"event {namespace}")
        name = (event.get("metadata") or {}).get("name")
        if name and any((e.get("metadata") or {}).get("name") == name for e in self.events):
            raise KubeError(409, f'events "{name}" already exists', "AlreadyExists")
        self.events.append(copy.deepcopy(event))

    def patch_pod(self, namespace: str, name: str, ops: list[JSON]) -> None:
        """JSON patch, the two operations the extender sends (`test`, `remove`), all or none as the API
        server applies them: a failed test or a path that is not there gets 422."""
        self._check(f"patch {namespace}/{name}")
        obj = self.get("pods", namespace, name)
        if obj is None:
            raise KubeError(404, f'pods "{name}" not found', "NotFound")
        obj = copy.deepcopy(obj)
        for op in ops:
            *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]]
            at: Any = obj
            try:
                for p in parents:
                    at = at[int(p)] if isinstance(at, list) else at[p]
                key: Any = int(last) if isinstance(at, list) else last
                if op.get("op") == "test":
                    if at[key] != op.get("value"):
                        raise KubeError(422, f"the test at {op['path']} failed", "Invalid")
                elif op.get("op") == "remove":
                    del at[key]
                else:
                    raise KubeError(422, f"the fake applies no {op.get('op')!r}", "Invalid")
            except (KeyError, IndexError, ValueError, TypeError):
                raise KubeError(422, f"no {op.get('path')} in the pod", "Invalid") from None
        self.patches.append((namespace, name, copy.deepcopy(ops)))
        self.put("pods", obj)

    def close(self) -> None:
        self.closed = True
