"""DRA churn soak: thousands of GPU claims created and deleted through kube-scheduler's real allocator.

A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler with the chart's DRA
profile and the gputopo-extender) and `--nodes` nodes, each run by an upstream kubelet on Kubernetes' fake
CRI, whose gputopo-agent is the node's DRA driver (best-fit order where the release documents the
allocator's order, 1.36 and later). Pods arrive with one claim each from the template gputopo's webhook
gives an NVLink-required TP group of 1, 2, 4 or 8 GPUs (the Alibaba multi-GPU replay's mix of those sizes),
run for a few seconds, and are deleted, `--concurrent` at a time, until `--claims` claims were made.

A checker reads every ResourceClaim and every node's driver checkpoint (what NodePrepareResources
answered) all along and counts, each of which should stay 0:

- double allocations: one GPU in two live claims' allocations on one node;
- allocations that are not one NVLink clique of their node;
- prepared claims whose devices differ from their allocation, or are not one clique, or overlap another
  prepared claim's GPUs on the node.

Then prints a table: claims made, allocated, refused (unschedulable past `--give-up` seconds), the
counts above, ResourceSlice writes per allocation (the slices' generation increments), and the CPU of
each component per allocation.

    sudo .venv/bin/python bench/dra_churn_soak.py --bin-dir "$(ls -d ~/.cache/gputopo/k8s-v1.37.2_*/bin)"
    sudo .venv/bin/python bench/dra_churn_soak.py --claims 100 --nodes 2 --deadline 300   # smoke

Needs root (a private mount namespace per kubelet) and the kubelet and fakecri binaries in the bin dir.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gputopo.engine.dra.claims import claim_template
from gputopo.engine.state.cliques import maximal_cliques, popcount
from gputopo.engine.state.snapshot import shape_of
from gputopo.localcluster import ControlPlane, KubeApiError, KubeClient, Lifetime, PodScheduling, pod_manifest
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.kubelet import kubelet_unavailable
from gputopo.localcluster.stack import ChartRelease, KubeletAgent, SchedulerPods, Stack, StackTiming
from gputopo.model import NvlinkPolicy, PodRequest
from gputopo.model.dra import DRIVER, device_gpus
from gputopo.systems import build_system

NS = "dra-soak"
LABEL = "gputopo.io/dra-soak"
PODS_CSV = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "data"
    / "alibaba-gpu-v2023"
    / "openb_pod_list_multigpu50.csv"
)
FALLBACK_WEIGHTS = {1: 40, 2: 30, 4: 20, 8: 10}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def say(msg: str) -> None:
    print(msg, flush=True)


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a live process and its waited-for children (0 if gone)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def size_weights() -> dict[int, int]:
    """How often the Alibaba multi-GPU replay asks 1, 2, 4 and 8 GPUs (fixed weights without the data)."""
    if not PODS_CSV.exists():
        return dict(FALLBACK_WEIGHTS)
    counts = dict.fromkeys(FALLBACK_WEIGHTS, 0)
    with PODS_CSV.open() as f:
        for r in csv.DictReader(f):
            g = int(r["num_gpu"])
            if g in counts:
                counts[g] += 1
    return counts


@dataclass
class Tally:
    made: int = 0
    allocated: set[str] = field(default_factory=set)  # claim UIDs seen allocated
    refused: int = 0
    checks: int = 0
    double: set[str] = field(default_factory=set)  # "node/gpu" seen in two live claims at once
    not_clique: set[str] = field(default_factory=set)  # claim UIDs
    prepared_mismatch: set[str] = field(default_factory=set)
    prepared_not_clique: set[str] = field(default_factory=set)
    prepared_overlap: set[str] = field(default_factory=set)  # both claims still allocated
    # One claim gone from the API (deallocated) but not yet unprepared by the kubelet when the other was
    # prepared: the kubelet's late Unprepare, not two allocations.
    stale_overlap: set[str] = field(default_factory=set)
    ran: int = 0  # pods seen Running
    errors: list[str] = field(default_factory=list)
    blocks: int = 0  # allocations that are one block device


@dataclass(frozen=True)
class Soak:
    kube: KubeClient
    stack: Stack
    adj: Mapping[str, tuple[int, ...]]  # node -> adjacency masks
    checkpoints: Mapping[str, Path]  # node -> the driver's checkpoint file


def is_clique(adj: Sequence[int], gpus: Sequence[int]) -> bool:
    return all(a < len(adj) and adj[a] >> b & 1 for a, b in combinations(gpus, 2))


def claim_gpus(claim: Mapping[str, Any]) -> tuple[str | None, tuple[int, ...]]:
    """The pool (node) and GPUs a claim's allocation holds under our driver."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    pool: str | None = None
    gpus: list[int] = []
    for r in results:
        if r.get("driver") != DRIVER:
            continue
        pool = r.get("pool")
        gpus.extend(device_gpus(str(r.get("device"))) or (-1,))
    return pool, tuple(sorted(gpus))


