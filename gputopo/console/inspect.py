"""`gputopo topo NODE` and `gputopo explain POD`: read-only views of a live cluster.

`explain` loads one snapshot of the cluster (nodes, pods, the agents' Leases, Jobs, DRA's slices and
claims) into the extender's own cache and asks the extender's own decision code, so it shows exactly
what the extender would decide for the pod now, without changing anything in the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.engine.cluster.explain import describe_gpus, gpu_ranges, outcome_estimate
from gputopo.engine.state.reasons import Code, summarize_failures
from gputopo.kube import KubeError, find_kubeconfig
from gputopo.model import (
    DEFAULT_NAMESPACE,
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    PREFIX,
    TOPOLOGY_ANNOTATION,
    AnnotationError,
    agent_lease_name,
    parse_gpus_in_use_report,
    parse_placement,
    parse_topology,
)

if TYPE_CHECKING:  # the extender is imported only when a command needs it
    from gputopo.extender.state.mismatch import Mismatch
    from gputopo.extender.state.verdicts import Decision


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", type=Path, default=None, help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument(
        "--gputopo-namespace",
        default=DEFAULT_NAMESPACE,
        help=f"namespace of the agents' Leases (default {DEFAULT_NAMESPACE})",
    )
    p.add_argument("--stale-after-seconds", type=float, default=120.0, help="as the extender is configured (120)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `topo` and `explain`; returns the `explain` parser (the CLI wires both)."""
    topo: argparse.ArgumentParser = subparsers.add_parser(
        "topo",
        help="a node's GPU topology from its annotations, like nvidia-smi topo -m",
        description="Show NODE of the live cluster, or with --system a named system or rack as gputopo builds it.",
    )
    topo.add_argument("node", nargs="?")
    topo.add_argument(
        "--system", metavar="NAME", help="a named system (gb200-tray) or rack (gb200-nvl72) instead of a live node"
    )
    _common(topo)
    topo.set_defaults(_run=run_topo)
    explain: argparse.ArgumentParser = subparsers.add_parser(
        "explain", help="every node's verdict and score for a pod, from the live cluster (read-only)"
    )
    explain.add_argument("pod")
    explain.add_argument("-n", "--namespace", default="default")
    _common(explain)
    return explain


def _source(args: argparse.Namespace) -> Any:
    from gputopo.extender.watch.source import KubeSource  # the extender's client: the same reads the extender makes

    return KubeSource(find_kubeconfig(args.kubeconfig), args.gputopo_namespace)


def _lease_age(source: Any, node: str) -> float | None:
    from gputopo.kube.paths import parse_time

    try:
        lease = source.get_lease(agent_lease_name(node))
    except KubeError:
        return None
    spec = lease.get("spec") or {}
    renewed = parse_time(str(spec.get("renewTime") or spec.get("acquireTime") or ""))
    return None if renewed is None else time.time() - renewed


