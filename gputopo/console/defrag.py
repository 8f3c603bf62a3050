"""`gputopo defrag`: how fragmented the free GPUs are, and the fewest pod moves that would undo it.

A report only. It reads the live cluster the way `gputopo explain` does (one list of Nodes, Pods and
the agents' Leases into the extender's own cache, so in-use GPUs are counted exactly as the extender
counts them), or a cluster file with an optional file of placed and pending pods; it never writes to
the API server: no eviction, no annotation, no Event. The figures come from
`gputopo/engine/cluster/fragmentation.py`, the moves from `gputopo/engine/cluster/defrag.py`; docs/defrag.md
describes the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gputopo.clusterfile import ClusterFileError, _load, cluster_states, load_cluster
from gputopo.engine.cluster.defrag import MAX_MOVES, PlacedPod, Plan, plan
from gputopo.engine.cluster.fragmentation import (
    DEFAULT_SIZES,
    ClassFigures,
    Figures,
    class_figures,
    cluster_figures,
    normalize_sizes,
    takes_pods,
)
from gputopo.engine.state.reasons import message
from gputopo.engine.state.snapshot import NodeState, with_in_use
from gputopo.model import AnnotationError, parse_pod_request

NAME = "defrag"


class Reader(Protocol):
    """All the live path needs of the API server: lists. No method here writes."""

    def list_objects(self, kind: Any) -> tuple[list[dict[str, Any]], str]: ...


@dataclass
class Snapshot:
    nodes: list[NodeState]
    pods: list[PlacedPod]  # gputopo pods holding GPUs
    pending: list[int] = field(default_factory=list)  # GPU counts of gputopo pods waiting for a node
    skipped: list[tuple[str, str]] = field(default_factory=list)  # nodes that take no gputopo pod, and why


# ------------------------------------------------------------------------------------------ sources


def load_live(source: Reader, *, namespace: str, stale_after_seconds: float) -> Snapshot:
    """One list of each kind into the extender's cache; pods' GPUs as the extender counts them
    (reported by the node under the pod's UID, else its placement once bound)."""
    from gputopo.extender.watch.cache import ClusterCache

    cache = ClusterCache(stale_after_seconds=stale_after_seconds, lease_namespace=namespace)
    for kind in ("nodes", "pods", "leases"):
        items, _ = source.list_objects(kind)
        cache.replace(kind, items)
    ledger = cache.ledger
    nodes = ledger.states(sorted(ledger.nodes))
    pods: list[PlacedPod] = []
    pending: list[int] = []
    for rec in sorted(ledger.pods.values(), key=lambda r: r.ref):
        if not rec.active:
            continue
        if not rec.node_name:
            if rec.request is not None and rec.gpus > 0:
                pending.append(rec.gpus)
            continue
        gpus = ledger.pod_gpus(rec.node_name, rec.uid)
        if gpus:
            pods.append(PlacedPod(rec.ref, rec.node_name, gpus, rec.request))
    return Snapshot(nodes, pods, pending, _skipped(nodes))


class PodEntry(BaseModel):
    """One pod of a `--pods` file: placed (`node` and `gpus`) or pending (`gpusPerPod` only)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    name: str = Field(min_length=1, description="namespace/name, or name (namespace default)")
    node: str | None = None
    gpus: list[int] = Field(default_factory=list)
    gpus_per_pod: int | None = Field(alias="gpusPerPod", default=None, ge=1, le=64)
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _placed_or_pending(self) -> PodEntry:
        if self.node is not None:
            if not self.gpus:
                raise ValueError("a placed pod (with 'node') needs its 'gpus'")
            if len(set(self.gpus)) != len(self.gpus):
                raise ValueError("'gpus' names a GPU twice")
            if self.gpus_per_pod is not None and self.gpus_per_pod != len(self.gpus):
                raise ValueError("'gpusPerPod' differs from the number of 'gpus'")
        elif self.gpus or self.gpus_per_pod is None:
            raise ValueError("a pending pod (no 'node') gives 'gpusPerPod' and no 'gpus'")
        return self

    @property
    def ref(self) -> str:
        return self.name if "/" in self.name else f"default/{self.name}"

    @property
    def count(self) -> int:
        return len(self.gpus) if self.node is not None else self.gpus_per_pod or 0


class PodsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pods: list[PodEntry]


def load_files(cluster: Path, pods_file: Path | None) -> Snapshot:
    """A cluster file (its `gpusInUse` hold GPUs nobody may move) plus placed and pending pods.
    A pod's annotations take their defaults when left out (`nvlink: required`), as in the simulator."""
    nodes = cluster_states(load_cluster(cluster))
    pods: list[PlacedPod] = []
    pending: list[int] = []
    if pods_file is not None:
        spec = _load(pods_file, PodsSpec, "pods")
        by_name = {n.name: n for n in nodes}
        owner: dict[tuple[str, int], str] = {}
        for i, p in enumerate(spec.pods):
            where = f"{pods_file}: pods[{i}] ({p.name})"
            try:
                request = parse_pod_request(p.annotations, p.count)
            except AnnotationError as e:
                raise ClusterFileError(f"{where}.annotations: {e}") from None
            if p.node is None:
                pending.append(p.count)
                continue
            node = by_name.get(p.node)
            if node is None:
                raise ClusterFileError(f"{where}.node: no node {p.node!r} in {cluster}")
            bad = [g for g in p.gpus if not 0 <= g < node.gpu_count]
            if bad:
                raise ClusterFileError(f"{where}.gpus: {bad} out of range for {node.gpu_count} GPUs")
            for g in p.gpus:
                other = owner.setdefault((p.node, g), p.ref)
                if other != p.ref:
                    raise ClusterFileError(f"{where}.gpus: GPU {g} on {p.node} is held by {other} too")
            pods.append(PlacedPod(p.ref, p.node, frozenset(p.gpus), request))
        held: dict[str, frozenset[int]] = {}
        for pod in pods:
            held[pod.node] = held.get(pod.node, frozenset()) | pod.gpus
        nodes = [with_in_use(n, held[n.name]) if n.name in held else n for n in nodes]
    return Snapshot(nodes, pods, pending, _skipped(nodes))


def _skipped(nodes: Sequence[NodeState]) -> list[tuple[str, str]]:
    out = []
    for n in nodes:
        if not takes_pods(n):
            why = message(n.problem) if n.problem is not None else "GPU topology not reported"
            out.append((n.name, why + (f": {n.problem_detail}" if n.problem_detail else "")))
    return out


# ------------------------------------------------------------------------------------------ report


def _figures_doc(f: Figures, sizes: tuple[int, ...]) -> dict[str, Any]:
    return {
        "freeGpus": f.free,
        "usableGpus": {str(k): u for k, u in zip(sizes, f.usable, strict=True)},
        "freeCliques": {str(k): c for k, c in zip(sizes, f.cliques, strict=True)},
        "strandedGpus": f.stranded,
    }


def _classes_doc(classes: list[ClassFigures], sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"class": c.name, "nodes": c.nodes, **_figures_doc(c.figures, sizes)} for c in classes]


