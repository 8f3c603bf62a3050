"""Scheduler throughput on the real local control plane: pods bound per second, with the extender and without.

Starts etcd, kube-apiserver and kube-scheduler from the locally built binaries
(`gputopo.localcluster`), creates N simulated GPU nodes (Node objects with the agent's annotations
and labels, plus one agent Lease per node; no agent processes), then measures two runs, one after
the other, on the same nodes and with the same kube-scheduler binary and client QPS/burst:

  A  `plain-scheduler`: a profile with no extender; 8-GPU pods without gputopo annotations.
     The extender is not running during this run.
  B  `gputopo-scheduler`: the same scheduler calling the real `gputopo-extender` for filter,
     prioritize and bind; 8-GPU pods with `gputopo.io/nvlink: required`.

Each run creates its pods as fast as it can (in parallel) and watches them bind. Throughput is
pods bound / (first create to last bind seen). Run A's pods are deleted (and gone) before run B,
so each run starts on free nodes. The extender's own latency per verb comes from its /metrics,
the schedulers' from theirs. The target (ratio B/A >= 0.5 for 8-GPU gputopo pods) is printed,
not asserted. Everything listens on 127.0.0.1 and is bounded by a global deadline; teardown stops
only the processes this script started.

    .venv/bin/python bench/scheduler_throughput.py                     # 1,000 nodes, 500 pods
    .venv/bin/python bench/scheduler_throughput.py --nodes 200 --pods 100
    .venv/bin/python bench/scheduler_throughput.py --diagnose     # + run C: the scheduler binds itself

Also printed: CPU seconds per process during each run (on a small machine every component competes
for the same cores), and kube-scheduler's own attempt/algorithm/bind latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gputopo.kube import WatchEvent
from gputopo.localcluster import (
    GPUTOPO_PROFILE,
    PLAIN_PROFILE,
    ControlPlane,
    ControlPlaneError,
    ExtenderConfig,
    KubeApiError,
    KubeClient,
    SimNode,
    find_binaries,
    network_labels,
    pod_manifest,
)
from gputopo.localcluster.stack import Stack
from gputopo.model import GPUS_IN_USE_ANNOTATION, TOPOLOGY_ANNOTATION, node_labels
from gputopo.systems import build_system

TARGET_RATIO = 0.5
# A realistic 8-GPU training fleet: mostly Hopper NVSwitch systems, some A100s.
MIX: tuple[tuple[str, int], ...] = (("dgx-h100", 5), ("hgx-h200", 4), ("dgx-a100", 1))
NODES_PER_LEAF = 32
LEAVES_PER_SPINE = 8
GPUS_PER_POD = 8
LEASE_DURATION_S = 3600


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


# ----------------------------------------------------------------------------------- cluster setup


def fixture_for(i: int) -> str:
    total = sum(w for _, w in MIX)
    slot = i % total
    for name, weight in MIX:
        if slot < weight:
            return name
        slot -= weight
    return MIX[0][0]


def sim_nodes(count: int) -> list[SimNode]:
    """Nodes as the agent would leave them: topology, empty gpus-in-use, gputopo.io/* labels, network tiers."""
    out = []
    for i in range(count):
        name = f"gpu-{i:05d}"
        topo = build_system(fixture_for(i), name)
        leaf = i // NODES_PER_LEAF
        labels = {
            **network_labels(leaf=f"leaf-{leaf}", spine=f"spine-{leaf // LEAVES_PER_SPINE}"),
            **node_labels(topo),
        }
        annotations = {TOPOLOGY_ANNOTATION: topo.to_annotation(), GPUS_IN_USE_ANNOTATION: "[]"}
        out.append(SimNode(name=name, gpus=len(topo.gpus), labels=labels, annotations=annotations))
    return out


def create_leases(kube: KubeClient, namespace: str, nodes: Sequence[str], workers: int) -> None:
    """One agent heartbeat Lease per node, renewed now; the extender's staleAfterSeconds outlasts the run."""
    now = datetime.now(UTC)

    def one(node: str) -> None:
        kube.create_lease(namespace, f"gputopo-agent-{node}", holder=node, renew_time=now, duration_s=LEASE_DURATION_S)

    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(one, nodes))


# ----------------------------------------------------------------------------------- measuring


def _insecure() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_get(url: str, *, timeout: float = 10.0) -> tuple[int, str]:
    ctx = _insecure() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""
    except OSError:
        return 0, ""


def wait_scheduler_ready(cp: ControlPlane, name: str, deadline: Deadline) -> None:
    """Until the scheduler's /readyz answers 200 (informers synced), or /healthz if it has no /readyz."""
    port = cp.scheduler_port(name)
    while not deadline.expired():
        status, _ = http_get(f"https://127.0.0.1:{port}/readyz", timeout=2)
        if status == 200:
            return
        if status == 404 and http_get(f"https://127.0.0.1:{port}/healthz", timeout=2)[0] == 200:
            time.sleep(1.0)
            return
        time.sleep(0.2)
    raise TimeoutError(f"{name} not ready before the deadline")


@dataclass
class HistSum:
    count: float = 0.0
    total: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    def minus(self, before: HistSum) -> HistSum:
        return HistSum(
            self.count - before.count,
            self.total - before.total,
            {le: v - before.buckets.get(le, 0.0) for le, v in self.buckets.items()},
        )

    @property
    def mean_ms(self) -> float:
        return 1000.0 * self.total / self.count if self.count else float("nan")

    def quantile_ms(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (what a histogram can tell)."""
        if not self.count:
            return float("nan")
        want = q * self.count
        for le in sorted(self.buckets):
            if self.buckets[le] >= want:
                return 1000.0 * le
        return float("inf")


def histograms(text: str, name: str, label: str, match: dict[str, str] | None = None) -> dict[str, HistSum]:
    """Histogram `name` from a Prometheus text page, summed per value of `label`."""
    out: dict[str, HistSum] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if match and any(s.labels.get(k) != v for k, v in match.items()):
                continue
            h = out.setdefault(s.labels.get(label, ""), HistSum())
            if s.name == name + "_count":
                h.count += s.value
            elif s.name == name + "_sum":
                h.total += s.value
            elif s.name == name + "_bucket":
                le = float(s.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + s.value
    return out


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


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (Linux /proc); 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_snapshot(cp: ControlPlane) -> dict[str, float]:
    out = {name: cpu_seconds(cp.pid(name)) for name in cp.components()}
    t = os.times()
    out["this benchmark"] = t.user + t.system
    return out


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
) -> RunResult:
    res = RunResult(label=label, scheduler=scheduler, pods=pods)
    kube.create_namespace(namespace)
    rv = str(kube.request("GET", f"/api/v1/namespaces/{namespace}/pods").get("metadata", {}).get("resourceVersion"))
    watcher = BindWatcher(kube, namespace, rv, pods, deadline)
    watcher.start()
    manifests = [
        pod_manifest(
            f"bench-{i:05d}",
            namespace=namespace,
            scheduler_name=scheduler,
            gpus=GPUS_PER_POD,
            annotations=annotations,
            labels={"app": "scheduler-throughput"},
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
    cpu_before = cpu_snapshot(cp)
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
    cpu_after = cpu_snapshot(cp)
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


# ----------------------------------------------------------------------------------- report


def fmt(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def print_report(
    args: argparse.Namespace,
    runs: list[RunResult],
    ext: dict[str, HistSum],
    sched: dict[str, dict[str, HistSum]],
) -> None:
    print()
    print(
        f"Scheduler throughput: {args.nodes} simulated nodes ({', '.join(f'{n} x{w}' for n, w in MIX)} per "
        f"{sum(w for _, w in MIX)}), {args.pods} pods x {GPUS_PER_POD} GPUs per run, kube-scheduler "
        f"clientConnection qps={args.qps:g} burst={args.burst}, percentageOfNodesToScore=100, "
        f"{os.cpu_count()} CPUs on this machine"
    )
    head = (
        f"{'run':<34} {'pods':>5} {'bound':>5} {'nodes':>5} {'create s':>8} {'wall s':>7} "
        f"{'pods/s':>7} {'lat p50 ms':>10} {'lat p99 ms':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in runs:
        print(
            f"{r.label:<34} {r.pods:>5} {r.bound:>5} {r.nodes_used:>5} {fmt(r.create_s, 2):>8} "
            f"{fmt(r.wall_s, 2):>7} {fmt(r.throughput):>7} {fmt(r.pct_ms(50), 0):>10} {fmt(r.pct_ms(99), 0):>10}"
        )
        if r.note:
            print(f"  note: {r.note}")
    print("  wall s: first create to last bind seen; lat: one pod's create to its bind seen (watch).")
    if len(runs) >= 2 and runs[0].throughput > 0:
        ratio = runs[1].throughput / runs[0].throughput
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        print(
            f"\nratio gputopo/plain = {runs[1].throughput:.1f} / {runs[0].throughput:.1f} = {ratio:.2f}   "
            f"(target >= {TARGET_RATIO}: {verdict})"
        )
        if len(runs) >= 3:
            print(
                f"diagnostic: run C (extender filter+prioritize, scheduler binds) / A = "
                f"{runs[2].throughput / runs[0].throughput:.2f}"
            )
    names = sorted({k for r in runs for k in r.cpu_s}, key=lambda k: -max(r.cpu_s.get(k, 0.0) for r in runs))
    if names:
        print(f"\nCPU seconds used during each run (first create to last bind; {os.cpu_count()} CPUs):")
        print(f"  {'process':<22}" + "".join(f" {r.label.split()[0] + ' ' + r.label.split()[1]:>26}" for r in runs))
        for k in names:
            print(f"  {k:<22}" + "".join(f" {fmt(r.cpu_s.get(k, float('nan')), 2):>26}" for r in runs))
        print(f"  {'total':<22}" + "".join(f" {fmt(sum(r.cpu_s.values()), 2):>26}" for r in runs))
    if sched:
        print("\nkube-scheduler, during each run (from its /metrics):")
        print(f"  {'scheduler':<20} {'metric':<44} {'count':>6} {'mean ms':>8} {'~p99 ms':>8}")
        for name, hs in sched.items():
            for metric, h in hs.items():
                print(
                    f"  {name:<20} {metric:<44} {h.count:>6.0f} {fmt(h.mean_ms, 2):>8} {fmt(h.quantile_ms(0.99), 0):>8}"
                )
    if ext:
        print("\ngputopo-extender server-side latency during run B (gputopo_extender_request_duration_seconds):")
        print(f"  {'verb':<12} {'count':>6} {'sum s':>8} {'mean ms':>8} {'~p99 ms':>8}")
        for verb in ("filter", "prioritize", "bind", "preempt"):
            v = ext.get(verb)
            if v is None or not v.count:
                continue
            print(
                f"  {verb:<12} {v.count:>6.0f} {v.total:>8.3f} {fmt(v.mean_ms, 2):>8} {fmt(v.quantile_ms(0.99), 0):>8}"
            )


# ----------------------------------------------------------------------------------- main


SCHED_METRICS = {
    "attempt (scheduled)": ("scheduler_scheduling_attempt_duration_seconds", {"result": "scheduled"}),
    "algorithm (filter+score)": ("scheduler_scheduling_algorithm_duration_seconds", {}),
    "extension point Bind": ("scheduler_framework_extension_point_duration_seconds", {"extension_point": "Bind"}),
}


def scheduler_metrics(cp: ControlPlane, name: str) -> dict[str, HistSum]:
    status, text = http_get(f"https://127.0.0.1:{cp.scheduler_port(name)}/metrics")
    if status != 200:
        return {}
    out: dict[str, HistSum] = {}
    for title, (metric, match) in SCHED_METRICS.items():
        h = HistSum()
        for part in histograms(text, metric, "__none__", match).values():
            h.count += part.count
            h.total += part.total
            for le, v in part.buckets.items():
                h.buckets[le] = h.buckets.get(le, 0.0) + v
        out[title] = h
    return out


def extender_metrics(url: str) -> dict[str, HistSum]:
    status, text = http_get(f"{url}/metrics")
    if status != 200:
        return {}
    return histograms(text, "gputopo_extender_request_duration_seconds", "verb")


def diff(after: dict[str, HistSum], before: dict[str, HistSum]) -> dict[str, HistSum]:
    return {k: v.minus(before[k]) if k in before else v for k, v in after.items()}


def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.deadline)
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh first", file=sys.stderr)
        return 2
    runs: list[RunResult] = []
    ext_lat: dict[str, HistSum] = {}
    sched_lat: dict[str, dict[str, HistSum]] = {}
    progress: Callable[[str], None] | None = say if args.verbose else None
    with ControlPlane(bin_dir, keep=args.keep, verbosity=args.scheduler_v, progress=progress) as cp:
        say(f"control plane up in {cp.dir}")
        kube = KubeClient(cp.kubeconfig, kubectl=cp.kubectl, pool_size=max(32, args.workers))
        stack = Stack(cp, kube, stale_after_seconds=args.stale_after_seconds, progress=progress)
        stack.install()
        t = time.monotonic()
        nodes = sim_nodes(args.nodes)
        kube.create_nodes(nodes, workers=args.workers)
        create_leases(kube, stack.namespace, [n.name for n in nodes], args.workers)
        say(f"{args.nodes} nodes and Leases created in {time.monotonic() - t:.1f}s")
        sched_kw: dict[str, Any] = {"client_qps": args.qps, "client_burst": args.burst}

        # Run A: plain profile, no extender process at all.
        plain = cp.start_plain_scheduler(**sched_kw)
        wait_scheduler_ready(cp, plain, deadline)
        before = scheduler_metrics(cp, plain)
        a = measure_run(
            kube,
            cp,
            label="A plain-scheduler (no extender)",
            scheduler=PLAIN_PROFILE,
            namespace="bench-plain",
            pods=args.pods,
            annotations={},
            workers=args.workers,
            deadline=deadline,
        )
        runs.append(a)
        sched_lat[PLAIN_PROFILE] = diff(scheduler_metrics(cp, plain), before)
        cp.remove(plain)
        say("deleting run A's pods")
        delete_pods(kube, "bench-plain", args.workers, deadline)

        # Run B: the same scheduler binary, the gputopo profile calling the real extender.
        if not deadline.expired():
            stack.start_extender(extra_args=[f"--log-level={args.extender_log_level}"])
            status, body = http_get(f"{stack.extender_url}/readyz")
            cached = json.loads(body).get("nodes") if status == 200 else None
            say(f"extender ready at {stack.extender_url}: {cached} nodes in its cache")
            sched = stack.start_scheduler(**sched_kw)
            wait_scheduler_ready(cp, sched, deadline)
            before = scheduler_metrics(cp, sched)
            ext_before = extender_metrics(stack.extender_url)
            b = measure_run(
                kube,
                cp,
                label="B gputopo-scheduler (extender)",
                scheduler=GPUTOPO_PROFILE,
                namespace="bench-gputopo",
                pods=args.pods,
                annotations={"gputopo.io/nvlink": "required"},
                workers=args.workers,
                deadline=deadline,
            )
            runs.append(b)
            sched_lat[GPUTOPO_PROFILE] = diff(scheduler_metrics(cp, sched), before)
            ext_lat = diff(extender_metrics(stack.extender_url), ext_before)
            if args.diagnose and not deadline.expired():
                # Run C: the same pods and profile, but kube-scheduler binds itself: the extender
                # answers filter and prioritize only. Separates the bind path's cost from the rest.
                cp.remove(sched)
                say("deleting run B's pods")
                delete_pods(kube, "bench-gputopo", args.workers, deadline)
                name = "gputopo-scheduler-nobind"
                ext = ExtenderConfig(url=stack.extender_url, bind_verb=None)
                cp.start_scheduler(name, profile=GPUTOPO_PROFILE, extender=ext, **sched_kw)
                wait_scheduler_ready(cp, name, deadline)
                before = scheduler_metrics(cp, name)
                runs.append(
                    measure_run(
                        kube,
                        cp,
                        label="C gputopo, scheduler binds",
                        scheduler=GPUTOPO_PROFILE,
                        namespace="bench-gputopo-nobind",
                        pods=args.pods,
                        annotations={"gputopo.io/nvlink": "required"},
                        workers=args.workers,
                        deadline=deadline,
                    )
                )
                sched_lat[name] = diff(scheduler_metrics(cp, name), before)
        if args.keep:
            say(f"keeping {cp.dir} (logs: scheduler-*.log, gputopo-extender.log)")
        kube.close()
    print_report(args, runs, ext_lat, sched_lat)
    if deadline.expired():
        print(f"\nthe global deadline ({args.deadline:.0f}s) ran out: the figures above are partial")
    return 0 if len(runs) >= 2 and all(r.bound == r.pods for r in runs) else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Pods per second bound by the real kube-scheduler, with the gputopo extender and without."
    )
    p.add_argument("--nodes", type=int, default=1000, help="simulated 8-GPU nodes (default 1000)")
    p.add_argument("--pods", type=int, default=500, help="8-GPU pods per run (default 500; at most --nodes)")
    p.add_argument("--qps", type=float, default=200.0, help="both schedulers' client QPS (default 200)")
    p.add_argument("--burst", type=int, default=400, help="both schedulers' client burst (default 400)")
    p.add_argument("--workers", type=int, default=32, help="parallel API clients for creates/deletes (32)")
    p.add_argument("--deadline", type=float, default=600.0, help="global time budget in seconds (600)")
    p.add_argument("--stale-after-seconds", type=float, default=3600.0, help="extender's Lease staleness (3600)")
    p.add_argument("--extender-log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--scheduler-v", type=int, default=2, help="kube-scheduler --v (default 2)")
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="add run C: the gputopo profile with kube-scheduler binding itself (extender filter+prioritize only)",
    )
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs) after teardown")
    p.add_argument("--verbose", action="store_true", help="show control-plane progress")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.pods < 1:
        p.error("--nodes and --pods must be positive")
    if args.pods > args.nodes:
        p.error("--pods must not exceed --nodes: every pod takes a whole 8-GPU node")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"scheduler_throughput: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