def run_topo(args: argparse.Namespace) -> int:
    system = getattr(args, "system", None)  # callers that build the namespace may leave it out
    if (args.node is None) == (system is None):
        print("gputopo topo: give either NODE or --system NAME", file=sys.stderr)
        return 2
    if system is not None:
        from gputopo.console.systemview import system_text
        from gputopo.systems import UnknownSystemError

        try:
            sys.stdout.write(system_text(system))
        except UnknownSystemError as e:
            print(f"gputopo topo: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        source = _source(args)
        node = source.get_node(args.node)
    except KubeError as e:
        print(f"gputopo topo: cannot read node {args.node}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # no kubeconfig, unreachable server
        print(f"gputopo topo: cannot reach the cluster: {e}", file=sys.stderr)
        return 1
    from gputopo.extender.state.records import BadObject
    from gputopo.extender.watch.parsers import node_metadata

    try:
        labels, ann = node_metadata(node)
    except BadObject as e:  # the reason the extender gives the node too
        print(f"{args.node}: unreadable node object: {e}", file=sys.stderr)
        return 1
    text = ann.get(TOPOLOGY_ANNOTATION)
    if not text:
        print(f"{args.node}: no {TOPOLOGY_ANNOTATION} annotation (is gputopo-agent running on it?)")
        return 1
    try:
        topology = parse_topology(text)
        report = parse_gpus_in_use_report(ann.get(GPUS_IN_USE_ANNOTATION, "[]"), len(topology.gpus))
    except AnnotationError as e:
        print(f"{args.node}: {e}", file=sys.stderr)
        return 1
    from gputopo.render import render_topology

    print(f"Node {args.node}")
    print(render_topology(topology, report.all))
    ours = {k: v for k, v in sorted(labels.items()) if k.startswith(PREFIX)}
    if ours:
        print("Labels: " + ", ".join(f"{k}={v}" for k, v in ours.items()))
    age = _lease_age(source, args.node)
    if age is None:
        print(
            f"Heartbeat: no Lease {agent_lease_name(args.node)} in {args.gputopo_namespace}: topology counts as stale"
        )
    elif age > args.stale_after_seconds:
        print(f"Heartbeat: {age:.0f}s ago, older than {args.stale_after_seconds:.0f}s: topology is STALE")
    else:
        print(f"Heartbeat: {age:.0f}s ago (fresh)")
    pods = source.list_pods(field_selector=f"spec.nodeName={args.node}")
    placed = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(PLACEMENT_ANNOTATION)
        if raw:
            try:
                gpus = parse_placement(raw).gpus
            except AnnotationError:
                continue
            line = f"{meta.get('namespace')}/{meta.get('name')} GPUs {gpu_ranges(gpus)}"
            actual = report.pods.get(str(meta.get("uid") or ""))
            if actual is not None and actual != frozenset(gpus):
                line += f" (the kubelet gave {gpu_ranges(sorted(actual))})"
            placed.append(line)
    if placed:
        print("Placed by gputopo: " + "; ".join(placed))
    return 0


def run(args: argparse.Namespace) -> int:
    """`gputopo explain POD`."""
    from gputopo.extender.verbs.service import Extender
    from gputopo.extender.watch.cache import ClusterCache
    from gputopo.extender.watch.parsers import resolve_pod
    from gputopo.extender.wire import WireError, pod_info

    try:
        source = _source(args)
        pod = source.get_pod(args.namespace, args.pod)
        cache = ClusterCache(stale_after_seconds=args.stale_after_seconds, lease_namespace=args.gputopo_namespace)
        for kind in ("nodes", "pods", "leases"):
            items, _ = source.list_objects(kind)
            cache.replace(kind, items)
        # Jobs give the sizes of inferred groups (gputopo.model.jobs); without them such a group waits.
        # DRA's slices and claims give the GPUs claims hold (a clique block counts as its GPUs), and the claim
        # templates what a pod's own claim asks; a cluster without resource.k8s.io, or a reader not allowed to
        # list it, has none (a pod naming a template then waits for them).
        for kind in ("jobs", "resourceslices", "resourceclaims", "resourceclaimtemplates"):
            with contextlib.suppress(KubeError):
                cache.replace(kind, source.list_objects(kind)[0])
    except KubeError as e:
        print(f"gputopo explain: cannot read {args.namespace}/{args.pod}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"gputopo explain: cannot reach the cluster: {e}", file=sys.stderr)
        return 1
    try:
        info = pod_info(pod)
    except WireError as e:
        print(f"gputopo explain: {e}", file=sys.stderr)
        return 1
    names = sorted(cache.nodes)
    actual = cache.ledger.reported_gpus(info.node_name, info.uid) if info.node_name else None
    mismatch = cache.ledger.mismatches.get(info.uid)
    # A placed pod would otherwise compete with itself: judge every node as if it were not there.
    cache.forget_pod(pod)
    # prioritize decides as filter does, and gives the scores kube-scheduler would get (before the answer
    # lowers them all by the lowest, which changes no choice).
    _, wire, decision = Extender(cache, None).prioritize(info, names)
    print(f"Pod {info.ref}: {info.gpus} GPU{'s' if info.gpus != 1 else ''}")
    ours = {k: v for k, v in info.annotations.items() if k.startswith(PREFIX) and k != PLACEMENT_ANNOTATION}
    if ours:
        print("Requests: " + ", ".join(f"{k.removeprefix(PREFIX)}={v}" for k, v in sorted(ours.items())))
    inferred = resolve_pod(
        info, cache.ledger.tier_names, cache.facts(info.namespace), scheduler=info.scheduler_name, claims=cache.claims
    )
    if inferred.inferred is not None:
        print(f"Group: {inferred.inferred.words()}" + (f" ({inferred.problem})" if inferred.problem else ""))
    elif inferred.problem and inferred.group:
        print(f"Group: {inferred.group}: {inferred.problem}")
    placed = info.annotations.get(PLACEMENT_ANNOTATION)
    if info.node_name:
        _print_binding(info.node_name, placed, actual, mismatch)
    if decision.kind == "pass_through" and inferred.pinned:
        print(f"{inferred.problem}; kube-scheduler alone decides.")
        return 0
    if decision.kind == "pass_through":
        print("No gputopo.io/ request annotation: gputopo passes this pod through; kube-scheduler alone decides.")
        return 0
    as_if = " as if the pod were not placed" if info.node_name or placed else ""
    print(f"Verdicts now{as_if} ({decision.kind.replace('_', ' ')}), best first:")
    _print_verdicts(decision, wire)
    return 0


def _print_binding(node: str, placed: str | None, actual: frozenset[int] | None, mismatch: Mismatch | None) -> None:
    """Where a bound pod is, on which GPUs, and what the node reports it got."""
    from gputopo.extender.verbs.service import MISMATCH_REASON

    line = f"Bound to {node}"
    if placed:
        try:
            p = parse_placement(placed)
            line += f", GPUs {gpu_ranges(p.gpus)} (score {p.score}): {p.reason}"
        except AnnotationError:
            pass
    print(line)
    if mismatch is not None:
        got, want = gpu_ranges(mismatch.actual), gpu_ranges(mismatch.placed)
        print(f"Actual GPUs {got} (reported by the node), not the placed {want}: {mismatch.shape} ({MISMATCH_REASON})")
    elif actual is not None:
        print(f"Actual GPUs {gpu_ranges(sorted(actual))} (reported by the node)")


def _print_verdicts(decision: Decision, wire: Sequence[int]) -> None:
    """One row per node, best first: verdict, the engine's score, the wire score, GPUs and why."""
    # SCORE is the engine's; WIRE is what prioritize gives kube-scheduler for it (docs/extender.md: the
    # request's ranks, or a group plan's planned node 10 and others 0).
    rows: list[tuple[int, int, float, str, str, str, str, str, str]] = []
    for name, o, w in zip(decision.names, decision.outcomes, wire, strict=True):
        if o.code is Code.SUCCESS:
            why = describe_gpus(name, o) + outcome_estimate(o)  # each node's own all-reduce time, to compare
            rows.append((0, -w, -o.score, name, "fits", f"{o.score:.4f}", str(w), gpu_ranges(o.gpus) or "-", why))
        else:
            verdict = "unresolvable" if o.code is Code.UNRESOLVABLE else "unschedulable"
            why = o.message if not o.detail or o.detail == o.message else f"{o.message}: {o.detail}"
            rows.append((1, 0, 0.0, name, verdict, "-", "-", "-", why))
    rows.sort()
    width = max([len(r[3]) for r in rows] + [4])
    print(f"  {'NODE':<{width}}  {'VERDICT':<13}  {'SCORE':<6}  WIRE  {'GPUS':<5}  WHY")
    for *_, name, verdict, shown, sent, gpus, why in rows:
        print(f"  {name:<{width}}  {verdict:<13}  {shown:<6}  {sent:<4}  {gpus:<5}  {why}")
    if not any(o.code is Code.SUCCESS for o in decision.outcomes):
        print(summarize_failures([o.message for o in decision.outcomes], len(decision.outcomes)))
