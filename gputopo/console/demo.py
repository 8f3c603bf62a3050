"""`gputopo demo`: the whole system on this machine. Builds (or reuses) the pinned upstream binaries,
starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler, runs the real extender and
one real agent per simulated GPU node from `examples/cluster.yaml` (one of them reading NVML through
nvidia-ml-py from the NVML mock library built here, and saying so), submits `examples/jobs.yaml` as
pods, and prints where each pod went and what `kubectl describe pod` says about it. Then a JobSet with
no gputopo annotation goes through the real JobSet controller (built once, like the binaries) and
the demo prints where its driver and workers went, rank by rank. Then two small NVL72-style racks of
GB200 trays join, and a TP-16 group of 4 pods lands in one NVLink domain, its sentence naming the TP
group, the domain and the predicted TP all-reduce. As root, with
the kubelet built, it adds one node run by a real kubelet, so the whole path shows: placement, the
kubelet's device manager asking the agent's device plugin, PodResources, and the agent's per-pod
report. With --installed (root, with containerd and runc) it then installs the packaged chart with
helm onto a node that runs containers, from images built here, runs a TP-4 pod there, and
uninstalls it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from gputopo.clusterfile import ClusterFileError, load_cluster, load_jobs
from gputopo.console.demojobset import jobset_part
from gputopo.console.demorack import rack_part
from gputopo.engine.cluster.explain import gpu_ranges
from gputopo.model import LABEL_NETWORK_LEAF, PLACEMENT_ANNOTATION, SCHEDULER_NAME, AnnotationError, parse_placement

STALE_AFTER = 10.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="run gputopo on a local control plane with simulated GPU nodes",
        description=__doc__,
    )
    p.add_argument("--cluster", type=Path, default=Path("examples/cluster.yaml"), help="cluster file (nodes)")
    p.add_argument("--jobs", type=Path, default=Path("examples/jobs.yaml"), help="jobs file (pods to submit)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running and print its KUBECONFIG")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the scheduler to decide")
    p.add_argument(
        "--installed",
        action="store_true",
        help="then helm install the chart onto a containerd node from images built here (root; the first "
        "image build takes minutes)",
    )
    return p


def _say(msg: str) -> None:
    print(msg, flush=True)


def _events_section(describe: str) -> list[str]:
    lines = describe.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Events:"):
            return [ln for ln in lines[i + 1 :] if ln.strip() and not ln.lstrip().startswith("----")]
    return []


def run(args: argparse.Namespace) -> int:
    # Imported here: the simulator and other commands must not pay for the control-plane modules.
    from gputopo.localcluster import ControlPlane, Lifetime, ensure_binaries
    from gputopo.localcluster.stack import Stack, StackTiming

    try:
        cluster = load_cluster(args.cluster)
        jobs = load_jobs(args.jobs)
    except ClusterFileError as e:
        print(f"gputopo demo: {e}", file=sys.stderr)
        return 2

    _say("== upstream binaries (built once per machine from the Go module proxy, then reused)")
    bin_dir = ensure_binaries(lambda line: _say(f"   {line}"))
    _say(f"   {bin_dir}")

    cp = ControlPlane(
        bin_dir, progress=lambda m: _say(f"   {m}"), lifetime=Lifetime(keep=args.keep, die_with_parent=not args.keep)
    )
    _say("== control plane: etcd, kube-apiserver (RBAC, TLS, service-account keys), kube-controller-manager")
    cp.start()
    try:
        cp.start_controller_manager()
        kube = cp.client()
        stack = Stack(cp, kube, timing=StackTiming(stale_after_seconds=STALE_AFTER), progress=lambda m: _say(f"   {m}"))
        stack.install()
        _say("== gputopo: extender and a kube-scheduler whose gputopo-scheduler profile calls it")
        stack.start_extender()
        stack.start_scheduler()
        _say(f"== {len(cluster.nodes)} simulated GPU nodes from {args.cluster}, each with its own gputopo-agent")
        _add_nodes(stack, cluster)
        ns = "demo"
        kube.create_namespace(ns)
        _say(f"== submitting {args.jobs}")
        pods = _submit(kube, ns, jobs, args.timeout)
        _say("== where each pod went, and why (from kubectl describe pod)")
        placed = sum(_report_pod(kube, ns, name) for name in pods)
        _say(f"\n{placed}/{len(pods)} pods placed.")
        # The JobSet needs whole nodes: the jobs file's pods give theirs back first.
        for name in pods:
            kube.delete_pod(ns, name)
        jobset_part(cp, kube, ns, args.timeout, _say, _report_pod)
        rack_part(stack, kube, ns, args.timeout, _say, _report_pod)
        _real_kubelet_part(stack, kube, bin_dir, ns, args.timeout)
        if args.keep:
            cp.detach()
            _say("\nThe cluster keeps running. Try:")
            _say(f"  export KUBECONFIG={cp.kubeconfig}")
            _say(f"  {cp.kubectl} describe pod -n {ns} {pods[0]}")
            _say(f"  .venv/bin/gputopo topo {cluster.nodes[0].name}")
            _say(f"  .venv/bin/gputopo explain -n {ns} {pods[-1]}")
            _say(f"Stop it with: kill {' '.join(str(p) for p in cp.owned_pids())}")
    finally:
        if not args.keep:
            _say("== tearing down (only the processes this demo started)")
            cp.teardown()
    if args.installed:
        # After the teardown: the installed part needs a control plane with ServiceAccount
        # admission and its own gputopo-scheduler (the chart's), and the one containerd node.
        _installed_part(bin_dir, args.timeout)
    return 0


def _nvml_node(cluster: Any) -> tuple[str | None, str]:
    """The node whose agent reads NVML through nvidia-ml-py from the NVML mock library, and what to say:
    the first fixture node without InfiniBand (the library gives GPUs, not the NICs sysfs would)."""
    from gputopo.localcluster.nvmlmock import LibraryBuildError, build_library
    from gputopo.localcluster.nvmlmock.profile import SYSTEM_WIRING
    from gputopo.model import LinkLayer
    from gputopo.systems import build_system

    for n in cluster.nodes:
        if n.topology is not None or n.stale or n.fixture not in SYSTEM_WIRING:
            continue
        if any(nic.link_layer is LinkLayer.INFINIBAND for nic in build_system(n.fixture, n.name).nics):
            continue
        try:
            lib = build_library()
        except LibraryBuildError as e:
            return None, f"   every agent on a fixture: the NVML mock library could not be built ({e})"
        return n.name, (
            f"   {n.name}: its agent reads NVML through nvidia-ml-py (--backend nvml, no fixture) from the NVML "
            f"mock library built here ({lib}/libnvidia-ml.so.1), answering as {n.fixture}; it publishes no NICs "
            "(those come from sysfs)"
        )
    return None, "   every agent on a fixture: no fixture node without InfiniBand for the NVML mock library"


def _add_nodes(stack: Any, cluster: Any) -> None:
    """One agent per simulated node, published; the agents of nodes the file marks stale stopped. One
    node's agent reads the NVML mock library through the real binding instead of a fixture."""
    from gputopo.localcluster.stack import GpuNode

    nvml, said = _nvml_node(cluster)
    stack.add_nodes(
        [GpuNode(n.name, n.fixture, n.topology, n.labels, n.gpus_in_use, nvml=n.name == nvml) for n in cluster.nodes]
    )
    stack.wait_published()
    _say(said)
    stale = [n.name for n in cluster.nodes if n.stale]
    for name in stale:
        stack.stop_agent(name)
    if stale:
        _say(f"   stopped the agent of {', '.join(stale)}; its topology goes stale after {STALE_AFTER:.0f}s")
        time.sleep(STALE_AFTER + 1)
    for n in cluster.nodes:
        _say(f"   {n.name:<16} {n.fixture or 'inline topology':<18} {n.labels.get(LABEL_NETWORK_LEAF, '-')}")


