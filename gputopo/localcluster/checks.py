"""The invariant every fault test and the soak check: no GPU is held by two live pods.

What a pod holds on its node is what the node reports under the pod's UID (the agent's per-pod truth
in ``gputopo.io/gpus-in-use``), else the GPUs its ``gputopo.io/placement`` names: the same rule the
extender's ledger follows. A placement counts only on the node the pod is bound to, since only a
bind makes it true. Where the node reports the pod, the report must also match the placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gputopo.model import (
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    AnnotationError,
    GpusInUse,
    parse_gpus_in_use_report,
    parse_placement,
)

JSON = dict[str, Any]
TERMINATED = ("Succeeded", "Failed")


@dataclass
class GpuCheck:
    """The outcome of one check over a set of pods and nodes."""

    live_bound: int = 0  # live pods bound to a node
    placed: int = 0  # ... of which carry a placement for that node
    reported: int = 0  # ... of which the node reports under their UID
    double_booked: list[str] = field(default_factory=list)  # "node GPU g: ns/a and ns/b"
    mismatched: list[str] = field(default_factory=list)  # "ns/a on node: placed [..], node reports [..]"
    unreadable: list[str] = field(default_factory=list)  # bad annotations (none expected)

    @property
    def ok(self) -> bool:
        return not (self.double_booked or self.mismatched or self.unreadable)

    def summary(self) -> str:
        head = (
            f"{self.live_bound} live bound pods, {self.placed} placed, {self.reported} reported by their node; "
            f"{len(self.double_booked)} GPUs double-booked, {len(self.mismatched)} placement mismatches"
        )
        details = [*self.double_booked[:5], *self.mismatched[:5], *self.unreadable[:5]]
        return head + ("" if not details else ": " + "; ".join(details))


def _live(pod: Mapping[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") not in TERMINATED


def check_gpus(pods: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]]) -> GpuCheck:
    """Check ``pods`` (any namespaces) against ``nodes``' reports. Pods on nodes not given are
    checked by their placements alone."""
    out = GpuCheck()
    reports: dict[str, GpusInUse] = {}
    for node in nodes:
        name = str(node.get("metadata", {}).get("name", ""))
        text = node.get("metadata", {}).get("annotations", {}).get(GPUS_IN_USE_ANNOTATION)
        if not text:
            continue
        try:
            reports[name] = parse_gpus_in_use_report(text)
        except AnnotationError as e:
            out.unreadable.append(f"node {name}: {e}")
    holders: dict[tuple[str, int], str] = {}
    for pod in pods:
        meta = pod.get("metadata", {})
        node = pod.get("spec", {}).get("nodeName")
        if not node or not _live(pod):
            continue
        out.live_bound += 1
        who = f"{meta.get('namespace')}/{meta.get('name')}"
        placed: frozenset[int] | None = None
        text = meta.get("annotations", {}).get(PLACEMENT_ANNOTATION)
        if text:
            try:
                p = parse_placement(text)
            except AnnotationError as e:
                out.unreadable.append(f"{who}: {e}")
            else:
                if p.node == node:
                    placed = frozenset(p.gpus)
                    out.placed += 1
        report = reports.get(node)
        truth = report.pods.get(str(meta.get("uid"))) if report is not None else None
        if truth is not None:
            out.reported += 1
            if placed is not None and truth != placed:
                out.mismatched.append(f"{who} on {node}: placed {sorted(placed)}, node reports {sorted(truth)}")
        held = truth if truth is not None else placed
        for gpu in sorted(held or ()):
            other = holders.setdefault((node, gpu), who)
            if other != who:
                out.double_booked.append(f"{node} GPU {gpu}: {other} and {who}")
    return out


def per_pod_truth(pods: Iterable[Mapping[str, Any]], node: str) -> dict[str, list[int]]:
    """What a node's kubelet would report for the live pods bound to it: each pod's placed GPUs by
    UID (for a simulated node, whose agent reads this from a file)."""
    out: dict[str, list[int]] = {}
    for pod in pods:
        meta = pod.get("metadata", {})
        if pod.get("spec", {}).get("nodeName") != node or not _live(pod):
            continue
        text = meta.get("annotations", {}).get(PLACEMENT_ANNOTATION)
        if not text:
            continue
        try:
            p = parse_placement(text)
        except AnnotationError:
            continue
        if p.node == node:
            out[str(meta["uid"])] = sorted(p.gpus)
    return out
