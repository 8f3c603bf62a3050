"""A big gang through the real kube-scheduler: one Indexed Job of 1,024 pods x 8 GPUs on 5,000 simulated
nodes in 40 leaves, no gputopo annotation on the pods (the group comes from the Job's labels and its
`spec.completions`, docs/annotations.md "Jobs").

Starts etcd, kube-apiserver, kube-scheduler with the chart's profile and the real gputopo-extender
(`localcluster`), creates the nodes (Node objects with the agent's annotations and a Lease each;
no agent processes), then the Job. Its pods come from one of two places (`--via`):

  controller  kube-controller-manager's Job controller creates them (the default when the binary is built)
  pods        this script creates exactly what the Job controller would (labels, completion index
              annotation, owner reference), all at once: the extender's and kube-scheduler's part alone
  jobset      a JobSet of Jobs of --per-job pods through the real JobSet controller (its webhooks on),
              then the Job controller; needs gputopo/localcluster/build_controllers.sh

It prints the seconds from the Job's creation to the last bind, the CPU seconds of every process
(extender and kube-scheduler apart) and per member, and the leaves the bound pods span against the
fewest that can hold them. Targets (30 s to the last bind on this machine; the fewest leaves) are
printed next to the figures, never asserted. Everything listens on 127.0.0.1; a global deadline
bounds the run; teardown stops only the processes this script started.

    .venv/bin/python bench/gang_scale.py                        # 1,024 pods, 5,000 nodes, 40 leaves
    .venv/bin/python bench/gang_scale.py --pods 256 --nodes 1000 --leaves 8 --via pods
    .venv/bin/python bench/gang_scale.py --via jobset,pods      # the real JobSet controller, then the
                                                                # same pods created at once, side by side
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
    ControlPlane,
    ControlPlaneError,
    KubeApiError,
    KubeClient,
    SimNode,
    find_binaries,
    network_labels,
    pod_manifest,
)
from gputopo.localcluster.controllers import JobControllers, controllers_missing, find_controllers_dir
from gputopo.localcluster.procstats import cpu_snapshot
from gputopo.localcluster.stack import Stack
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


def job_manifest(pods: int) -> dict[str, Any]:
    template = pod_manifest("x", namespace=NAMESPACE, scheduler_name=GPUTOPO_PROFILE, gpus=GPUS)
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


def member_manifest(job: dict[str, Any], index: int) -> dict[str, Any]:
    """Pod `index` as the Job controller makes it (pkg/controller/job: `<job>-<index>-<random>` names,
    the job-name, controller-uid and completion-index labels, the index annotation, a controller
    owner reference)."""
    meta = job["metadata"]
    uid = meta["uid"]
    pod = pod_manifest(
        f"{JOB}-{index}-{uuid.uuid4().hex[:5]}",
        namespace=NAMESPACE,
        scheduler_name=GPUTOPO_PROFILE,
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


def bound_pods(kube: KubeClient) -> dict[str, str]:
    return {
        p["metadata"]["name"]: str(p["spec"]["nodeName"])
        for p in kube.list_pods(NAMESPACE, label_selector="app=gang-scale")
        if (p.get("spec") or {}).get("nodeName")
    }


@dataclass
class Result:
    via: str
    bound: dict[str, str]
    wall: float
    cpu: dict[str, float]
    leaves: int


def jobset_manifest(pods: int, per_job: int) -> dict[str, Any]:
    """A JobSet of `pods // per_job` Jobs of `per_job` pods, as a user writes it: no gputopo annotation,
    JobSet's defaults (Indexed Jobs) added by its own webhook."""
    template = pod_manifest("x", namespace=NAMESPACE, scheduler_name=GPUTOPO_PROFILE, gpus=GPUS)
    spec = template["spec"]
    spec["restartPolicy"] = "Never"
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JOB, "namespace": NAMESPACE},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": pods // per_job,
                    "template": {
                        "spec": {
                            "completions": per_job,
                            "parallelism": per_job,
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": {"app": "gang-scale"}}, "spec": spec},
                        }
                    },
                }
            ]
        },
    }


