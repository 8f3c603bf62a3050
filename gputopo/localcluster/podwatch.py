"""One namespace's pods as a watch keeps them, and what kube-scheduler has made of each so far."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping

from gputopo.kube import Backoff, Pacing, pods_path, run_list_watch
from gputopo.localcluster.kube import JSON, KubeClient

# A group member refused only because its group is incomplete is still pending, not refused.
WAITING = re.compile(r"pods exist, waiting")
# A test harness on loopback: retry soon after a failure (the reflector's 0.8-30 s would only slow a run
# down), still growing so a dead API server is not hammered.
PACING = Pacing(backoff=Backoff(base_s=0.2, factor=2.0, cap_s=2.0, jitter=0.5))


class PodTracker(threading.Thread):
    """The latest copy of every pod in one namespace, from a watch; `wait` blocks on changes."""

    def __init__(self, kube: KubeClient, namespace: str, pacing: Pacing = PACING) -> None:
        super().__init__(name=f"pods-{namespace}", daemon=True)
        self.kube = kube
        self.namespace = namespace
        self.pacing = pacing
        self.pods: dict[str, JSON] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self._rv = ""
        self._relist()  # the callers read the pods at once, before the thread runs

    def _relist(self) -> None:
        doc = self.kube.request("GET", pods_path(self.namespace))
        with self.cond:
            self.pods = {p["metadata"]["name"]: p for p in doc.get("items", [])}
            self.cond.notify_all()
        self._rv = str(doc.get("metadata", {}).get("resourceVersion", ""))

    def _watch_once(self) -> bool:
        for ev in self.kube.watch(pods_path(self.namespace), self._rv, timeout_seconds=60):
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
                break
        return True

    def run(self) -> None:
        """The project's one list+watch loop (`gputopo.kube.run_list_watch`): a 410 relists, a failed
        round waits its backoff; the waits of `wait` time out and say so meanwhile."""
        run_list_watch(
            stop=self.stopping,
            needs_list=lambda: not self._rv,
            relist=self._relist,
            watch_once=self._watch_once,
            context={"namespace": self.namespace},
            pacing=self.pacing,
        )

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
