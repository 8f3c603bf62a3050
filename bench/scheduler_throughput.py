"""Scheduler throughput on the real local control plane: pods bound per second, with the extender and without.

Starts etcd, kube-apiserver and kube-scheduler from the locally built binaries
(`localcluster`), creates N simulated GPU nodes (Node objects with the agent's annotations
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

    .venv/bin/python bench/scheduler_throughput.py                     # 1,000 nodes, 500 pods, 3 rounds
    .venv/bin/python bench/scheduler_throughput.py --nodes 200 --pods 100
    .venv/bin/python bench/scheduler_throughput.py --diagnose     # + run C: the scheduler binds itself
    .venv/bin/python bench/scheduler_throughput.py --filter-all   # run B without the one-node filter

Runs A and B alternate for `--rounds` rounds (every process of a run stopped, its pods gone, before the
next); each round's figures and their medians are printed, with the details of the median round.

Also printed: CPU seconds per process during each run (on a small machine every component competes
for the same cores) and per bound pod summed over every process, kube-apiserver's requests per bound
pod by verb and resource (`bench/api_counts.py`), the extender's request and answer bytes per call,
and kube-scheduler's own attempt/algorithm/bind latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

# Beside this script: bench/ is no package, and running a script puts its own folder on sys.path.
from api_counts import (
    SCHEDULER_VIEW,
    apiserver_calls,
    between,
    bytes_lines,
    calls_table,
    cpu_per_pod_lines,
    extender_bytes,
)
from throughput_run import GPUS_PER_POD, Deadline, RunResult, delete_pods, measure_run, say

from gputopo.agent.labels import node_labels
from gputopo.localcluster import (
    GPUTOPO_PROFILE,
    PLAIN_PROFILE,
    ControlPlane,
    ControlPlaneError,
    ExtenderConfig,
    KubeApiError,
    KubeClient,
    Lifetime,
    SchedulerOptions,
    SimNode,
    find_binaries,
    network_labels,
)
from gputopo.localcluster.promstats import HistSum, diff, extender_metrics, http_get, scheduler_metrics
from gputopo.localcluster.stack import Stack, StackTiming
from gputopo.model import GPUS_IN_USE_ANNOTATION, TOPOLOGY_ANNOTATION, agent_lease_name
from gputopo.systems import build_system

TARGET_RATIO = 0.5
# A realistic 8-GPU training fleet: mostly Hopper NVSwitch systems, some A100s.
MIX: tuple[tuple[str, int], ...] = (("dgx-h100", 5), ("hgx-h200", 4), ("dgx-a100", 1))
NODES_PER_LEAF = 32
LEAVES_PER_SPINE = 8
LEASE_DURATION_S = 3600


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
        kube.create_lease(namespace, agent_lease_name(node), holder=node, renew_time=now, duration_s=LEASE_DURATION_S)

    with ThreadPoolExecutor(max_workers=workers) as ex:
        list(ex.map(one, nodes))


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
    print(
        "  CPU below: first create until every bound pod's Events are posted ("
        + ", ".join(f"{r.label.split()[0]} {r.settle_s:.1f} s after the last bind" for r in runs)
        + ")."
    )
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
        print(f"\nCPU seconds used during each run (first create to last Event; {os.cpu_count()} CPUs):")
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


def events_posted(cp: ControlPlane, before: dict[str, float], per_pod: int) -> Callable[[int], bool]:
    """Whether kube-apiserver has taken `per_pod` Events per bound pod since `before` (its own counts)."""
    return lambda bound: between(apiserver_calls(cp), before).get("POST events", 0.0) >= per_pod * bound


def print_per_pod(
    runs: list[RunResult],
    calls: list[dict[str, float]],
    ext: dict[str, HistSum],
    bytes_before: dict[tuple[str, str], float],
    bytes_after: dict[tuple[str, str], float],
) -> None:
    """What each bound pod cost: CPU over every process, API calls, the extender's bytes per call."""
    labels = [" ".join(r.label.split()[:2]) for r in runs]
    print("\nCPU per bound pod, every process together (target: gputopo <= 1.25x plain; extender <= 2 ms):")
    print("\n".join(cpu_per_pod_lines([(lab, r.cpu_s, r.bound) for lab, r in zip(labels, runs, strict=True)])))
    if calls:
        print("\nkube-apiserver requests per bound pod (apiserver_request_total; every client, watches included):")
        print("\n".join(calls_table([(lab, c, r.bound) for lab, c, r in zip(labels, calls, runs, strict=False)])))
    lines = bytes_lines(bytes_before, bytes_after, {v: h.count for v, h in ext.items()})
    if lines:
        print("\ngputopo-extender bytes per call during run B (gputopo_extender_wire_bytes_total):")
        print("\n".join(lines))
    print(SCHEDULER_VIEW)