def _submit(kube: KubeClient, args: argparse.Namespace, via: str) -> None:
    if via == "jobset":
        kube.request(
            "POST",
            f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NAMESPACE}/jobsets",
            jobset_manifest(args.pods, args.per_job),
        )
        return
    job = kube.request("POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", job_manifest(args.pods))
    if via == "pods":
        kube.create_pods([member_manifest(job, i) for i in range(args.pods)], workers=args.workers)


def run_one(args: argparse.Namespace, bin_dir: Path, via: str, deadline: Deadline) -> Result:
    with ControlPlane(bin_dir, keep=args.keep) as cp:
        say(f"[{via}] control plane up in {cp.dir}")
        kube = KubeClient(cp.kubeconfig, kubectl=cp.kubectl, pool_size=max(32, args.workers))
        stack = Stack(cp, kube, stale_after_seconds=3600.0)
        stack.install()  # the chart's namespace, RBAC and policies
        t = time.monotonic()
        nodes = sim_nodes(args.nodes, args.leaves, args.leaves_per_spine)
        leaf_of = {n.name: n.labels["gputopo.io/network-leaf"] for n in nodes}
        kube.create_nodes(nodes, workers=args.workers)
        create_leases(kube, stack.namespace, [n.name for n in nodes], args.workers)
        say(f"[{via}] {args.nodes} nodes and Leases in {time.monotonic() - t:.1f}s")
        stack.start_extender()
        wait_scheduler_ready(cp, stack.start_scheduler(client_qps=args.qps, client_burst=args.burst), deadline)
        if via in ("controller", "jobset"):
            cp.start_controller_manager()
        if via == "jobset":
            directory = find_controllers_dir()
            assert directory is not None  # checked before any run
            JobControllers(cp, kube, directory).ensure("jobset")
        kube.create_namespace(NAMESPACE)
        # Settle: every component idle before the clock starts.
        time.sleep(2.0)
        cpu0 = cpu_snapshot(cp, "this benchmark")
        t0 = time.monotonic()
        _submit(kube, args, via)
        say(f"[{via}] {JOB} created ({args.pods} pods)")
        bound: dict[str, str] = {}
        last_report = t0
        while not deadline.expired():
            bound = bound_pods(kube)
            if len(bound) >= args.pods:
                break
            if time.monotonic() - last_report >= 5:
                say(f"[{via}] {len(bound)}/{args.pods} bound after {time.monotonic() - t0:.1f}s")
                last_report = time.monotonic()
            time.sleep(0.25)
        wall = time.monotonic() - t0
        cpu1 = cpu_snapshot(cp, "this benchmark")
        kube.close()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
    return Result(via, bound, wall, cpu, len({leaf_of[n] for n in bound.values()}))


def _cpu_of(r: Result, *prefixes: str) -> float:
    return sum(v for k, v in r.cpu.items() if k.startswith(prefixes))


def _cpu_cell(prefixes: tuple[str, ...]) -> Callable[[Result], str]:
    def cell(r: Result) -> str:
        used = _cpu_of(r, *prefixes)
        return f"{used:.1f} s ({1000 * used / max(1, len(r.bound)):.1f} ms/member)"

    return cell