def check_once(soak: Soak, tally: Tally) -> None:
    claims = json.loads(soak.kube.kubectl("get", "resourceclaims", "-n", NS, "-o", "json"))["items"]
    held: dict[str, dict[int, str]] = {}
    allocation: dict[str, tuple[int, ...]] = {}
    for c in claims:
        uid = c["metadata"]["uid"]
        pool, gpus = claim_gpus(c)
        if pool is None:
            continue
        if uid not in tally.allocated and any(
            str(r.get("device", "")).startswith("block-") for r in c["status"]["allocation"]["devices"]["results"]
        ):
            tally.blocks += 1
        tally.allocated.add(uid)
        allocation[uid] = gpus
        if pool in soak.adj and not is_clique(soak.adj[pool], gpus):
            tally.not_clique.add(uid)
        for g in gpus:
            other = held.setdefault(pool, {}).setdefault(g, uid)
            if other != uid:
                tally.double.add(f"{pool}/{g}")
    for node, path in soak.checkpoints.items():
        try:
            prepared = json.loads(path.read_text())["claims"] if path.exists() else {}
        except (OSError, ValueError, KeyError):
            continue  # mid-rename on a busy node: read again next round
        taken: dict[int, str] = {}
        for uid, entry in prepared.items():
            gpus = tuple(sorted(g for d in entry.get("devices", []) for g in device_gpus(d["deviceName"]) or (-1,)))
            if uid in allocation and allocation[uid] != gpus:
                tally.prepared_mismatch.add(uid)
            if not is_clique(soak.adj[node], gpus):
                tally.prepared_not_clique.add(uid)
            for g in gpus:
                other = taken.setdefault(g, uid)
                if other != uid:
                    live = uid in allocation and other in allocation
                    (tally.prepared_overlap if live else tally.stale_overlap).add(f"{node}/{g}/{min(uid, other)}")
    tally.checks += 1


def checker(soak: Soak, tally: Tally, stop: threading.Event, period: float) -> None:
    while not stop.wait(period):
        try:
            check_once(soak, tally)
        except Exception as e:  # a failed read is reported, not fatal to the soak
            tally.errors.append(f"check: {e}")


def slice_generations(kube: KubeClient) -> dict[str, int]:
    items = json.loads(kube.kubectl("get", "resourceslices", "-o", "json"))["items"]
    return {
        s["metadata"]["name"]: int(s["metadata"].get("generation", 1))
        for s in items
        if s["spec"].get("driver") == DRIVER
    }