# ----------------------------------------------------------------------------------- main


@dataclass
class Round:
    """One round: run A, then run B (and C with --diagnose), with what each cost."""

    runs: list[RunResult] = field(default_factory=list)
    calls: list[dict[str, float]] = field(default_factory=list)  # kube-apiserver requests during each run
    bytes_before: dict[tuple[str, str], float] = field(default_factory=dict)
    bytes_after: dict[tuple[str, str], float] = field(default_factory=dict)
    ext_lat: dict[str, HistSum] = field(default_factory=dict)
    sched_lat: dict[str, dict[str, HistSum]] = field(default_factory=dict)

    def ratio(self) -> float:
        ok = len(self.runs) >= 2 and self.runs[0].throughput > 0
        return self.runs[1].throughput / self.runs[0].throughput if ok else float("nan")


def one_round(args: argparse.Namespace, cp: ControlPlane, kube: KubeClient, stack: Stack, deadline: Deadline) -> Round:
    """Run A (plain profile, no extender process at all), then run B (the same scheduler binary, the gputopo
    profile calling the real extender); every process of a run is stopped and its pods are gone before the
    next run starts, so each starts on free nodes and no idle process's CPU counts against the other."""
    rnd = Round()
    options = SchedulerOptions(client_qps=args.qps, client_burst=args.burst)
    plain = cp.start_plain_scheduler(options=options)
    wait_scheduler_ready(cp, plain, deadline)
    before = scheduler_metrics(cp, plain)
    calls_before = apiserver_calls(cp)
    rnd.runs.append(
        measure_run(
            kube,
            cp,
            label="A plain-scheduler (no extender)",
            scheduler=PLAIN_PROFILE,
            namespace="bench-plain",
            pods=args.pods,
            annotations={},
            workers=args.workers,
            deadline=deadline,
            settled=events_posted(cp, calls_before, 1),  # kube-scheduler's Scheduled Event
        )
    )
    rnd.calls.append(between(apiserver_calls(cp), calls_before))
    rnd.sched_lat[PLAIN_PROFILE] = diff(scheduler_metrics(cp, plain), before)
    cp.remove(plain)
    say("deleting run A's pods")
    delete_pods(kube, "bench-plain", args.workers, deadline)
    if deadline.expired():
        return rnd
    # Run B passes one node from filter, as the chart's default does, unless --filter-all.
    every = ["--no-filter-best-only"] if args.filter_all else ["--filter-best-only"]
    stack.start_extender(extra_args=[f"--log-level={args.extender_log_level}", *every])
    status, body = http_get(f"{stack.extender_url}/readyz")
    cached = json.loads(body).get("nodes") if status == 200 else None
    say(f"extender ready at {stack.extender_url}: {cached} nodes in its cache")
    sched = stack.start_scheduler(client_qps=options.client_qps, client_burst=options.client_burst)
    wait_scheduler_ready(cp, sched, deadline)
    before = scheduler_metrics(cp, sched)
    # The extender serves /metrics on its own metrics port, not beside the scheduler verbs.
    ext_metrics = stack.pods[0].metrics_url
    ext_before = extender_metrics(ext_metrics)
    rnd.bytes_before = extender_bytes(ext_metrics)
    calls_before = apiserver_calls(cp)

    def gputopo_run(label: str, namespace: str, events_per_pod: int) -> RunResult:
        return measure_run(
            kube,
            cp,
            label=label,
            scheduler=GPUTOPO_PROFILE,
            namespace=namespace,
            pods=args.pods,
            annotations={"gputopo.io/nvlink": "required"},
            workers=args.workers,
            deadline=deadline,
            settled=events_posted(cp, apiserver_calls(cp), events_per_pod),
        )

    # Scheduled and TopologyPlacement
    rnd.runs.append(gputopo_run("B gputopo-scheduler (extender)", "bench-gputopo", 2))
    rnd.calls.append(between(apiserver_calls(cp), calls_before))
    rnd.bytes_after = extender_bytes(ext_metrics)
    rnd.sched_lat[GPUTOPO_PROFILE] = diff(scheduler_metrics(cp, sched), before)
    rnd.ext_lat = diff(extender_metrics(ext_metrics), ext_before)
    if args.diagnose and not deadline.expired():
        # Run C: the same pods and profile, but kube-scheduler binds itself: the extender
        # answers filter and prioritize only. Separates the bind path's cost from the rest.
        cp.remove(sched)
        say("deleting run B's pods")
        delete_pods(kube, "bench-gputopo", args.workers, deadline)
        name = "gputopo-scheduler-nobind"
        ext = ExtenderConfig(url=stack.extender_url, bind_verb=None)
        cp.start_scheduler(name, profile=GPUTOPO_PROFILE, extender=ext, options=options)
        wait_scheduler_ready(cp, name, deadline)
        before = scheduler_metrics(cp, name)
        calls_before = apiserver_calls(cp)
        rnd.runs.append(gputopo_run("C gputopo, scheduler binds", "bench-gputopo-nobind", 1))
        rnd.sched_lat[name] = diff(scheduler_metrics(cp, name), before)
        rnd.calls.append(between(apiserver_calls(cp), calls_before))
        cp.remove(name)
        say("deleting run C's pods")
        delete_pods(kube, "bench-gputopo-nobind", args.workers, deadline)
    else:
        say("deleting run B's pods")
        delete_pods(kube, "bench-gputopo", args.workers, deadline)
    stack.stop()  # the next round's run A runs with no extender process
    return rnd


