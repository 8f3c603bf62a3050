"""Claims that come and go under DRA: how the GPUs a node is left with differ by who picks them. Pure.

Arrivals alone hide what first fit costs: it fills nodes in order and never has to choose among holes.
`simulate_churn` replays a stream of claims with departures on a set of nodes and, per arrival, lets
the same node choice (gputopo's engine: the best-scored node the allocator can serve; or, `first`,
the first node by name that fits, as kube-scheduler alone) meet one of three GPU choices:

- `device-plugin`: the engine's own GPU set (gputopo's device-plugin path);
- `dra-stock`: kube-scheduler's allocator (`gputopo.sim.draallocator.allocate`) over the devices in
  index order, gputopo's partition claim (today's DRA driver);
- `dra-best-fit`: the same allocator and claim over the devices in best-fit order for the node's
  GPUs in use at that moment (`gputopo.engine.dra.order`, what the driver re-publishes);
- `dra-blocks`: a claim for one clique block (`--dra-blocks`): the first free block of its size in
  the published best-fit order (`gputopo.engine.dra.blocks`, counters: none of its GPUs taken); a
  1-GPU claim, or a size the node publishes no block of, as `dra-best-fit`.

Figures, over the arrivals after the first `warmup` (the nodes start empty):

- on one clique: multi-GPU claims whose GPUs are one NVLink clique, of those placed while some node
  had a free clique of their size;
- clique refused: multi-GPU arrivals for which no node had a free clique of their size although the
  nodes had that many GPUs free (first fit's holes show up here), and the free GPUs they saw then
  (stranded GPUs, % of all GPUs, averaged over those arrivals);
- largest free clique: per node, averaged over nodes and arrivals;
- unplaced: arrivals no node could serve at all (not enough GPUs on any node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import combinations
from typing import Literal

from gputopo.engine.dra.blocks import block_order, first_free, node_blocks
from gputopo.engine.dra.devices import device_name, devices
from gputopo.engine.node.placement import evaluate_pod
from gputopo.engine.state.cliques import bits, mask_of, max_clique_size, popcount
from gputopo.engine.state.snapshot import NodeState, node_state, shape_of
from gputopo.model import NvlinkPolicy, PodRequest
from gputopo.sim.draallocator import NodeDevices, allocate, claim_for

Mode = Literal["device-plugin", "dra-stock", "dra-best-fit", "dra-blocks"]
MODES: tuple[Mode, ...] = ("device-plugin", "dra-stock", "dra-best-fit", "dra-blocks")
# Who picks the node: gputopo's engine (the extender's prioritize), or kube-scheduler alone (the first
# node by name where the pod fits: DRA devices get no score before 1.36's prioritized lists).
NodeChoice = Literal["engine", "first"]


@dataclass(frozen=True)
class Arrival:
    """A claim for `gpus` GPUs that holds them for `duration` (any unit: arrivals come one per unit)."""

    gpus: int
    duration: float


@dataclass(frozen=True)
class ChurnFigures:
    mode: Mode
    arrivals: int
    multi_placed_could: int  # multi-GPU claims placed while a free clique of their size existed
    multi_on_clique: int  # ... of those, on one clique
    clique_refused: int  # multi-GPU arrivals with no free clique of their size, enough GPUs free on a node
    stranded_pct: float  # free GPUs (% of all) those arrivals saw, averaged over them
    largest_free_clique: float  # per node, averaged over nodes and arrivals
    unplaced: int

    @property
    def on_clique_pct(self) -> float:
        return 100.0 * self.multi_on_clique / self.multi_placed_could if self.multi_placed_could else 100.0


def _is_clique(adj: Sequence[int], gpus: Sequence[int]) -> bool:
    return all(adj[a] >> b & 1 for a, b in combinations(gpus, 2))


def _first_block(node: NodeState, k: int) -> int | None:
    """The block a k-block claim gets on `node` (0: none free), or None where the node publishes no
    block of k GPUs (the claim is then a plain one)."""
    assert node.topology is not None
    masks = node_blocks(node.topology).masks
    if not any(popcount(m) == k for m in masks):
        return None
    usable = node.free_mask | mask_of(sorted(node.in_use))
    order = block_order(shape_of(node.topology), masks, usable, mask_of(sorted(node.in_use)))
    found = first_free(order, k, mask_of(sorted(node.in_use)))
    return found or 0


def simulate_churn(
    nodes: Sequence[NodeState],
    arrivals: Sequence[Arrival],
    mode: Mode,
    warmup: int = 0,
    node_choice: NodeChoice = "engine",
) -> ChurnFigures:
    """Replay `arrivals` (one per time unit, each leaving `duration` later) on `nodes` under `mode`."""
    state = list(nodes)
    total = sum(n.gpu_count for n in state)
    index_views = {id(n.topology): NodeDevices(devices(n.topology, list_attributes=False)) for n in state if n.topology}
    leaving: list[tuple[float, int, int, frozenset[int]]] = []  # (time, seq, node, gpus)
    placed_could = on_clique = refused = unplaced = 0
    stranded_sum = 0.0
    largest_sum = 0.0
    counted = 0
    for t, arrival in enumerate(arrivals):
        while leaving and leaving[0][0] <= t:
            _, _, i, gone = heappop(leaving)
            n = state[i]
            state[i] = node_state(n.name, n.topology, labels=n.labels, in_use=n.in_use - gone)
        k = arrival.gpus
        free_cliques = [max_clique_size(n.shape.adj, n.free_mask) if n.shape else 0 for n in state]
        could = any(c >= k for c in free_cliques)
        measured = t >= warmup
        if measured:
            counted += 1
            largest_sum += sum(free_cliques) / len(state)
            if k > 1 and not could and any(popcount(n.free_mask) >= k for n in state):
                refused += 1
                stranded_sum += 100.0 * sum(popcount(n.free_mask) for n in state) / total
        req = PodRequest(gpus=k, nvlink=NvlinkPolicy.PREFERRED if k > 1 else NvlinkPolicy.IGNORE)
        fits = [v for v in evaluate_pod(state, req) if v.outcome.fits]
        if node_choice == "engine":
            verdicts = sorted(fits, key=lambda v: (-v.outcome.score, v.node.name))
        else:
            verdicts = sorted(fits, key=lambda v: v.node.name)
        got: tuple[int, tuple[int, ...]] | None = None
        for v in verdicts:
            i = next(j for j, n in enumerate(state) if n.name == v.node.name)
            node = state[i]
            if mode == "device-plugin":
                got = (i, tuple(v.outcome.gpus))
                break
            assert node.topology is not None
            block = _first_block(node, k) if mode == "dra-blocks" else None
            if block is not None:
                got = (i, tuple(bits(block))) if block else None
                if got is not None:
                    break
                continue
            if mode == "dra-stock":
                view = index_views[id(node.topology)]
            else:
                view = NodeDevices(devices(node.topology, list_attributes=False, in_use=node.in_use))
            alloc = allocate(view, claim_for(req, "partitions"), [device_name(g) for g in sorted(node.in_use)])
            if alloc is not None:
                got = (i, alloc.gpus)
                break
        if got is None:
            unplaced += measured
            continue
        i, gpus = got
        node = state[i]
        if measured and k > 1 and could:
            placed_could += 1
            on_clique += _is_clique(shape_of(node.topology).adj, gpus) if node.topology else 0
        state[i] = node_state(node.name, node.topology, labels=node.labels, in_use=node.in_use | frozenset(gpus))
        heappush(leaving, (t + arrival.duration, t, i, frozenset(gpus)))
    return ChurnFigures(
        mode,
        counted,
        placed_could,
        on_clique,
        refused,
        stranded_sum / refused if refused else 0.0,
        largest_sum / counted if counted else 0.0,
        unplaced,
    )
