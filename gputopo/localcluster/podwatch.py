"""One namespace's pods as a watch keeps them, and what kube-scheduler has made of each so far."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping

from gputopo.kube.errors import Gone
from gputopo.localcluster.kube import JSON, KubeClient

# A group member refused only because its group is incomplete is still pending, not refused.
WAITING = re.compile(r"pods exist, waiting")


class PodTracker(threading.Thread):
    """The latest copy of every pod in one namespace, from a watch; `wait` blocks on changes."""

    def __init__(self, kube: KubeClient, namespace: str) -> None:
        super().__init__(name=f"pods-{namespace}", daemon=True)
        self.kube = kube
        self.namespace = namespace
        self.pods: dict[str, JSON] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.error = ""
        self._rv = self._list()

    def _list(self) -> str:
        doc = self.kube.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")
        with self.cond:
            self.pods = {p["metadata"]["name"]: p for p in doc.get("items", [])}
            self.cond.notify_all()
        return str(doc.get("metadata", {}).get("resourceVersion", ""))

    def run(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while not self.stopping.is_set():
            try:
                for ev in self.kube.watch(path, self._rv, timeout_seconds=60):
                    meta = ev.object.get("metadata") or {}
                    if meta.get("resourceVersion"):
                        self._rv = str(meta["resourceVersion"])
                    name = meta.get("name")
                    if ev.type == "BOOKMARK" or not name:
                        continue
                    with self.cond:
                        if ev.type == "DELETED":
                            self.pods.pop(str(name), None)
                        else:
                            self.pods[str(name)] = ev.object
                        self.cond.notify_all()
                    if self.stopping.is_set():
                        return
            except Gone:
                self._rv = self._list()
            except Exception as e:  # the waits time out and say so; the watch is tried again
                self.error = f"{type(e).__name__}: {e}"
                if self.stopping.wait(0.5):
                    return

    def stop(self) -> None:
        self.stopping.set()

    def wait(self, done: Callable[[Mapping[str, JSON]], bool], timeout: float) -> bool:
        """Until `done(pods)` holds (True) or `timeout` seconds pass (False)."""
        end = time.monotonic() + timeout
        with self.cond:
            while not done(self.pods):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 1.0))
            return True


def pod_state(pod: JSON | None) -> str:
    """`bound`, `refused` (unschedulable for a reason other than a group still waiting) or `pending`."""
    if pod is None:
        return "pending"
    if (pod.get("spec") or {}).get("nodeName"):
        return "bound"
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return "pending" if WAITING.search(str(c.get("message") or "")) else "refused"
    return "pending"


def scheduling_message(pod: JSON | None) -> str:
    """What the PodScheduled condition says (its message, else its reason); empty without one."""
    for c in ((pod or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled":
            return str(c.get("message") or c.get("reason") or "")
    return ""