def print_rounds(rounds: list[Round]) -> None:
    """Every round's figures side by side, and their medians: on a shared machine one round's ratio swings
    by a third, the median of several much less."""

    def per_pod(r: RunResult, proc: str | None = None) -> float:
        cpu = r.cpu_s.get(proc, 0.0) if proc else sum(r.cpu_s.values())
        return 1000 * cpu / max(r.bound, 1)

    rows = []
    for rnd in rounds:
        if len(rnd.runs) < 2:
            continue
        a, b = rnd.runs[0], rnd.runs[1]
        rows.append((a.throughput, b.throughput, rnd.ratio(), per_pod(a), per_pod(b), per_pod(b, "gputopo-extender")))
    if not rows:
        return
    print(f"\nRounds ({len(rows)}; each: run A, then run B, on free nodes):")
    head = f"  {'round':<8} {'A pods/s':>9} {'B pods/s':>9} {'B/A':>6} {'A CPU ms/pod':>13} {'B CPU ms/pod':>13}"
    head += f" {'B/A CPU':>8} {'extender ms/pod':>16}"
    print(head)
    for i, (ta, tb, ratio, ca, cb, ce) in enumerate(rows, 1):
        print(f"  {i:<8} {ta:>9.1f} {tb:>9.1f} {ratio:>6.2f} {ca:>13.1f} {cb:>13.1f} {cb / ca:>8.2f} {ce:>16.1f}")
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"  {'median':<8} {med[0]:>9.1f} {med[1]:>9.1f} {med[2]:>6.2f} {med[3]:>13.1f} {med[4]:>13.1f} "
        f"{med[4] / med[3]:>8.2f} {med[5]:>16.1f}"
    )
    verdict = "met" if med[2] >= TARGET_RATIO else "NOT met"
    print(f"  median ratio {med[2]:.2f} (target >= {TARGET_RATIO}: {verdict}); CPU per pod {med[4] / med[3]:.2f}x")