def report(args: argparse.Namespace, results: list[Result]) -> None:
    per_leaf = math.ceil(args.nodes / args.leaves)
    fewest = math.ceil(args.pods / per_leaf)
    print()
    print(f"gang_scale: a gang of {args.pods} pods x {GPUS} GPUs on {args.nodes} nodes in {args.leaves} leaves")
    made = {
        "jobset": f"JobSet controller ({args.pods // args.per_job} Jobs x {args.per_job})",
        "controller": "Job controller (one Indexed Job)",
        "pods": "created at once (one Indexed Job's pods)",
    }

    def row(label: str, cell: Callable[[Result], str]) -> None:
        print(f"  {label:<24}" + "".join(f"{cell(r):<42}" for r in results))

    row("pods made by", lambda r: made[r.via])
    row("bound", lambda r: f"{len(r.bound)}/{args.pods}")
    row(
        "creation to last bind",
        lambda r: f"{r.wall:.1f} s (target {TARGET_S:.0f} s: {'met' if r.wall <= TARGET_S else 'not met'})",
    )
    row("leaves spanned", lambda r: f"{r.leaves} (fewest possible {fewest})")
    row("nodes used", lambda r: str(len(set(r.bound.values()))))
    for label, prefixes in (
        ("extender CPU", ("gputopo-extender",)),
        ("kube-scheduler CPU", ("kube-scheduler", "gputopo-scheduler")),
        ("controller-manager CPU", ("kube-controller-manager",)),
        ("JobSet controller CPU", ("jobset",)),
        ("kube-apiserver CPU", ("kube-apiserver",)),
    ):
        row(label, _cpu_cell(prefixes))
    row("all components' CPU", lambda r: f"{sum(v for k, v in r.cpu.items() if k != 'this benchmark'):.1f} s")
    if len(results) == 2 and results[1].wall > 0:
        a, b = results
        print(
            f"  ratio {a.via}/{b.via}: time to last bind {a.wall / b.wall:.2f}x, "
            f"extender CPU {_cpu_of(a, 'gputopo-extender') / max(1e-9, _cpu_of(b, 'gputopo-extender')):.2f}x"
        )


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
        if via not in ("controller", "pods", "jobset"):
            print(f"--via {via}: must be auto, controller, pods or jobset", file=sys.stderr)
            return 2
        if via in ("controller", "jobset") and not has_kcm:
            print(f"--via {via}: no kube-controller-manager in {bin_dir}", file=sys.stderr)
            return 2
        if via == "jobset":
            missing = controllers_missing(find_controllers_dir(), ["jobset"])
            if missing is not None:
                print(f"--via jobset: {missing}", file=sys.stderr)
                return 2
    results = [run_one(args, bin_dir, via, deadline) for via in vias]
    report(args, results)
    return 0 if all(len(r.bound) == args.pods for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One big Indexed Job through the real kube-scheduler and gputopo.")
    p.add_argument("--pods", type=int, default=1024, help="the Job's completions = parallelism (1024)")
    p.add_argument("--nodes", type=int, default=5000, help="simulated 8-GPU nodes (5000)")
    p.add_argument("--leaves", type=int, default=40, help="leaves the nodes are spread over in order (40)")
    p.add_argument("--leaves-per-spine", type=int, default=8, help="leaves under one spine (8)")
    p.add_argument(
        "--via",
        default="auto",
        help="who makes the pods: controller, pods, jobset, or several side by side (jobset,pods); auto = controller",
    )
    p.add_argument("--per-job", type=int, default=8, help="pods per Job of the JobSet (--via jobset; 8)")
    p.add_argument("--workers", type=int, default=32, help="parallel API clients for creates (32)")
    p.add_argument("--qps", type=float, default=200.0, help="kube-scheduler's client QPS (200)")
    p.add_argument("--burst", type=int, default=400, help="kube-scheduler's client burst (400)")
    p.add_argument("--deadline", type=float, default=600.0, help="global time budget in seconds (600)")
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs)")
    args = p.parse_args(argv)
    if args.per_job < 1 or args.pods % args.per_job:
        p.error("--per-job must be positive and divide --pods")
    if min(args.pods, args.nodes, args.leaves, args.leaves_per_spine) < 1 or args.pods > args.nodes:
        p.error("--pods, --nodes, --leaves must be positive and --pods at most --nodes (a pod takes a node)")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"gang_scale: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
