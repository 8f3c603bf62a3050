"""`gputopo defrag` on a synthetic fragmented cluster: the figures before and after its moves, and the time.

Builds `--nodes` 8-GPU nodes (half DGX H100, 30 % DGX-1, 20 % A100 PCIe with NVLink bridges), each with
0 to 5 pods of 1, 2 or 4 GPUs placed on random free NVLink cliques of their size (placement without
fragmentation awareness: how a cluster looks after months of the default scheduler), then prints the
fragmentation per node class for sizes 8, 4 and 2, the plan's moves, the figures after them, and the
time taken by the figures and by the plan.

    .venv/bin/python bench/defrag.py [--nodes 500] [--seed 1] [--max-moves 10]
"""

from __future__ import annotations

import argparse
import random
import time

from gputopo.engine.cluster.defrag import PlacedPod, plan
from gputopo.engine.cluster.fragmentation import DEFAULT_SIZES, Figures, class_figures
from gputopo.engine.state.cliques import bits, k_cliques
from gputopo.engine.state.snapshot import NodeState, node_state, shape_of
from gputopo.model import PodRequest
from gputopo.systems import build_system

MIX = ("dgx-h100",) * 5 + ("dgx-1v",) * 3 + ("a100-pcie-bridged",) * 2


def synthetic(count: int, seed: int) -> tuple[list[NodeState], list[PlacedPod]]:
    rng = random.Random(seed)
    nodes, pods = [], []
    for i in range(count):
        name = f"node-{i:04d}"
        topo = build_system(rng.choice(MIX), name)
        shape = shape_of(topo)
        used = 0
        for j in range(rng.randint(0, 5)):
            k = rng.choice((1, 1, 2, 2, 2, 4))
            free = 0xFF & ~used
            options = list(k_cliques(shape.adj, free, k)) if k > 1 else [1 << g for g in bits(free)]
            if not options:
                continue
            chosen = rng.choice(options)
            used |= chosen
            pods.append(PlacedPod(f"bench/p{i}-{j}", name, frozenset(bits(chosen)), PodRequest(gpus=k)))
        nodes.append(node_state(name, topo, in_use=frozenset(bits(used))))
    return nodes, pods


def show(title: str, nodes: list[NodeState]) -> None:
    print(title)
    total = Figures()
    for c in class_figures(nodes, DEFAULT_SIZES):
        f = c.figures
        total = total + f
        print(f"  {c.name}: {c.nodes} nodes, {f.free} free, usable 8/4/2 {f.usable}, stranded {f.stranded}")
    print(f"  all: free cliques 8/4/2 {total.cliques}, stranded {total.stranded}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-moves", type=int, default=10)
    args = ap.parse_args()
    nodes, pods = synthetic(args.nodes, args.seed)
    t0 = time.perf_counter()
    show(f"{len(nodes)} nodes, {len(pods)} pods", nodes)
    t1 = time.perf_counter()
    result = plan(nodes, pods, DEFAULT_SIZES, max_moves=args.max_moves)
    t2 = time.perf_counter()
    for i, step in enumerate(result.steps, 1):
        print(f"  {i}. {step.text()}")
    show("after the moves", result.after)
    print(f"figures {1000 * (t1 - t0):.0f} ms, plan of {len(result.moves)} moves {t2 - t1:.2f} s")


if __name__ == "__main__":
    main()
