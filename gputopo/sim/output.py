"""How `gputopo simulate` prints a result: JSON for programs, text for people."""

from __future__ import annotations

import json
from collections.abc import Sequence

from gputopo.engine.cluster.explain import gpu_ranges
from gputopo.engine.state.snapshot import NodeState
from gputopo.sim.core import SimResult
from gputopo.sim.metrics import Summary

POLICY_WORDS = {
    "gputopo": "gputopo (topology-aware: NVLink cliques, HBM, fabric tiers, groups all-or-nothing)",
    "default": "default (kube-scheduler LeastAllocated + NVIDIA device plugin best-effort GPUs; no topology or groups)",
    "random": "random (a random node with enough free GPUs, random GPUs)",
}


def to_json(result: SimResult) -> dict[str, object]:
    return {
        "placements": [
            {"pod": p.pod, "node": p.node, "gpus": list(p.gpus), "score": p.score, "reason": p.reason}
            for p in result.placements
        ],
        "unplaced": [{"pod": u.pod, "reasons": u.reasons} for u in result.unplaced],
        "summary": {"policy": result.policy, "seed": result.seed, **result.summary.to_json()},
    }


def render_json(result: SimResult) -> str:
    return json.dumps(to_json(result), indent=2)


def _seconds(s: float) -> str:
    if s == float("inf"):
        return "unbounded"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def _pct(a: int, b: int) -> str:
    return f"{a} of {b} ({100 * a / b:.0f}%)" if b else f"{a} of {b}"


def _bytes(b: float) -> str:
    mib = b / 2**20
    return f"{mib:.0f} MiB" if mib == int(mib) else f"{b:.0f} bytes"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _cluster_line(nodes: Sequence[NodeState]) -> str:
    gpus = sum(len(n.topology.gpus) for n in nodes if n.topology is not None)
    used = sum(len(n.in_use) for n in nodes)
    return f"{len(nodes)} nodes, {gpus} GPUs ({used} already in use)"


def summary_lines(s: Summary) -> list[str]:
    rows: list[tuple[str, str]] = [("pods placed", f"{s.pods_placed} of {s.pods} ({s.jobs_placed} of {s.jobs} jobs)")]
    if s.multi_gpu_pods:
        rows.append(
            (
                "multi-GPU pods on a full NVLink clique",  # of those asking for NVLink
                f"{_pct(s.on_full_clique, s.multi_gpu_placed)} placed; "
                f"{_pct(s.on_full_clique_of_could, s.could_have_clique)} that could have had one on the empty cluster",
            )
        )
    if s.groups:
        within = "; ".join(f"one {t}: {_pct(c, s.groups_placed)}" for t, c in reversed(list(s.groups_within.items())))
        text = f"{s.groups_placed} of {s.groups} placed in full"
        if s.groups_partial:
            text += f", {s.groups_partial} only in part (their GPUs are held, the job cannot start)"
        rows.append(("groups", text))
        if s.groups_placed:
            rows.append(("groups placed within", within))
        if s.rail_groups:
            rows.append(
                (
                    "rail-aligned groups",
                    f"{_pct(s.rail_aligned, s.rail_groups)} of those with members on part of a node "
                    "(the same NIC rails on every member's node)",
                )
            )
    if s.broken:
        parts = ", ".join(f"{n} {kind}" for kind, n in s.broken.items())
        rows.append(("pods placed against their requests", f"{parts} (pods, by the request broken)"))
    elif s.pods_placed:
        rows.append(("pods placed against their requests", "none"))
    if s.stranded_gpus:
        stranded = (
            f"{s.stranded_gpus} of {s.free_gpus} free GPUs (on {s.stranded_nodes} node"
            f"{'s' if s.stranded_nodes != 1 else ''}) fit none of the pods still waiting"
        )
    elif s.pods_placed < s.pods:
        stranded = f"none: every node with free GPUs ({s.free_gpus} in all) could take some waiting pod"
    else:
        stranded = f"none: nothing is waiting ({s.free_gpus} GPUs free)"
    rows.append(("stranded GPUs", stranded))
    rows.append(
        (
            "est. communication time",
            f"{_seconds(s.tp_allreduce_seconds + s.pp_transfer_seconds)} in all: "
            f"{_seconds(s.tp_allreduce_seconds)} TP allreduce, {_seconds(s.pp_transfer_seconds)} PP transfers",
        )
    )
    rows.append(
        (
            "",
            f"(one {_bytes(s.tp_message_bytes)} allreduce per multi-GPU pod and one {_bytes(s.pp_message_bytes)} "
            "transfer per stage boundary, over jobs placed in full)",
        )
    )
    e = s.exhaustive
    if e is not None:
        if e.ratio is not None:
            text = f"{e.ratio:.2f}x the best placement's ({_seconds(e.policy_seconds)} vs {_seconds(e.best_seconds)})"
            if s.exhaustive_note:
                text += f"; {s.exhaustive_note}"
        else:
            text = s.exhaustive_note or "not comparable"
        if not e.complete:
            text += f" (search stopped after {e.states} options: best found so far)"
        rows.append(("vs exhaustive search", text))
    elif s.exhaustive_note:
        rows.append(("vs exhaustive search", s.exhaustive_note))
    width = max(len(k) for k, _ in rows)
    return [f"  {k:<{width}}  {v}" for k, v in rows]


def render_text(result: SimResult) -> str:
    out = [
        f"Policy {POLICY_WORDS.get(result.policy, result.policy)}",
        f"Cluster {_cluster_line(result.initial)}; {len(result.jobs)} jobs, {result.summary.pods} pods",
        "",
    ]
    if result.placements:
        rows = [(p.pod, p.node, gpu_ranges(p.gpus) or "-", str(p.score), p.reason) for p in result.placements]
        head = ("POD", "NODE", "GPUS", "SCORE", "WHY")
        widths = [max(len(r[i]) for r in [*rows, head]) for i in range(4)]
        out.append(f"Placed ({_plural(len(rows), 'pod')})")
        for r in [head, *rows]:
            out.append("  " + "  ".join(f"{r[i]:<{widths[i]}}" for i in range(4)) + "  " + r[4])
        out.append("")
    if result.unplaced:
        width = max(len(u.pod) for u in result.unplaced)
        out.append(
            f"Not placed ({_plural(len(result.unplaced), 'pod')}; "
            "reasons as in kube-scheduler's FailedScheduling event)"
        )
        for u in result.unplaced:
            out.append(f"  {u.pod:<{width}}  {u.reasons}")
        out.append("")
    out.append(f"Summary (seed {result.seed})" if result.policy != "gputopo" else "Summary")
    out.extend(summary_lines(result.summary))
    return "\n".join(out) + "\n"
