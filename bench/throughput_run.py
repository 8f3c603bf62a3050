"""One measured run of `scheduler_throughput.py`: create 8-GPU pods in parallel, watch them bind.

A run records each pod's create-to-bind latency (the bind as first seen by a watch, on this
process's monotonic clock), the wall time from the first create to the last bind, the nodes used
(two pods on one node would be a double booking) and the CPU seconds each process spent meanwhile.
The list at the end is the truth about what bound. Imported by the script from its own folder.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gputopo.kube import WatchEvent
from gputopo.localcluster import ControlPlane, KubeApiError, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.procstats import cpu_snapshot

GPUS_PER_POD = 8


class Deadline:
    """The global time budget: every wait takes what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return self.left() <= 0.0


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class BindWatcher(threading.Thread):
    """Watches bound pods of one namespace (`fieldSelector=spec.nodeName!=`) and records when each was
    first seen bound, on this process's monotonic clock (the local cluster client's watch)."""

    def __init__(self, kube: KubeClient, namespace: str, resource_version: str, want: int, deadline: Deadline) -> None:
        super().__init__(name=f"watch-{namespace}", daemon=True)
        self.kube = kube
        self.namespace = namespace
        self.rv = resource_version
        self.want = want
        self.deadline = deadline
        self.bound: dict[str, tuple[float, str]] = {}  # pod -> (monotonic time, node)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.stop = threading.Event()
        self.error = ""

    def run(self) -> None:
        try:
            while not self.stop.is_set() and not self.deadline.expired() and len(self.bound) < self.want:
                self._watch_once(max(1, min(60, int(self.deadline.left()))))
        except Exception as e:  # reported; the caller falls back to listing
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def _watch_once(self, timeout_s: int) -> None:
        events = self.kube.watch(
            f"/api/v1/namespaces/{self.namespace}/pods",
            self.rv,
            timeout_seconds=timeout_s,
            field_selector="spec.nodeName!=",
        )
        for ev in events:
            self._event(ev, time.monotonic())
            if self.stop.is_set() or len(self.bound) >= self.want:
                return

    def _event(self, ev: WatchEvent, now: float) -> None:
        meta = ev.object.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.rv = str(meta["resourceVersion"])
        node = (ev.object.get("spec") or {}).get("nodeName")
        if ev.type in ("ADDED", "MODIFIED") and node:
            with self.lock:
                self.bound.setdefault(str(meta.get("name")), (now, str(node)))


@dataclass
class RunResult:
    label: str
    scheduler: str
    pods: int
    created: int = 0
    bound: int = 0
    create_s: float = float("nan")
    wall_s: float = float("nan")
    latencies_s: list[float] = field(default_factory=list)
    nodes_used: int = 0
    gpus_bound: int = 0
    note: str = ""
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process during the run
    settle_s: float = 0.0  # from the last bind until the work it left behind (events) was done

    @property
    def throughput(self) -> float:
        return self.bound / self.wall_s if self.wall_s and self.wall_s == self.wall_s and self.wall_s > 0 else 0.0

    def pct_ms(self, q: int) -> float:
        if not self.latencies_s:
            return float("nan")
        if len(self.latencies_s) == 1:
            return 1000.0 * self.latencies_s[0]
        return 1000.0 * statistics.quantiles(self.latencies_s, n=100, method="inclusive")[q - 1]


