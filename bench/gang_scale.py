"""A big gang through the real kube-scheduler: one Indexed Job of 1,024 pods x 8 GPUs on 5,000 simulated
nodes in 40 leaves, no gputopo annotation on the pods (the group comes from the Job's labels and its
`spec.completions`, docs/annotations.md "Jobs").

Starts etcd, kube-apiserver, kube-scheduler with the chart's profile and the real gputopo-extender
(`localcluster`), creates the nodes (Node objects with the agent's annotations and a Lease each;
no agent processes), then the Job. Its pods come from one of two places (`--via`):

  controller  kube-controller-manager's Job controller creates them (the default when the binary is built)
  pods        this script creates exactly what the Job controller would (labels, completion index
              annotation, owner reference), all at once: the extender's and kube-scheduler's part alone
  plain       as `pods`, under a kube-scheduler with no extender: the same pods without gputopo
  jobset      a JobSet of Jobs of --per-job pods through the real JobSet controller (its webhooks on),
              then the Job controller; needs gputopo/localcluster/build_controllers.sh

With `--gate on` (or `off,on`, side by side) the extender's webhook gives every member gputopo's scheduling
gate (`--group-gate`, docs/annotations.md "While a gang is gated"): the members wait outside kube-scheduler's
queue until the gang is whole, then the extender lifts every gate at once.

It prints the seconds from the Job's creation to the last bind, the CPU seconds of every process
(extender and kube-scheduler apart) and per member, and the leaves the bound pods span against the
fewest that can hold them. Targets (30 s to the last bind on this machine; the fewest leaves) are
printed next to the figures, never asserted. Everything listens on 127.0.0.1; a global deadline
bounds the run; teardown stops only the processes this script started.

    .venv/bin/python bench/gang_scale.py                        # 1,024 pods, 5,000 nodes, 40 leaves
    .venv/bin/python bench/gang_scale.py --pods 256 --nodes 1000 --leaves 8 --via pods
    .venv/bin/python bench/gang_scale.py --via jobset,pods      # the real JobSet controller, then the
                                                                # same pods created at once, side by side
    .venv/bin/python bench/gang_scale.py --via jobset --gate off,on    # the JobSet without and with the gate
    .venv/bin/python bench/gang_scale.py --pods 1024,4096 --leaves 157 --via pods,plain
                                                                # both sizes, gputopo and kube-scheduler alone
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler_throughput import create_leases, wait_scheduler_ready
from throughput_run import Deadline, say

from gputopo.agent.labels import node_labels
from gputopo.localcluster import (
    GPUTOPO_PROFILE,
    PLAIN_PROFILE,
    ControlPlane,
    ControlPlaneError,
    KubeApiError,
    KubeClient,
    Lifetime,
    PodScheduling,
    SchedulerOptions,
    SimNode,
    find_binaries,
    network_labels,
    pod_manifest,
)
from gputopo.localcluster.jobcontrollers import JobControllers, controllers_missing, find_controllers_dir
from gputopo.localcluster.procstats import cpu_snapshot
from gputopo.localcluster.stack import ChartRelease, SchedulerPods, Stack, StackTiming
from gputopo.model import GPUS_IN_USE_ANNOTATION, TOPOLOGY_ANNOTATION
from gputopo.systems import build_system

GPUS = 8
TARGET_S = 30.0
NAMESPACE = "bench-gang"
JOB = "pretrain"
# What the Job controller puts on an Indexed Job's pods (k8s.io/api batch/v1 well-known labels).
JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def sim_nodes(count: int, leaves: int, leaves_per_spine: int) -> list[SimNode]:
    per_leaf = math.ceil(count / leaves)
    out = []
    for i in range(count):
        name = f"gpu-{i:05d}"
        topo = build_system("dgx-h100", name)
        leaf = i // per_leaf
        labels = {
            **network_labels(leaf=f"leaf-{leaf}", spine=f"spine-{leaf // leaves_per_spine}"),
            **node_labels(topo),
        }
        annotations = {TOPOLOGY_ANNOTATION: topo.to_annotation(), GPUS_IN_USE_ANNOTATION: "[]"}
        out.append(SimNode(name=name, gpus=len(topo.gpus), labels=labels, annotations=annotations))
    return out


def job_manifest(pods: int, scheduler: str = GPUTOPO_PROFILE) -> dict[str, Any]:
    template = pod_manifest("x", namespace=NAMESPACE, gpus=GPUS, scheduling=PodScheduling(scheduler_name=scheduler))
    spec = template["spec"]
    spec["restartPolicy"] = "Never"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": JOB, "namespace": NAMESPACE},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": {"app": "gang-scale"}}, "spec": spec},
        },
    }


def member_manifest(job: dict[str, Any], index: int, scheduler: str = GPUTOPO_PROFILE) -> dict[str, Any]:
    """Pod `index` as the Job controller makes it (pkg/controller/job: `<job>-<index>-<random>` names,
    the job-name, controller-uid and completion-index labels, the index annotation, a controller
    owner reference)."""
    meta = job["metadata"]
    uid = meta["uid"]
    pod = pod_manifest(
        f"{JOB}-{index}-{uuid.uuid4().hex[:5]}",
        namespace=NAMESPACE,
        gpus=GPUS,
        labels={
            "app": "gang-scale",
            JOB_NAME: JOB,
            "job-name": JOB,
            CONTROLLER_UID: uid,
            "controller-uid": uid,
            COMPLETION_INDEX: str(index),
        },
        annotations={COMPLETION_INDEX: str(index)},
        scheduling=PodScheduling(scheduler_name=scheduler),
    )
    pod["spec"]["restartPolicy"] = "Never"
    pod["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": JOB,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return pod


def gang_pods(kube: KubeClient) -> tuple[int, dict[str, str]]:
    """The members that exist, and the node of each bound one."""
    pods = kube.list_pods(NAMESPACE, label_selector="app=gang-scale")
    bound = {p["metadata"]["name"]: str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")}
    return len(pods), bound


@dataclass
class Result:
    via: str
    gated: bool
    pods: int
    bound: dict[str, str]
    wall: float
    created: float  # seconds from the start until every member existed (polled: within 0.25 s and a list)
    cpu: dict[str, float]
    leaves: int


def jobset_manifest(pods: int, per_job: int) -> dict[str, Any]:
    """A JobSet of `pods // per_job` Jobs of `per_job` pods, as a user writes it: no gputopo annotation,
    JobSet's defaults (Indexed Jobs) added by its own webhook."""
    job = job_manifest(per_job)["spec"]
    del job["completionMode"]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JOB, "namespace": NAMESPACE},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": pods // per_job, "template": {"spec": job}}]},
    }