def _submit(kube: Any, ns: str, jobs: Any, timeout: float) -> list[str]:
    """Create the jobs file's pods, one job at a time, as the simulator places them, so the outcome
    reads in file order; the pods' names."""
    from gputopo.localcluster import PodScheduling, pod_manifest

    pods: list[str] = []
    for job in jobs.jobs:
        for i in range(job.pods):
            name = f"{job.name}-{i}"
            kube.create_pod(
                pod_manifest(
                    name,
                    namespace=ns,
                    gpus=job.gpus_per_pod,
                    annotations=job.pod_annotations(i),
                    scheduling=PodScheduling(scheduler_name=SCHEDULER_NAME),
                )
            )
            pods.append(name)
        _wait_decided(kube, ns, pods[-job.pods :], timeout)
    return pods


def _report_pod(kube: Any, ns: str, name: str) -> bool:
    """Print where the pod went (its GPUs) and its scheduling events; whether it was placed."""
    pod = kube.get_pod(ns, name)
    node = pod["spec"].get("nodeName")
    events = _events_section(kube.describe_pod(ns, name))
    if node:
        gpus = ""
        ann = pod["metadata"].get("annotations", {}).get(PLACEMENT_ANNOTATION)
        if ann:
            try:
                held = parse_placement(ann).gpus
                gpus = f" GPUs {gpu_ranges(held)}" if held else " (no GPUs)"
            except AnnotationError:
                gpus = ""
        _say(f"\n+ {name} -> {node}{gpus}")
    else:
        _say(f"\n- {name}: pending")
    shown: set[str] = set()
    for line in events:
        text = " ".join(line.split())
        if text not in shown and any(r in line for r in ("TopologyPlacement", "FailedScheduling", "Scheduled")):
            shown.add(text)  # a retried pod repeats its FailedScheduling event
            _say("    " + text)
    return bool(node)