def report(snapshot: Snapshot, sizes: tuple[int, ...], sizes_from: str, max_moves: int = MAX_MOVES) -> dict[str, Any]:
    """The whole report as one JSON-ready document (the text output renders this)."""
    result: Plan = plan(snapshot.nodes, snapshot.pods, sizes, max_moves=max_moves)
    sizes = result.sizes
    steps = []
    for s in result.steps:
        steps.append(
            {
                "moves": [
                    {
                        "pod": m.pod,
                        "from": {"node": m.source, "gpus": list(m.source_gpus)},
                        "to": {"node": m.target, "gpus": list(m.target_gpus)},
                    }
                    for m in s.moves
                ],
                "frees": [{"node": f.node, "size": f.size, "cliques": f.cliques} for f in s.freed],
                "reason": s.reason(),
                "text": s.text(),
            }
        )
    return {
        "sizes": list(sizes),
        "sizesFrom": sizes_from,
        "pendingPods": len(snapshot.pending),
        "classes": _classes_doc(class_figures(snapshot.nodes, sizes), sizes),
        "total": _figures_doc(cluster_figures(snapshot.nodes, sizes), sizes),
        "steps": steps,
        "after": {
            "classes": _classes_doc(class_figures(result.after, sizes), sizes),
            "total": _figures_doc(cluster_figures(result.after, sizes), sizes),
        },
        "pinned": [{"pod": p.ref, "node": p.node, "why": why} for p, why in result.pinned],
        "skippedNodes": [{"node": n, "why": why} for n, why in snapshot.skipped],
    }