def _submit(kube: KubeClient, args: argparse.Namespace, via: str, pods: int) -> None:
    if via == "jobset":
        kube.request(
            "POST",
            f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NAMESPACE}/jobsets",
            jobset_manifest(pods, args.per_job),
        )
        return
    scheduler = PLAIN_PROFILE if via == "plain" else GPUTOPO_PROFILE
    job = kube.request("POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", job_manifest(pods, scheduler))
    if via in ("pods", "plain"):
        kube.create_pods([member_manifest(job, i, scheduler) for i in range(pods)], workers=args.workers)


def run_one(
    args: argparse.Namespace, bin_dir: Path, via: str, pods: int, deadline: Deadline, gated: bool = False
) -> Result:
    with ControlPlane(bin_dir, lifetime=Lifetime(keep=args.keep)) as cp:
        say(f"[{via}] control plane up in {cp.dir}")
        kube = KubeClient(cp.kubeconfig, kubectl=cp.kubectl, pool_size=max(32, args.workers))
        values = {"webhook": {"groupGate": {"enabled": True}}} if gated else {}
        stack = Stack(
            cp,
            kube,
            timing=StackTiming(stale_after_seconds=3600.0),
            scheduler=SchedulerPods(webhook=gated),
            chart=ChartRelease(values=values),
        )
        stack.install()  # the chart's namespace, RBAC and policies
        t = time.monotonic()
        nodes = sim_nodes(args.nodes, args.leaves, args.leaves_per_spine)
        leaf_of = {n.name: n.labels["gputopo.io/network-leaf"] for n in nodes}
        kube.create_nodes(nodes, workers=args.workers)
        create_leases(kube, stack.namespace, [n.name for n in nodes], args.workers)
        say(f"[{via}] {args.nodes} nodes and Leases in {time.monotonic() - t:.1f}s")
        if via == "plain":  # kube-scheduler alone: no extender process at all
            wait_scheduler_ready(
                cp,
                cp.start_plain_scheduler(options=SchedulerOptions(client_qps=args.qps, client_burst=args.burst)),
                deadline,
            )
        else:
            stack.start_extender()
            wait_scheduler_ready(cp, stack.start_scheduler(client_qps=args.qps, client_burst=args.burst), deadline)
        if via in ("controller", "jobset"):
            qps = ["--kube-api-qps", f"{args.controller_qps:g}", "--kube-api-burst", str(int(2 * args.controller_qps))]
            cp.start_controller_manager(extra_args=qps if args.controller_qps else ())
        if via == "jobset":
            directory = find_controllers_dir()
            assert directory is not None  # checked before any run
            JobControllers(cp, kube, directory).ensure("jobset")
        kube.create_namespace(NAMESPACE)
        if gated:
            stack.route_pods_to_webhook("gang-scale-gate", NAMESPACE, timeout=60.0)
        # Settle: every component idle before the clock starts.
        time.sleep(2.0)
        cpu0 = cpu_snapshot(cp, "this benchmark")
        t0 = time.monotonic()
        _submit(kube, args, via, pods)
        say(f"[{via}] {JOB} created ({pods} pods)")
        bound: dict[str, str] = {}
        last_report, created = t0, math.nan
        while not deadline.expired():
            made, bound = gang_pods(kube)
            if made >= pods and created != created:
                created = time.monotonic() - t0
            if len(bound) >= pods:
                break
            if time.monotonic() - last_report >= 5:
                say(f"[{via}] {len(bound)}/{pods} bound after {time.monotonic() - t0:.1f}s")
                last_report = time.monotonic()
            time.sleep(0.25)
        wall = time.monotonic() - t0
        cpu1 = cpu_snapshot(cp, "this benchmark")
        kube.close()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
    return Result(via, gated, pods, bound, wall, created, cpu, len({leaf_of[n] for n in bound.values()}))