KUBELET_NODE = "kubelet-dgx1v"
# Keeps the jobs file's unplaced pods, which the scheduler retries, off the real-kubelet node.
KUBELET_TAINT = {"key": "gputopo.io/real-kubelet", "value": "demo", "effect": "NoSchedule"}


def _real_kubelet_part(stack: Any, kube: Any, bin_dir: Path, ns: str, timeout: float) -> None:
    """One DGX-1V node run by a real kubelet; a TP-4 and a TP-2 pod go there, and what the kubelet
    allocated is read back from its PodResources socket."""
    from gputopo.agent.podresources.client import PodResourcesClient
    from gputopo.localcluster import PodScheduling, pod_manifest
    from gputopo.localcluster.kubelet import kubelet_unavailable
    from gputopo.model import GPUS_IN_USE_ANNOTATION, parse_gpus_in_use_report
    from gputopo.systems import build_system

    reason = kubelet_unavailable(bin_dir)
    if reason is not None:
        _say(f"\n(no real-kubelet node: {reason})")
        return
    _say(f"\n== a node run by a real kubelet ({KUBELET_NODE}, DGX-1V), its gputopo-agent as the device plugin")
    taint = f"{KUBELET_TAINT['key']}={KUBELET_TAINT['value']}:{KUBELET_TAINT['effect']}"
    kubelet = stack.add_kubelet_node(KUBELET_NODE, "dgx-1v", taints=[taint])
    stack.wait_published([KUBELET_NODE])
    pods = []
    for name, gpus in (("kubelet-tp4", 4), ("kubelet-tp2", 2)):
        manifest = pod_manifest(
            name,
            namespace=ns,
            gpus=gpus,
            annotations={"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(
                scheduler_name=SCHEDULER_NAME,
                node_selector={"kubernetes.io/hostname": KUBELET_NODE},
                tolerations=[{**KUBELET_TAINT, "operator": "Equal"}],
            ),
        )
        kube.create_pod(manifest)
        pods.append(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        phases = [kube.get_pod(ns, n).get("status", {}).get("phase") for n in pods]
        if all(ph in ("Running", "Failed") for ph in phases):
            break
        time.sleep(0.3)
    index = {g.uuid: g.index for g in build_system("dgx-1v", KUBELET_NODE).gpus}
    client = PodResourcesClient(kubelet.podresources_socket)
    try:
        held = {
            name: sorted(index.get(d, -1) for d in ids) for (_, name), ids in client.gpu_allocation().by_pod.items()
        }
    finally:
        client.close()
    names = {}
    for name in pods:
        pod = kube.get_pod(ns, name)
        names[pod["metadata"]["uid"]] = name
        ann = pod["metadata"].get("annotations", {}).get(PLACEMENT_ANNOTATION)
        placed = gpu_ranges(parse_placement(ann).gpus) if ann else "-"
        got = gpu_ranges(held[name]) if name in held else "nothing"
        _say(f"+ {name}: placement GPUs {placed}; the kubelet allocated {got} ({pod['status'].get('phase')})")
    # The agent reports what PodResources says once per discovery interval (1 s here).
    deadline = time.monotonic() + 15
    while True:
        text = kube.get_node(KUBELET_NODE)["metadata"].get("annotations", {}).get(GPUS_IN_USE_ANNOTATION, "[]")
        try:
            report = parse_gpus_in_use_report(text)
        except AnnotationError:
            _say(f"   the agent's {GPUS_IN_USE_ANNOTATION}: {text}")
            return
        if set(names) <= set(report.pods) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    per_pod = [f"{names.get(uid, uid)} {gpu_ranges(sorted(g))}" for uid, g in sorted(report.pods.items())]
    _say(f"   the agent's {GPUS_IN_USE_ANNOTATION} (per pod UID, named here): {'; '.join(per_pod) or 'none'}")


def _wait_decided(kube: Any, ns: str, names: list[str], timeout: float) -> None:
    """Until each pod is bound or the scheduler has said why it cannot be."""
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            bound = kube.get_pod(ns, name)["spec"].get("nodeName")
            if bound or any(e.reason == "FailedScheduling" for e in kube.pod_events(ns, name)):
                pending.discard(name)
        if pending:
            time.sleep(0.3)


def _installed_part(bin_dir: Path, timeout: float) -> None:
    """The chart as users install it: helm install onto a containerd node, a TP-4 pod, helm uninstall."""
    from gputopo.localcluster import Lifetime
    from gputopo.localcluster.containerd import containerd_unavailable
    from gputopo.localcluster.installed import InstalledError, eventually, install, start_control_plane

    reason = containerd_unavailable(bin_dir)
    if reason is not None:
        _say(f"\n(no installed part: {reason})")
        return
    t0 = time.monotonic()
    _say("\n== installed as users install it: images built here, a containerd node, helm install of the chart")
    cp = start_control_plane(bin_dir, progress=lambda m: _say(f"   {m}"), lifetime=Lifetime(die_with_parent=True))
    try:
        with install(cp, lambda m: _say(f"   {m}")) as inst:
            tp4 = inst.run_tp4(inst.workload_namespace())
            uuid = inst.uuid_of()
            index = {u: i for i, u in uuid.items()}
            seen = gpu_ranges(sorted(index.get(u, -1) for u in tp4.visible))
            _say(f"+ {tp4.name} -> {tp4.node} GPUs {gpu_ranges(tp4.placement)}")
            _say(f"    its container printed NVIDIA_VISIBLE_DEVICES={','.join(tp4.visible)} (GPUs {seen})")
            for line in _events_section(inst.kube.describe_pod(tp4.namespace, tp4.name)):
                if "TopologyPlacement" in line:
                    _say("    " + " ".join(line.split()))
            inst.kube.delete_pod(tp4.namespace, tp4.name)
            _say(f"== helm uninstall {inst.release}")
            inst.uninstall()
            left: set[str] = set()

            def gone() -> bool:
                nonlocal left
                left = inst.leftovers()
                return not left

            try:
                eventually(gone, "the release's objects to go", timeout=timeout)
                _say("   nothing of the release is left (pods, RBAC, admission policies, webhooks, Leases, Secrets)")
            except InstalledError:
                _say(f"   left after uninstall: {', '.join(sorted(left))}")
    finally:
        cp.teardown()
    _say(f"   the installed part took {time.monotonic() - t0:.0f}s")
