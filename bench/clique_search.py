"""CPU time of one GPU-set decision: the exhaustive search the engine used to run against today's.

Run: `.venv/bin/python bench/clique_search.py` (about half a minute on 2 cores).

Each row is one node and one pod: the exhaustive search (`exhaustive_set`, every admissible k-set
ranked) against the bounded one (`best_set`), both from cold caches, CPU time (`time.process_time`)
per decision over a bounded number of repetitions, and whether both chose the same GPUs. Where the
exhaustive search would rank more than `--old-cap` sets it ranks only that many and its time is
extrapolated to all of them (marked `~`); its choice is then not compared. Targets (printed, not
asserted): at most 1 ms for an 8-GPU pod on a 16-GPU NVSwitch node, 10 ms on a 64-GPU node.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from math import comb
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gputopo.engine.node import gpusets  # noqa: E402
from gputopo.engine.node.gpusets import Kind, best_set, classes, exhaustive_set, symmetric  # noqa: E402
from gputopo.engine.state.cliques import k_cliques, mask_of, max_clique_size, popcount  # noqa: E402
from gputopo.engine.state.snapshot import Shape, node_state  # noqa: E402
from gputopo.model import NetworkKind  # noqa: E402
from gputopo.systems import SYSTEMS, build_system  # noqa: E402

CPU_S_PER_MEASURE = 0.3  # repetitions stop once this much CPU time is spent (at least one run)
MAX_REPS = 200


@dataclass(frozen=True)
class Case:
    name: str
    shape: Shape
    candidates: int
    k: int
    kind: Kind
    near: int = 0


def nvswitch(n: int, numa_nodes: int) -> Shape:
    """An n-GPU node behind NVSwitch (NV18 every pair), GPUs split evenly over `numa_nodes`."""
    links = tuple(tuple(0 if i == j else 18 for j in range(n)) for i in range(n))
    adj = tuple(((1 << n) - 1) & ~(1 << i) for i in range(n))
    return Shape(n, links, adj, True, 4, 25.0, tuple(i * numa_nodes // n for i in range(n)))


def trays(n: int, bridge: int) -> Shape:
    """n GPUs as two NVSwitch trays (NV18 inside), joined by `bridge` links per GPU pair (0: not joined),
    four NUMA nodes per tray."""
    half = n // 2
    links = tuple(tuple(0 if i == j else 18 if i // half == j // half else bridge for j in range(n)) for i in range(n))
    adj = tuple(mask_of([j for j in range(n) if j != i and links[i][j]]) for i in range(n))
    return Shape(n, links, adj, True, 4, 25.0, tuple(i * 8 // n for i in range(n)))


def ring(n: int) -> Shape:
    """Irregular: each GPU linked to the next five with varied link counts, so no two GPUs are alike and
    only the budgeted general search applies."""
    links = [[0] * n for _ in range(n)]
    for i in range(n):
        for d in range(1, 6):
            j = (i + d) % n
            links[i][j] = links[j][i] = 1 + (i * 7 + j * 3) % 4
    adj = tuple(mask_of([j for j in range(n) if links[i][j]]) for i in range(n))
    return Shape(n, tuple(map(tuple, links)), adj, False, 4, 25.0, tuple(i * 4 // n for i in range(n)))


def cases() -> list[Case]:
    n16, n64 = nvswitch(16, 2), nvswitch(64, 8)
    all16, all64 = (1 << 16) - 1, (1 << 64) - 1
    out = [
        Case("16-GPU NVSwitch, empty, TP-8", n16, all16, 8, "clique"),
        Case("16-GPU NVSwitch, half used, TP-8", n16, all16 & ~mask_of([0, 1, 2, 5, 8, 9, 12, 15]), 8, "clique"),
        Case("16-GPU NVSwitch, 5 used, TP-8", n16, all16 & ~mask_of([0, 3, 6, 9, 12]), 8, "clique"),
        Case("64-GPU NVSwitch, empty, TP-8", n64, all64, 8, "clique"),
        Case("64-GPU NVSwitch, empty, TP-32", n64, all64, 32, "clique"),
        Case(
            "64-GPU NVSwitch, 1/3 used, TP-32, near IB",
            n64,
            all64 & ~mask_of(list(range(0, 64, 3))),
            32,
            "clique",
            mask_of(list(range(0, 64, 4))),
        ),
        Case("64-GPU NVSwitch, empty, 16 GPUs nvlink:ignore", n64, all64, 16, "any"),
        Case("16-GPU, 2 separate trays, 3 used, TP-4", trays(16, 0), all16 & ~mask_of([0, 9, 10]), 4, "clique"),
        Case("16-GPU, 2 trays joined by NV2, 3 used, TP-8", trays(16, 2), all16 & ~mask_of([0, 9, 10]), 8, "clique"),
        Case("64-GPU, 2 trays joined by NV2, TP-32", trays(64, 2), all64, 32, "clique"),
        Case("64-GPU, 2 trays joined by NV2, 3 used, TP-8", trays(64, 2), all64 & ~mask_of([0, 33, 34]), 8, "clique"),
        Case("24-GPU irregular ring, TP-4 (budget)", ring(24), (1 << 24) - 1, 4, "clique"),
        Case("24-GPU irregular ring, 6 GPUs ignore (budget)", ring(24), (1 << 24) - 1, 6, "any"),
    ]
    for system in SYSTEMS:
        state = node_state(system, build_system(system))
        shape = state.shape
        assert shape is not None
        full = state.all_mask
        clique = max_clique_size(shape.adj, full)
        if clique >= 2:
            out.append(Case(f"{system}, empty, TP-{clique}", shape, full, clique, "clique"))
            used = full & ~mask_of([0, shape.n - 1])
            out.append(
                Case(
                    f"{system}, 2 used, TP-2 near IB",
                    shape,
                    used,
                    2,
                    "clique",
                    state.near_nic_mask(NetworkKind.INFINIBAND),
                )
            )
        else:
            out.append(Case(f"{system}, empty, {shape.n // 2} GPUs nvlink:ignore", shape, full, shape.n // 2, "any"))
    return out


def cold() -> None:
    """Forget every memoised search, so each repetition pays for a whole decision."""
    for fn in (
        gpusets.largest_clique,
        symmetric.link_blocks,
        gpusets.twin_classes,
        classes._symmetric_links,
        symmetric._link_counts,
    ):
        fn.cache_clear()


def cpu_per_call(fn: Callable[[], object]) -> float:
    reps, spent = 0, 0.0
    while reps < MAX_REPS and (reps == 0 or spent < CPU_S_PER_MEASURE):
        cold()
        t0 = time.process_time()
        fn()
        spent += time.process_time() - t0
        reps += 1
    return spent / reps


def admissible_sets(c: Case) -> int:
    if c.kind != "clique":
        return comb(popcount(c.candidates), c.k)
    if all(c.shape.adj[i] | (1 << i) == (1 << c.shape.n) - 1 for i in range(c.shape.n)):
        return comb(popcount(c.candidates), c.k)  # all pairs linked: every k-set is a clique
    return sum(1 for _ in k_cliques(c.shape.adj, c.candidates, c.k))


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1e}" if ms >= 1e6 else f"{ms:,.0f}" if ms >= 100 else f"{ms:.3f}"


def fmt_ratio(r: float) -> str:
    return f"{r:.1e}x" if r >= 1e6 else f"{r:,.0f}x" if r >= 10 else f"{r:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-cap", type=int, default=20_000, help="most sets the exhaustive search ranks per run")
    args = ap.parse_args()
    header = f"{'case':<46} {'sets':>10} {'old ms':>12} {'new ms':>9} {'old/new':>12}  same  flagged"
    print(header)
    print("-" * len(header))
    for c in cases():
        total = admissible_sets(c)
        new = best_set(c.kind, c.shape, c.candidates, c.k, c.near)
        new_s = cpu_per_call(partial(best_set, c.kind, c.shape, c.candidates, c.k, c.near))
        if total <= args.old_cap:
            old = exhaustive_set(c.kind, c.shape, c.candidates, c.k, c.near)
            old_s = cpu_per_call(partial(exhaustive_set, c.kind, c.shape, c.candidates, c.k, c.near))
            mark, same = "", "yes" if old == new.mask else "NO"
        else:
            cap = args.old_cap
            part = cpu_per_call(partial(exhaustive_set, c.kind, c.shape, c.candidates, c.k, c.near, cap))
            old_s, mark, same = part * total / cap, "~", "n/a"
        ratio = old_s / new_s if new_s else float("inf")
        sets = f"{total:.1e}" if total >= 1e9 else f"{total:,}"
        print(
            f"{c.name:<46} {sets:>10} {mark + fmt_ms(old_s):>12} {fmt_ms(new_s):>9} "
            f"{mark + fmt_ratio(ratio):>12}  {same:<4}  {'yes' if new.truncated else 'no'}"
        )
    print("\ntargets: <= 1 ms for TP-8 on a 16-GPU NVSwitch node, <= 10 ms on a 64-GPU node (new ms column)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