def measure_run(
    kube: KubeClient,
    cp: ControlPlane,
    *,
    label: str,
    scheduler: str,
    namespace: str,
    pods: int,
    annotations: dict[str, str],
    workers: int,
    deadline: Deadline,
    progress_every: float = 5.0,
    settled: Callable[[int], bool] | None = None,
) -> RunResult:
    """One run. `settled(bound)` says whether the work each bind leaves behind (the Events posted off the
    bind path) is done: the CPU figures wait for it (30 s at most), so no run looks cheaper for work
    it deferred past its last bind; pods/s still counts to the last bind."""
    res = RunResult(label=label, scheduler=scheduler, pods=pods)
    kube.create_namespace(namespace)
    rv = str(kube.request("GET", f"/api/v1/namespaces/{namespace}/pods").get("metadata", {}).get("resourceVersion"))
    watcher = BindWatcher(kube, namespace, rv, pods, deadline)
    watcher.start()
    manifests = [
        pod_manifest(
            f"bench-{i:05d}",
            namespace=namespace,
            gpus=GPUS_PER_POD,
            annotations=annotations,
            labels={"app": "scheduler-throughput"},
            scheduling=PodScheduling(scheduler_name=scheduler),
        )
        for i in range(pods)
    ]
    sent: dict[str, float] = {}
    errors: list[str] = []

    def create(m: dict[str, Any]) -> None:
        name = m["metadata"]["name"]
        if deadline.expired():
            return
        sent[name] = time.monotonic()
        try:
            kube.create_pod(m)
        except KubeApiError as e:
            sent.pop(name, None)
            errors.append(str(e))

    say(f"run {label}: creating {pods} pods ({scheduler}) with {workers} parallel clients")
    cpu_before = cpu_snapshot(cp, "this benchmark")
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(create, manifests))
    res.create_s = time.monotonic() - t0
    res.created = len(sent)
    if errors:
        res.note = f"{len(errors)} creates failed, first: {errors[0]}"
    say(f"run {label}: created {res.created} pods in {res.create_s:.2f}s ({res.created / res.create_s:.0f}/s)")

    next_report = time.monotonic() + progress_every
    while not watcher.done.wait(0.5):
        if deadline.expired():
            break
        if time.monotonic() >= next_report:
            with watcher.lock:
                n = len(watcher.bound)
            say(f"run {label}: {n}/{res.created} bound after {time.monotonic() - t0:.1f}s")
            next_report += progress_every
        if res.created < pods and len(watcher.bound) >= res.created:
            break
    watcher.stop.set()
    if settled is not None:
        with watcher.lock:
            n = len(watcher.bound)
        start, end = time.monotonic(), time.monotonic() + 30
        while not settled(n) and time.monotonic() < end and not deadline.expired():
            time.sleep(0.5)  # each check scrapes kube-apiserver's /metrics: few, so they cost both runs little
        res.settle_s = time.monotonic() - start
    cpu_after = cpu_snapshot(cp, "this benchmark")
    res.cpu_s = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
    if watcher.error:
        say(f"run {label}: watch failed ({watcher.error}); falling back to a list")
    with watcher.lock:
        seen = dict(watcher.bound)
    # The list is the truth about what bound; a pod the watch missed counts as bound now (upper bound).
    listed = {
        p["metadata"]["name"]: str(p["spec"]["nodeName"])
        for p in kube.list_pods(namespace, label_selector="app=scheduler-throughput")
        if (p.get("spec") or {}).get("nodeName")
    }
    now = time.monotonic()
    for name, node in listed.items():
        seen.setdefault(name, (now, node))
    seen = {k: v for k, v in seen.items() if k in listed}
    res.bound = len(seen)
    if seen:
        res.wall_s = max(t for t, _ in seen.values()) - t0
        res.latencies_s = [t - sent[name] for name, (t, _) in seen.items() if name in sent]
        res.nodes_used = len({n for _, n in seen.values()})
        res.gpus_bound = GPUS_PER_POD * res.bound
    if res.bound < res.created:
        extra = f"{res.created - res.bound} pods not bound before the deadline"
        res.note = f"{res.note}; {extra}" if res.note else extra
    if res.nodes_used != res.bound:
        extra = f"{res.bound - res.nodes_used} 8-GPU pods share a node (double booking?)"
        res.note = f"{res.note}; {extra}" if res.note else extra
    say(f"run {label}: {res.bound}/{res.created} bound, {res.throughput:.1f} pods/s")
    return res


def delete_pods(kube: KubeClient, namespace: str, workers: int, deadline: Deadline) -> None:
    names = [p["metadata"]["name"] for p in kube.list_pods(namespace)]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(lambda n: kube.delete_pod(namespace, n), names))
    while not deadline.expired():
        if not kube.list_pods(namespace):
            return
        time.sleep(0.5)
    raise TimeoutError(f"pods in {namespace} not gone before the deadline")
