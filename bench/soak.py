"""Soak: thousands of placements with churn on the local stack, checked all the way.

A real control plane (etcd, kube-apiserver, kube-scheduler running the Helm chart's configuration
with the gputopo-extender sidecar) and simulated GPU nodes, each with its own gputopo-agent. Pods of
1, 2, 4 and 8 GPUs (NVLink required) arrive in waves; after each wave a share of the bound pods is
deleted, so GPUs are freed and taken again all the time. The harness plays each node's kubelet: it
writes the per-pod truth (each bound pod's placed GPUs under its UID) for the node's agent to publish,
so the extender accounts from reported truth, as on a real node. With ``--kubelet`` (root only) one
node is run by a real kubelet instead, whose agent reports what the kubelet actually allocated.

A checker thread runs ``gputopo.localcluster.checks.check_gpus`` continuously over every live pod and
node: no GPU held by two live pods, and every placement matches what its node reports for the pod.
Both counts should be 0. Prints progress, then a table: placements, placements/s, CPU per placement.

    .venv/bin/python bench/soak.py                       # >= 10,000 placements (about 15 minutes on 2 cores)
    .venv/bin/python bench/soak.py --placements 500 --nodes 8 --deadline 120
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.localcluster import (
    ControlPlane,
    ControlPlaneError,
    KubeApiError,
    KubeClient,
    Lifetime,
    PodScheduling,
    pod_manifest,
)
from gputopo.localcluster.checks import check_gpus, per_pod_truth
from gputopo.localcluster.kubelet import kubelet_unavailable
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, SCHEDULER_NAME

NAMESPACE = "soak"
LABEL = "gputopo.io/soak"
SIZES = (1, 2, 4, 8)
WEIGHTS = (40, 30, 20, 10)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process and its waited-for children (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[0] is the state (field 3); utime, stime, cutime, cstime are fields 14-17.
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def component_group(name: str) -> str:
    if name.startswith("agent-"):
        return "agents"
    if "extender" in name:
        return "extender"
    if "scheduler" in name:
        return "kube-scheduler"
    return name


@dataclass
class Tally:
    placed: set[str] = field(default_factory=set)  # UIDs seen bound with a placement
    deleted: int = 0
    created: int = 0
    checks: int = 0
    double_booked: set[str] = field(default_factory=set)
    mismatched: set[str] = field(default_factory=set)
    unreadable: set[str] = field(default_factory=set)
    max_reported: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def checker(kube: KubeClient, tally: Tally, stop: threading.Event, period: float) -> None:
    """The invariant, checked continuously over everything live (not only after waves)."""
    while not stop.is_set():
        try:
            pods = kube.list_pods(NAMESPACE)
            nodes = kube.list_nodes(label_selector=LABEL)
        except KubeApiError:
            stop.wait(period)
            continue
        result = check_gpus(pods, nodes)
        with tally.lock:
            tally.checks += 1
            tally.double_booked.update(result.double_booked)
            tally.mismatched.update(result.mismatched)
            tally.unreadable.update(result.unreadable)
            tally.max_reported = max(tally.max_reported, result.reported)
        stop.wait(period)


def new_pod(rng: random.Random, serial: int) -> tuple[dict[str, Any], int]:
    """A pod of a random size; its name ends in -g<GPUs> so a listing tells what is requested."""
    gpus = rng.choices(SIZES, WEIGHTS)[0]
    return (
        pod_manifest(
            f"p{serial}-g{gpus}",
            namespace=NAMESPACE,
            gpus=gpus,
            annotations={"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(scheduler_name=SCHEDULER_NAME, node_selector={LABEL: "1"}),
        ),
        gpus,
    )


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    say = print
    t_start = time.monotonic()
    deadline = t_start + args.deadline
    with ControlPlane(verbosity=1, lifetime=Lifetime(keep=args.keep)) as cp:
        kube = cp.client()
        stack = Stack(
            cp,
            kube,
            timing=StackTiming(stale_after_seconds=3600, heartbeat_seconds=30, interval_seconds=args.agent_interval),
            progress=(lambda m: say(f"  {m}")) if args.verbose else None,
        )
        stack.start()
        kube.create_namespace(NAMESPACE)
        names = [f"soak-{i:03d}" for i in range(args.nodes)]
        stack.add_nodes([GpuNode(n, args.system, labels={LABEL: "1"}) for n in names])
        kubelet_node = None
        if args.kubelet:
            reason = kubelet_unavailable(cp.bin_dir)
            if reason is None:
                kubelet_node = "soak-kubelet"
                stack.add_kubelet_node(kubelet_node, args.system, labels={LABEL: "1"})
            else:
                say(f"no real-kubelet node: {reason}")
        stack.wait_published(timeout=120)
        simulated = names
        capacity = args.nodes * 8 + (8 if kubelet_node else 0)
        say(
            f"soak: {len(names)} simulated {args.system} nodes"
            + (f" + real-kubelet node {kubelet_node}" if kubelet_node else "")
            + f" ({capacity} GPUs); target {args.placements} placements within {args.deadline:.0f}s"
        )
        pids = {n: cp.pid(n) for n in cp.components()}
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items() if p}
        own0 = os.times()
        tally = Tally()
        stop = threading.Event()
        thread = threading.Thread(target=checker, args=(kube, tally, stop, args.check_period), daemon=True)
        thread.start()
        t0 = time.monotonic()
        serial = 0
        wave = 0
        target_gpus = int(capacity * args.fill)
        try:
            while len(tally.placed) < args.placements and time.monotonic() < deadline:
                wave += 1
                live = kube.list_pods(NAMESPACE)
                requested = sum(int(p["metadata"]["name"].rsplit("-g", 1)[1]) for p in live)
                batch: list[dict[str, Any]] = []
                while requested < target_gpus:
                    pod, gpus = new_pod(rng, serial)
                    serial += 1
                    batch.append(pod)
                    requested += gpus
                kube.create_pods(batch, workers=args.workers)
                tally.created += len(batch)
                # The wave ends when nothing new binds for a while (the rest waits for freed GPUs)
                # or when every pod is bound.
                settle = time.monotonic() + args.wave_timeout
                last_bound = -1
                bound: list[dict[str, Any]] = []
                quiet_since = time.monotonic()
                while time.monotonic() < min(settle, deadline):
                    live = kube.list_pods(NAMESPACE)
                    bound = [p for p in live if p["spec"].get("nodeName")]
                    if len(bound) != last_bound:
                        last_bound, quiet_since = len(bound), time.monotonic()
                    if len(bound) == len(live) or time.monotonic() - quiet_since > args.quiet:
                        break
                    time.sleep(0.2)
                for p in bound:
                    if PLACEMENT_ANNOTATION in p["metadata"].get("annotations", {}):
                        tally.placed.add(p["metadata"]["uid"])
                # Play each simulated node's kubelet: report each bound pod's GPUs under its UID.
                for node in simulated:
                    stack.set_in_use(node, pods=per_pod_truth(live, node))
                elapsed = time.monotonic() - t0
                with tally.lock:
                    bad = len(tally.double_booked), len(tally.mismatched)
                say(
                    f"wave {wave:4d}  {elapsed:6.0f}s  placed {len(tally.placed):6d}  "
                    f"({len(tally.placed) / max(elapsed, 1e-9):5.1f}/s)  live {len(live):4d} bound {len(bound):4d}  "
                    f"checks {tally.checks:5d}  double-booked {bad[0]}  mismatched {bad[1]}"
                )
                # Churn: delete a share of the bound pods (their GPUs are taken again next wave).
                victims = rng.sample(bound, int(len(bound) * args.churn))
                with ThreadPoolExecutor(args.workers) as pool:
                    list(pool.map(lambda v: kube.delete_pod(NAMESPACE, v["metadata"]["name"]), victims))
                tally.deleted += len(victims)
            # One last full check once every report has caught up with the final truth.
            live = kube.list_pods(NAMESPACE)
            for node in simulated:
                stack.set_in_use(node, pods=per_pod_truth(live, node))
            time.sleep(max(2.0, 2 * args.agent_interval))
        finally:
            stop.set()
            thread.join(timeout=30)
        elapsed = time.monotonic() - t0
        final = check_gpus(kube.list_pods(NAMESPACE), kube.list_nodes(label_selector=LABEL))
        tally.double_booked.update(final.double_booked)
        tally.mismatched.update(final.mismatched)
        cpu: dict[str, float] = {}
        for n, pid in pids.items():
            if pid and n in cpu0:
                group = component_group(n)
                cpu[group] = cpu.get(group, 0.0) + cpu_seconds(pid) - cpu0[n]
        own1 = os.times()
        cpu["soak harness"] = (own1.user - own0.user) + (own1.system - own0.system)
        kube.close()
    placed = len(tally.placed)
    total_cpu = sum(cpu.values())
    print()
    print("| figure | value |")
    print("|---|---|")
    rows = [
        ("nodes (GPUs)", f"{args.nodes}{' + 1 real kubelet' if kubelet_node else ''} ({capacity})"),
        ("waves", f"{wave}"),
        ("pods created / deleted", f"{tally.created} / {tally.deleted}"),
        ("placements", f"{placed}"),
        ("wall time", f"{elapsed:.0f} s"),
        ("placements/s", f"{placed / max(elapsed, 1e-9):.1f}"),
        ("checks run (continuous)", f"{tally.checks}"),
        ("most pods reported by their node in one check", f"{tally.max_reported}"),
        ("GPUs double-booked (target 0)", f"{len(tally.double_booked)}"),
        ("placements not matching the node's truth (target 0)", f"{len(tally.mismatched)}"),
        ("unreadable annotations", f"{len(tally.unreadable)}"),
        ("CPU per placement, all processes", f"{1000 * total_cpu / max(placed, 1):.1f} ms"),
    ]
    rows += [(f"  CPU per placement, {g}", f"{1000 * c / max(placed, 1):.1f} ms") for g, c in sorted(cpu.items())]
    for k, v in rows:
        print(f"| {k} | {v} |")
    for line in sorted(tally.double_booked)[:10] + sorted(tally.mismatched)[:10]:
        print(f"  ! {line}")
    ok = placed >= args.placements and not tally.double_booked and not tally.mismatched
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Placements with churn on the local stack, checked continuously.")
    p.add_argument("--placements", type=int, default=10_000, help="stop after this many placements (10000)")
    p.add_argument("--deadline", type=float, default=1500.0, help="stop after this many seconds (1500)")
    p.add_argument("--nodes", type=int, default=48, help="simulated 8-GPU nodes, one agent each (48)")
    p.add_argument("--system", default="dgx-h100", help="the nodes' fixture system (dgx-h100)")
    p.add_argument("--fill", type=float, default=0.85, help="GPUs requested per wave, share of capacity (0.85)")
    p.add_argument("--churn", type=float, default=0.7, help="share of bound pods deleted after each wave (0.7)")
    p.add_argument("--wave-timeout", type=float, default=60.0, help="longest wave in seconds (60)")
    p.add_argument("--quiet", type=float, default=0.5, help="a wave ends after this long without a bind (0.5)")
    p.add_argument("--check-period", type=float, default=1.0, help="seconds between continuous checks (1)")
    p.add_argument("--agent-interval", type=float, default=3.0, help="agents' discovery interval (3)")
    p.add_argument("--workers", type=int, default=8, help="parallel API clients for creates (8)")
    p.add_argument("--kubelet", action="store_true", help="add one node run by a real kubelet (root only)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs)")
    p.add_argument("--verbose", action="store_true", help="show control-plane progress")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.placements < 1 or not 0 < args.fill <= 1 or not 0 <= args.churn <= 1:
        p.error("--nodes and --placements must be positive, --fill in (0, 1], --churn in [0, 1]")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