def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.deadline)
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh first", file=sys.stderr)
        return 2
    rounds: list[Round] = []
    progress: Callable[[str], None] | None = say if args.verbose else None
    with ControlPlane(bin_dir, verbosity=args.scheduler_v, progress=progress, lifetime=Lifetime(keep=args.keep)) as cp:
        say(f"control plane up in {cp.dir}")
        kube = KubeClient(cp.kubeconfig, kubectl=cp.kubectl, pool_size=max(32, args.workers))
        stack = Stack(cp, kube, timing=StackTiming(stale_after_seconds=args.stale_after_seconds), progress=progress)
        stack.install()
        t = time.monotonic()
        nodes = sim_nodes(args.nodes)
        kube.create_nodes(nodes, workers=args.workers)
        create_leases(kube, stack.namespace, [n.name for n in nodes], args.workers)
        say(f"{args.nodes} nodes and Leases created in {time.monotonic() - t:.1f}s")
        for i in range(args.rounds):
            if deadline.expired():
                break
            say(f"round {i + 1} of {args.rounds}")
            rounds.append(one_round(args, cp, kube, stack, deadline))
        if args.keep:
            say(f"keeping {cp.dir} (logs: scheduler-*.log, gputopo-extender.log)")
        kube.close()
    if not rounds:
        return 1
    # The details of the round whose ratio is the median (the middle one of an odd count).
    shown = sorted(rounds, key=lambda r: r.ratio() if r.ratio() == r.ratio() else -1.0)[(len(rounds) - 1) // 2]
    if len(rounds) > 1:
        print(f"\nDetails of the median round ({rounds.index(shown) + 1} of {len(rounds)}):")
    print_report(args, shown.runs, shown.ext_lat, shown.sched_lat)
    print_per_pod(shown.runs, shown.calls, shown.ext_lat, shown.bytes_before, shown.bytes_after)
    print_rounds(rounds)
    if deadline.expired():
        print(f"\nthe global deadline ({args.deadline:.0f}s) ran out: the figures above are partial")
    complete = all(len(r.runs) >= 2 and all(x.bound == x.pods for x in r.runs) for r in rounds)
    return 0 if complete else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Pods per second bound by the real kube-scheduler, with the gputopo extender and without."
    )
    p.add_argument("--nodes", type=int, default=1000, help="simulated 8-GPU nodes (default 1000)")
    p.add_argument("--pods", type=int, default=500, help="8-GPU pods per run (default 500; at most --nodes)")
    p.add_argument("--qps", type=float, default=200.0, help="both schedulers' client QPS (default 200)")
    p.add_argument("--burst", type=int, default=400, help="both schedulers' client burst (default 400)")
    p.add_argument("--workers", type=int, default=32, help="parallel API clients for creates/deletes (32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of run A then run B; medians are printed (3)")
    p.add_argument("--deadline", type=float, default=900.0, help="global time budget in seconds (900)")
    p.add_argument("--stale-after-seconds", type=float, default=3600.0, help="extender's Lease staleness (3600)")
    p.add_argument("--extender-log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--scheduler-v", type=int, default=2, help="kube-scheduler --v (default 2)")
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="add run C: the gputopo profile with kube-scheduler binding itself (extender filter+prioritize only)",
    )
    p.add_argument(
        "--filter-all",
        action="store_true",
        help="the extender's filter passes every fitting node (kube-scheduler scores them and calls prioritize), "
        "not the chart's one best node",
    )
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs) after teardown")
    p.add_argument("--verbose", action="store_true", help="show control-plane progress")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.pods < 1 or args.rounds < 1:
        p.error("--nodes, --pods and --rounds must be positive")
    if args.pods > args.nodes:
        p.error("--pods must not exceed --nodes: every pod takes a whole 8-GPU node")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"scheduler_throughput: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