def _cpu_of(r: Result, *prefixes: str) -> float:
    return sum(v for k, v in r.cpu.items() if k.startswith(prefixes))


def _cpu_cell(prefixes: tuple[str, ...]) -> Callable[[Result], str]:
    def cell(r: Result) -> str:
        used = _cpu_of(r, *prefixes)
        return f"{used:.1f} s ({1000 * used / max(1, len(r.bound)):.1f} ms/member)"

    return cell


def report(args: argparse.Namespace, results: list[Result]) -> None:
    per_leaf = math.ceil(args.nodes / args.leaves)
    print()
    print(f"gang_scale: one gang of pods x {GPUS} GPUs on {args.nodes} nodes in {args.leaves} leaves")
    made = {
        "jobset": f"JobSet controller (Jobs of {args.per_job})",
        "controller": "Job controller (Indexed Job)",
        "pods": "created at once, gputopo",
        "plain": "created at once, kube-scheduler alone",
    }

    def row(label: str, cell: Callable[[Result], str]) -> None:
        print(f"  {label:<24}" + "".join(f"{cell(r):<38}" for r in results))

    row("pods made by", lambda r: made[r.via] + (", gated" if r.gated else ""))
    row("members", lambda r: str(r.pods))
    row("bound", lambda r: f"{len(r.bound)}/{r.pods}")
    row("creation to last bind", lambda r: f"{r.wall:.1f} s")
    row("last member made", lambda r: f"{r.created:.1f} s")
    row("leaves spanned", lambda r: f"{r.leaves} (fewest possible {math.ceil(r.pods / per_leaf)})")
    row("nodes used", lambda r: str(len(set(r.bound.values()))))
    for label, prefixes in (
        ("extender CPU", ("gputopo-extender",)),
        ("kube-scheduler CPU", ("kube-scheduler", "gputopo-scheduler", PLAIN_PROFILE)),
        ("controller-manager CPU", ("kube-controller-manager",)),
        ("JobSet controller CPU", ("jobset",)),
        ("kube-apiserver CPU", ("kube-apiserver",)),
    ):
        row(label, _cpu_cell(prefixes))
    row("all components' CPU", lambda r: f"{sum(v for k, v in r.cpu.items() if k != 'this benchmark'):.1f} s")
    print(f"  (target: the last bind within {TARGET_S:.0f} s for 1,024 members; the fewest leaves; the extender's")
    print("   CPU per member flat from 1,024 to 4,096 members)")