def _row(label: str, nodes: int | str, f: dict[str, Any], sizes: list[int]) -> list[str]:
    return [
        label,
        str(nodes),
        str(f["freeGpus"]),
        *(str(f["usableGpus"][str(k)]) for k in sizes),
        str(f["strandedGpus"]),
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def render_text(doc: dict[str, Any]) -> str:
    sizes: list[int] = doc["sizes"]
    shown = ", ".join(str(k) for k in sizes)
    lines = [f"Free GPUs against pod sizes {shown} ({doc['sizesFrom']})"]
    header = ["CLASS", "NODES", "FREE", *(f"USABLE {k}" for k in sizes), "STRANDED"]
    rows = [header] + [_row(c["class"], c["nodes"], c, sizes) for c in doc["classes"]]
    nodes = sum(c["nodes"] for c in doc["classes"])
    rows.append(_row("all", nodes, doc["total"], sizes))
    lines += _table(rows)
    lines.append("  USABLE k: free GPUs in the most disjoint free k-GPU NVLink cliques")
    lines.append("  STRANDED: free GPUs that no packing of free cliques of these sizes covers")
    steps = doc["steps"]
    if not steps:
        lines.append("No move would make more free GPUs usable.")
    else:
        count = sum(len(s["moves"]) for s in steps)
        lines.append(f"Moves ({count}, a recommendation: gputopo evicts nothing; each pod moves by being recreated):")
        for i, s in enumerate(steps, 1):
            lines.append(f"  {i}. {s['text']}")
        before, after = doc["total"], doc["after"]["total"]
        parts = [f"usable {k}-GPU {before['usableGpus'][str(k)]} -> {after['usableGpus'][str(k)]}" for k in sizes]
        parts.append(f"stranded {before['strandedGpus']} -> {after['strandedGpus']}")
        lines.append("After these moves: " + ", ".join(parts))
    for p in doc["pinned"]:
        lines.append(f"Not moved: {p['pod']} on {p['node']}: {p['why']}")
    for n in doc["skippedNodes"]:
        lines.append(f"Not counted: node {n['node']}: {n['why']}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ command


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return normalize_sizes(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give GPU counts separated by commas, e.g. 8,4,2") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from gputopo.console.inspect import _common

    p: argparse.ArgumentParser = subparsers.add_parser(
        NAME,
        help="how fragmented the free GPUs are, and the fewest pod moves that would undo it (read-only)",
        description=(
            "Measure the free GPUs that cannot form the NVLink cliques pods need, per node class, and propose "
            "the fewest pod moves that would free them. Reads the live cluster (as `gputopo explain`) or a "
            "cluster file; evicts nothing and writes nothing."
        ),
    )
    p.add_argument("--cluster", type=Path, metavar="FILE", help="a cluster file (the simulator's format) instead")
    p.add_argument("--pods", type=Path, metavar="FILE", help="with --cluster: placed and pending pods (docs/defrag.md)")
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="pod GPU counts to measure against, e.g. 8,4,2 (default: the pending gputopo pods' sizes, "
        f"else {','.join(map(str, DEFAULT_SIZES))})",
    )
    p.add_argument("--max-moves", type=int, default=MAX_MOVES, help=f"most pods to move (default {MAX_MOVES})")
    p.add_argument("--output", choices=("text", "json"), default="text", help="output format (default: text)")
    _common(p)
    return p


def _source(args: argparse.Namespace) -> Reader:
    from gputopo.console.inspect import _source as inspect_source  # the same client and kubeconfig as explain

    source: Reader = inspect_source(args)
    return source


def run(args: argparse.Namespace) -> int:
    if args.pods is not None and args.cluster is None:
        sys.stderr.write("gputopo defrag: --pods goes with --cluster (the live cluster has its own pods)\n")
        return 2
    if args.max_moves < 0:
        sys.stderr.write("gputopo defrag: --max-moves must be 0 or more\n")
        return 2
    if args.cluster is not None:
        try:
            snapshot = load_files(args.cluster, args.pods)
        except ClusterFileError as e:
            sys.stderr.write(f"gputopo defrag: {' '.join(str(e).split())}\n")
            return 2
    else:
        try:
            snapshot = load_live(
                _source(args), namespace=args.gputopo_namespace, stale_after_seconds=args.stale_after_seconds
            )
        except Exception as e:  # no kubeconfig, unreachable server, refused list
            sys.stderr.write(f"gputopo defrag: cannot read the cluster: {e}\n")
            return 1
    if args.sizes is not None:
        sizes, sizes_from = args.sizes, "--sizes"
    elif snapshot.pending:
        sizes = normalize_sizes(snapshot.pending)
        n = len(snapshot.pending)
        sizes_from = f"the sizes of {n} pending gputopo pod{'s' if n != 1 else ''}"
    else:
        sizes, sizes_from = DEFAULT_SIZES, "the default mix: no gputopo pod is pending"
    doc = report(snapshot, sizes, sizes_from, args.max_moves)
    sys.stdout.write(json.dumps(doc) + "\n" if args.output == "json" else render_text(doc))
    return 0
