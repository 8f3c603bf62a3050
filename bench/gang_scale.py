"""A big gang through the real kube-scheduler: one Indexed Job of 1,024 pods x 8 GPUs on 5,000 simulated
nodes in 40 leaves, no gputopo annotation on the pods (the group comes from the Job's labels and its
`spec.completions`, docs/annotations.md "Jobs").

Starts etcd, kube-apiserver, kube-scheduler with the chart's profile and the real gputopo-extender
(`localcluster`), creates the nodes (Node objects with the agent's annotations and a Lease each;
no agent processes), then the Job. Its pods come from one of two places (`--via`):

  controller  kube-controller-manager's Job controller creates them (the default when the binary is built)
  pods        this script creates exactly what the Job controller would (labels, completion index
              annotation, owner reference), all at once: the extender's and kube-scheduler's part alone

It prints the seconds from the Job's creation to the last bind, the CPU seconds of every process
(extender and kube-scheduler apart) and per member, and the leaves the bound pods span against the
fewest that can hold them. Targets (30 s to the last bind on this machine; the fewest leaves) are
printed next to the figures, never asserted. Everything listens on 127.0.0.1; a global deadline
bounds the run; teardown stops only the processes this script started.

    .venv/bin/python bench/gang_scale.py                        # 1,024 pods, 5,000 nodes, 40 leaves
    .venv/bin/python bench/gang_scale.py --pods 256 --nodes 1000 --leaves 8 --via pods
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import uuid
from collections.abc import Sequence
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


def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.deadline)
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh", file=sys.stderr)
        return 2
    via = args.via
    has_kcm = (bin_dir / "kube-controller-manager").is_file()
    if via == "auto":
        via = "controller" if has_kcm else "pods"
    if via == "controller" and not has_kcm:
        print(f"--via controller: no kube-controller-manager in {bin_dir}", file=sys.stderr)
        return 2
    leaves_used: set[str] = set()
    with ControlPlane(bin_dir, keep=args.keep) as cp:
        say(f"control plane up in {cp.dir}")
        kube = KubeClient(cp.kubeconfig, kubectl=cp.kubectl, pool_size=max(32, args.workers))
        stack = Stack(cp, kube, stale_after_seconds=3600.0)
        stack.install()  # the chart's namespace, RBAC and policies
        t = time.monotonic()
        nodes = sim_nodes(args.nodes, args.leaves, args.leaves_per_spine)
        leaf_of = {n.name: n.labels["gputopo.io/network-leaf"] for n in nodes}
        kube.create_nodes(nodes, workers=args.workers)
        create_leases(kube, stack.namespace, [n.name for n in nodes], args.workers)
        say(f"{args.nodes} nodes and Leases in {time.monotonic() - t:.1f}s")
        stack.start_extender()
        wait_scheduler_ready(cp, stack.start_scheduler(client_qps=args.qps, client_burst=args.burst), deadline)
        if via == "controller":
            cp.start_controller_manager()
        kube.create_namespace(NAMESPACE)
        # Settle: every component idle before the clock starts.
        time.sleep(2.0)
        cpu0 = cpu_snapshot(cp, "this benchmark")
        t0 = time.monotonic()
        job = kube.request("POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", job_manifest(args.pods))
        if via == "pods":
            kube.create_pods([member_manifest(job, i) for i in range(args.pods)], workers=args.workers)
        say(f"Job {JOB} created ({args.pods} pods via {via})")
        bound: dict[str, str] = {}
        last_report = t0
        while not deadline.expired():
            bound = bound_pods(kube)
            if len(bound) >= args.pods:
                break
            if time.monotonic() - last_report >= 5:
                say(f"{len(bound)}/{args.pods} bound after {time.monotonic() - t0:.1f}s")
                last_report = time.monotonic()
            time.sleep(0.25)
        wall = time.monotonic() - t0
        cpu1 = cpu_snapshot(cp, "this benchmark")
        kube.close()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
    leaves_used = {leaf_of[n] for n in bound.values()}
    per_leaf = math.ceil(args.nodes / args.leaves)
    fewest = math.ceil(args.pods / per_leaf)
    ext = sum(v for k, v in cpu.items() if "extender" in k)
    sched = sum(v for k, v in cpu.items() if k.startswith("kube-scheduler") or k.startswith("gputopo-scheduler"))
    total = sum(v for k, v in cpu.items() if k != "this benchmark")
    n = max(1, len(bound))
    print()
    print(
        f"gang_scale: one Indexed Job of {args.pods} pods x {GPUS} GPUs on {args.nodes} nodes in {args.leaves} leaves"
    )
    print(f"  pods made by            {via}")
    print(f"  bound                   {len(bound)}/{args.pods}")
    met = "met" if wall <= TARGET_S else "not met"
    print(f"  creation to last bind   {wall:.1f} s   (target {TARGET_S:.0f} s: {met})")
    print(f"  leaves spanned          {len(leaves_used)}   (fewest possible {fewest})")
    print(f"  nodes used              {len(set(bound.values()))}")
    print("  CPU seconds             " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items())))
    print(f"  extender CPU            {ext:.1f} s   ({1000 * ext / n:.1f} ms per member)")
    print(f"  kube-scheduler CPU      {sched:.1f} s   ({1000 * sched / n:.1f} ms per member)")
    print(f"  all components' CPU     {total:.1f} s   ({1000 * total / n:.1f} ms per member)")
    return 0 if len(bound) == args.pods else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One big Indexed Job through the real kube-scheduler and gputopo.")
    p.add_argument("--pods", type=int, default=1024, help="the Job's completions = parallelism (1024)")
    p.add_argument("--nodes", type=int, default=5000, help="simulated 8-GPU nodes (5000)")
    p.add_argument("--leaves", type=int, default=40, help="leaves the nodes are spread over in order (40)")
    p.add_argument("--leaves-per-spine", type=int, default=8, help="leaves under one spine (8)")
    p.add_argument("--via", choices=["auto", "controller", "pods"], default="auto", help="who makes the pods")
    p.add_argument("--workers", type=int, default=32, help="parallel API clients for creates (32)")
    p.add_argument("--qps", type=float, default=200.0, help="kube-scheduler's client QPS (200)")
    p.add_argument("--burst", type=int, default=400, help="kube-scheduler's client burst (400)")
    p.add_argument("--deadline", type=float, default=600.0, help="global time budget in seconds (600)")
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs)")
    args = p.parse_args(argv)
    if min(args.pods, args.nodes, args.leaves, args.leaves_per_spine) < 1 or args.pods > args.nodes:
        p.error("--pods, --nodes, --leaves must be positive and --pods at most --nodes (a pod takes a node)")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"gang_scale: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