def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.deadline)
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh", file=sys.stderr)
        return 2
    vias = [v.strip() for v in args.via.split(",")]
    has_kcm = (bin_dir / "kube-controller-manager").is_file()
    vias = [("controller" if has_kcm else "pods") if v == "auto" else v for v in vias]
    for via in vias:
        if via not in ("controller", "pods", "jobset", "plain"):
            print(f"--via {via}: must be auto, controller, pods, jobset or plain", file=sys.stderr)
            return 2
        if via in ("controller", "jobset") and not has_kcm:
            print(f"--via {via}: no kube-controller-manager in {bin_dir}", file=sys.stderr)
            return 2
        if via == "jobset":
            missing = controllers_missing(find_controllers_dir(), ["jobset"])
            if missing is not None:
                print(f"--via jobset: {missing}", file=sys.stderr)
                return 2
    gates = [g.strip() for g in args.gate.split(",")]
    if any(g not in ("off", "on") for g in gates):
        print(f"--gate {args.gate}: off, on, or both (off,on)", file=sys.stderr)
        return 2
    results = [
        run_one(args, bin_dir, via, pods, deadline, gate == "on")
        for pods in args.pods
        for gate in gates
        for via in vias
        if not (gate == "on" and via == "plain")  # kube-scheduler alone has no webhook to gate with
    ]
    report(args, results)
    return 0 if all(len(r.bound) == r.pods for r in results) else 1


def _sizes(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of members, or several joined by commas") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One big Indexed Job through the real kube-scheduler and gputopo.")
    p.add_argument(
        "--pods", type=_sizes, default=[1024], help="the gang's members, or several side by side: 1024,4096 (1024)"
    )
    p.add_argument("--nodes", type=int, default=5000, help="simulated 8-GPU nodes (5000)")
    p.add_argument("--leaves", type=int, default=40, help="leaves the nodes are spread over in order (40)")
    p.add_argument("--leaves-per-spine", type=int, default=8, help="leaves under one spine (8)")
    p.add_argument(
        "--via",
        default="auto",
        help="who makes the pods: controller, pods, jobset, or several side by side (jobset,pods); auto = controller",
    )
    p.add_argument(
        "--gate", default="off", help="the members get gputopo's scheduling gate: off, on, or both (off,on) (off)"
    )
    p.add_argument("--per-job", type=int, default=8, help="pods per Job of the JobSet (--via jobset; 8)")
    p.add_argument("--workers", type=int, default=32, help="parallel API clients for creates (32)")
    p.add_argument("--qps", type=float, default=200.0, help="kube-scheduler's client QPS (200)")
    p.add_argument("--burst", type=int, default=400, help="kube-scheduler's client burst (400)")
    p.add_argument(
        "--controller-qps",
        type=float,
        default=0.0,
        help="kube-controller-manager's client QPS (burst twice it); 0: its default, 20 (the Job controller writes "
        "a pod and an Event per member through it)",
    )
    p.add_argument("--deadline", type=float, default=600.0, help="global time budget in seconds (600)")
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs)")
    args = p.parse_args(argv)
    if args.per_job < 1 or any(n % args.per_job for n in args.pods):
        p.error("--per-job must be positive and divide --pods")
    if min(*args.pods, args.nodes, args.leaves, args.leaves_per_spine) < 1 or max(args.pods) > args.nodes:
        p.error("--pods, --nodes, --leaves must be positive and --pods at most --nodes (a pod takes a node)")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"gang_scale: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