def pod_for(name: str, template: str, scheduler: str, grace: int) -> dict[str, Any]:
    m = pod_manifest(
        name,
        namespace=NS,
        labels={LABEL: "1"},
        annotations={"gputopo.io/nvlink": "required"},
        scheduling=PodScheduling(scheduler_name=scheduler, node_selector={LABEL: "1"}),
    )
    m["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
    m["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
    # With 0 the kubelet may let the pod go before its claim is unprepared (kubernetes#131513).
    m["spec"]["terminationGracePeriodSeconds"] = grace
    return m


def delete_graceful(kube: KubeClient, name: str) -> None:
    """A normal delete: the kubelet stops the pod and unprepares its claim before the pod is gone."""
    try:
        kube.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}")
    except KubeApiError as e:
        if e.status != 404:
            raise


def churn(soak: Soak, args: argparse.Namespace, templates: Mapping[int, str], tally: Tally) -> None:
    rng = random.Random(args.seed)
    weights = size_weights()
    sizes = [s for s in weights if s in templates]
    live: dict[str, float] = {}  # pod -> when it may go (Running) or be given up (pending)
    running: set[str] = set()
    deadline = time.monotonic() + args.deadline
    while (tally.made < args.claims or live) and time.monotonic() < deadline:
        while tally.made < args.claims and len(live) < args.concurrent:
            size = rng.choices(sizes, [weights[s] for s in sizes])[0]
            name = f"soak-{tally.made:05d}-g{size}"
            soak.kube.create_pod(pod_for(name, templates[size], soak.stack.scheduler_name, args.grace))
            live[name] = time.monotonic() + args.give_up
            tally.made += 1
        now = time.monotonic()
        for p in soak.kube.list_pods(NS, label_selector=f"{LABEL}=1"):
            name = p["metadata"]["name"]
            if name not in live or name in running:
                continue
            phase = (p.get("status") or {}).get("phase")
            if phase == "Running":
                running.add(name)
                tally.ran += 1
                live[name] = now + rng.expovariate(1 / args.hold)
        for name, until in list(live.items()):
            if until <= now:
                if name not in running:
                    tally.refused += 1
                delete_graceful(soak.kube, name)
                running.discard(name)
                del live[name]
        if tally.made and tally.made % 200 == 0 and len(live) == args.concurrent:
            say(f"  {tally.made} made, {len(tally.allocated)} allocated, {tally.refused} refused")
        time.sleep(0.3)


def run(args: argparse.Namespace) -> int:
    bin_dir = Path(args.bin_dir)
    reason = kubelet_unavailable(bin_dir)
    if reason is not None:
        say(f"cannot run: {reason}")
        return 2
    minor = kubernetes_version(bin_dir)[1]
    best_fit = minor >= 36
    blocks = best_fit and not args.no_blocks  # partitionable devices: on by default from 1.36
    with ControlPlane(bin_dir, lifetime=Lifetime(keep=args.keep)) as cp:
        cp.start_controller_manager()
        kube = cp.client()
        stack = Stack(
            cp,
            kube,
            timing=StackTiming(stale_after_seconds=120, heartbeat_seconds=5, interval_seconds=2),
            scheduler=SchedulerPods(extender_name="gputopo-extender-dra"),
            chart=ChartRelease(dra=True, kube_version=".".join(map(str, kubernetes_version(bin_dir)))),
        )
        stack.start()
        kube.create_namespace(NS)
        systems = args.systems.split(",")
        adj: dict[str, tuple[int, ...]] = {}
        checkpoints: dict[str, Path] = {}
        agent = KubeletAgent(dra=True, dra_best_fit_order=best_fit, dra_blocks=blocks)
        for i in range(args.nodes):
            name, system = f"soak-{i}", systems[i % len(systems)]
            stack.add_kubelet_node(
                name,
                system,
                labels={LABEL: "1"},
                agent=agent,
            )
            adj[name] = tuple(shape_of(build_system(system)).adj)
            checkpoints[name] = stack.kubelets[name].dra_plugins_dir / DRIVER / "checkpoint.json"
        largest = max(max(map(popcount, maximal_cliques(a, (1 << len(a)) - 1))) for a in adj.values())
        templates: dict[int, str] = {}
        for size in FALLBACK_WEIGHTS:
            if size <= largest:
                t = claim_template(
                    PodRequest(gpus=size, nvlink=NvlinkPolicy.REQUIRED), list_attributes=False, blocks=blocks
                )
                kube.apply(
                    [
                        {
                            "apiVersion": "resource.k8s.io/v1",
                            "kind": "ResourceClaimTemplate",
                            "metadata": {"name": t.name, "namespace": NS},
                            "spec": {"spec": {"devices": dict(t.devices)}},
                        }
                    ]
                )
                templates[size] = t.name
        soak = Soak(kube, stack, adj, checkpoints)
        say(
            f"DRA churn soak: Kubernetes 1.{minor}, {args.nodes} nodes ({args.systems}), "
            f"best-fit order {best_fit}, blocks {blocks}, "
            f"{args.claims} claims, {args.concurrent} at once"
        )
        gen0 = slice_generations(kube)
        pids = {n: cp.pid(n) for n in cp.components()}
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
        tally = Tally()
        stop = threading.Event()
        thread = threading.Thread(target=checker, args=(soak, tally, stop, args.check_period), daemon=True)
        thread.start()
        t0 = time.monotonic()
        try:
            churn(soak, args, templates, tally)
        finally:
            stop.set()
            thread.join()
        wall = time.monotonic() - t0
        check_once(soak, tally)
        gen1 = slice_generations(kube)
        writes = sum(g - gen0.get(n, 0) for n, g in gen1.items())
        cpu: dict[str, float] = {}
        for n, p in pids.items():
            group = "agents" if n.startswith("agent-") else "extender" if "extender" in n else n
            cpu[group] = cpu.get(group, 0.0) + cpu_seconds(p) - cpu0[n]
    report(tally, writes, wall, cpu)
    say(f"blocks allocated: {tally.blocks}")
    bad = (
        tally.double
        or tally.not_clique
        or tally.prepared_mismatch
        or tally.prepared_not_clique
        or tally.prepared_overlap
    )
    return 1 if bad or tally.made < args.claims else 0


def report(tally: Tally, writes: int, wall: float, cpu: Mapping[str, float]) -> None:
    n = max(1, tally.ran)
    rows = [
        ("claims made", tally.made),
        ("pods run (each its claim allocated and prepared)", tally.ran),
        ("claims seen allocated by the checker", len(tally.allocated)),
        ("refused (pending past --give-up)", tally.refused),
        ("checks", tally.checks),
        ("double allocations (target 0)", len(tally.double)),
        ("allocations not one clique (target 0)", len(tally.not_clique)),
        ("prepared != allocated (target 0)", len(tally.prepared_mismatch)),
        ("prepared not one clique (target 0)", len(tally.prepared_not_clique)),
        ("prepared GPUs of two allocated claims (target 0)", len(tally.prepared_overlap)),
        ("prepared GPUs of a claim deallocated, not yet unprepared", len(tally.stale_overlap)),
        (
            "ResourceSlice writes per claim change",
            f"{writes / (2 * n):.2f} ({writes} writes, {2 * n} prepares and unprepares)",
        ),
        ("wall s / pods run per s", f"{wall:.0f} / {tally.ran / max(wall, 1e-9):.2f}"),
    ]
    rows += [(f"CPU ms per allocation: {g}", f"{1000 * s / n:.1f}") for g, s in sorted(cpu.items())]
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        say(f"| {k:<{width}} | {v} |")
    for e in tally.errors[:5]:
        say(f"checker error: {e}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", default=os.environ.get("GPUTOPO_BIN_DIR", ""), help="the control-plane binaries")
    p.add_argument("--claims", type=int, default=2000)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--systems", default="dgx-1v,dgx-h100", help="systems of the nodes, in turn")
    p.add_argument("--concurrent", type=int, default=16, help="pods alive at once")
    p.add_argument("--hold", type=float, default=4.0, help="mean seconds a running pod is kept")
    p.add_argument("--give-up", type=float, default=30.0, help="seconds a pending pod waits before it is deleted")
    p.add_argument("--check-period", type=float, default=2.0)
    p.add_argument("--deadline", type=float, default=3600.0, help="stop making claims after this many seconds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--grace", type=int, default=1, help="the pods' terminationGracePeriodSeconds")
    p.add_argument("--no-blocks", action="store_true", help="no clique blocks even where partitionable devices are on")
    p.add_argument("--keep", action="store_true", help="keep the control plane's directory")
    args = p.parse_args(argv)
    if not args.bin_dir:
        p.error("--bin-dir or GPUTOPO_BIN_DIR is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
