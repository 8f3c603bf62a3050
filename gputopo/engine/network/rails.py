"""Fabric rails of a group's GPUs: are the members that take part of a node on the same rails?

Rail-optimized fabrics cable NIC k of every node to leaf k (rail k), so traffic between two nodes'
GPUs of the same rail crosses one leaf, and traffic between rails crosses the spine. A GPU's rails are
those of its nearest NICs (gputopo.model.gpu_rail_masks, `NodeState.gpu_rails`). A group is
rail-aligned when every member that takes part of a node uses the same set of rails; members that take
a whole node use every rail the node has and are aligned with anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.engine.state.cliques import bits
from gputopo.engine.state.snapshot import NodeState


@dataclass(frozen=True)
class RailAlignment:
    applies: bool  # some member takes part of its node: only then can rails differ
    aligned: bool
    rails: int = 0  # the rails every partial member uses (bit r: rail r), when aligned
    why: str = ""  # when not aligned: in words, for the placement sentence


NOT_APPLICABLE = RailAlignment(applies=False, aligned=True)


def rails_of(node: NodeState, gpus: Sequence[int]) -> int:
    """The rails `gpus` on `node` use (bit r: rail r)."""
    mask = 0
    for g in gpus:
        if 0 <= g < len(node.gpu_rails):
            mask |= node.gpu_rails[g]
    return mask


def rail_ranges(mask: int) -> str:
    """0b1111 -> '0-3'; 0b10100011 -> '0-1,5,7'."""
    out: list[str] = []
    r = bits(mask)
    i = 0
    while i < len(r):
        j = i
        while j + 1 < len(r) and r[j + 1] == r[j] + 1:
            j += 1
        out.append(f"{r[i]}-{r[j]}" if j > i else str(r[i]))
        i = j + 1
    return ",".join(out)


def is_partial(node: NodeState, gpus: Sequence[int]) -> bool:
    return 0 < len(gpus) < node.gpu_count


def assess(members: Sequence[tuple[NodeState, Sequence[int]]]) -> RailAlignment:
    """Whether the members (node, GPUs) that take part of a node all use the same rails, and if not why."""
    partial = [(n, g) for n, g in members if is_partial(n, g)]
    if not partial:
        return NOT_APPLICABLE
    for node, gpus in partial:
        bare = [g for g in sorted(gpus) if not rails_of(node, (g,))]
        if bare:
            return RailAlignment(
                True, False, why=f"GPU {bare[0]} on {node.name} has no active NIC at PIX/PXB, so no known rail"
            )
    masks = [rails_of(n, g) for n, g in partial]
    if len(set(masks)) == 1:
        return RailAlignment(True, True, masks[0])
    counts = sorted({len(g) for _, g in partial})
    if len(counts) > 1:
        words = " and ".join(str(c) for c in counts)
        return RailAlignment(True, False, why=f"members take different GPU counts ({words}) of their nodes")
    return RailAlignment(True, False, why="members use " + _listing(partial))


def _listing(partial: Sequence[tuple[NodeState, Sequence[int]]], limit: int = 3) -> str:
    """'rails 4-7 on gpu-01, 0-3 on gpu-02' (nodes grouped by rail set, at most `limit` sets named)."""
    by_rails: dict[int, list[str]] = {}
    for node, gpus in partial:
        by_rails.setdefault(rails_of(node, gpus), []).append(node.name)
    parts = []
    for mask, names in list(by_rails.items())[:limit]:
        where = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        parts.append(f"{rail_ranges(mask)} on {where}")
    more = f" and {len(by_rails) - limit} other rail sets" if len(by_rails) > limit else ""
    return "rails " + ", ".join(parts) + more
