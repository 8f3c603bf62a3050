"""CPU time of `gputopo simulate`'s comparison with the exhaustive optimum: the search that permuted every
symmetry of a node (before, kept as tests/sim/exhaustive_reference.py) against the one that counts
interchangeable GPUs by class (after, gputopo.sim.exhaustive), side by side.

Run: `.venv/bin/python bench/exhaustive_cost.py` (about 4 minutes on 2 cores, most of it the old search;
`--only NAME` runs the cases whose name contains NAME).

Rows: for every named system, a small instance (3 nodes over two leaves, some GPUs in use; 5 pods: a
TP-2, a TP-4, a plain 1-GPU pod and a pair of 1-GPU stages) and the largest the check accepts (6 nodes,
3 per leaf; 8 pods: a TP-2, a TP-4, a plain 1-GPU pod, an `nvlink: ignore` 3-GPU pod, a `spread: node`
pair of TP-2s and a pair of 1-GPU stages that may share a node), then single larger nodes beyond the
named systems. Each search runs in a child process of its own (cold caches), timed there with
`time.process_time` around the search alone; "simulate s" is the whole `simulate` call (policy and
summary included) with the new search. The old search runs only on nodes of at most `--old-max-gpus`
GPUs (it enumerates up to n! permutations before counting any budget) and is stopped after
`--old-timeout` seconds. "result": jobs placed, communication ms, and `*` where the budget ran out
(best found so far).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gputopo.clusterfile import JobSpec  # noqa: E402
from gputopo.engine.state.snapshot import NodeState, node_state  # noqa: E402
from gputopo.model import NodeTopology  # noqa: E402
from gputopo.sim import exhaustive, prepare_pods, simulate  # noqa: E402
from gputopo.systems import SYSTEMS, VARIANTS, build_system  # noqa: E402
from gputopo.tiers import DEFAULT_TIERS  # noqa: E402
from tests.sim import exhaustive_reference  # noqa: E402
from tests.sim.helpers import job, node  # noqa: E402
from tests.sim.large_nodes import bridged_pairs, nvswitch, pcie  # noqa: E402

MSG = 64 * 2**20
Case = tuple[Callable[[], list[NodeState]], list[JobSpec], int]  # nodes, jobs, GPUs per node

SMALL_JOBS = [job("tp2", 2), job("tp4", 4, nvlink="preferred"), job("one", 1, plain=True), job("pp", 1, pods=2)]
CHECK_JOBS = [
    job("tp2", 2),
    job("tp4", 4, nvlink="preferred"),
    job("one", 1, plain=True),
    job("any3", 3, nvlink="ignore"),
    job("pp-spread", 2, pods=2, spread="node"),
    job("pp", 1, pods=2, nvlink="preferred"),
]
IN_USE: list[tuple[int, ...]] = [(), (1,), (0, 3), (), (2,), (0, 1)]


def _system_nodes(system: str, count: int) -> list[NodeState]:
    return [node(f"n{i}", system, leaf=f"l{i * 2 // count}", in_use=IN_USE[i]) for i in range(count)]


def _one(topology_of: Callable[[], NodeTopology], name: str) -> Callable[[], list[NodeState]]:
    return lambda: [node_state(name, topology_of(), labels={"gputopo.io/network-leaf": "l1"})]


def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    for system in sorted([*SYSTEMS, *VARIANTS]):
        gpus = len(build_system(system).gpus)
        out[f"{system}: 3 nodes, 5 pods"] = (partial(_system_nodes, system, 3), SMALL_JOBS, gpus)
        out[f"{system}: 6 nodes, 8 pods"] = (partial(_system_nodes, system, 6), CHECK_JOBS, gpus)
    for n in (8, 9, 10, 16):
        out[f"1-GPU pod, {n}-GPU PCIe node, one NUMA node"] = (_one(partial(pcie, n), "pcie"), [job("one", 1)], n)
    mix = [job("one", 1, plain=True), job("tp4", 4, nvlink="ignore"), job("tp8", 8, nvlink="ignore"), job("tp3", 3)]
    out["4 jobs, 16-GPU PCIe node, one NUMA node"] = (_one(lambda: pcie(16), "pcie16"), mix, 16)
    big = [job("tp8", 8), job("pp", 32, pods=2, spread="node"), job("tp16", 16), job("one", 1)]
    out["4 jobs (5 pods), two 64-GPU NVSwitch nodes"] = (
        lambda: [node_state(f"nv{i}", nvswitch(64), labels={"gputopo.io/network-leaf": "l1"}) for i in range(2)],
        big,
        64,
    )
    pairs = [job(f"tp2-{i}", 2) for i in range(6)] + [job("tp3", 3)]
    out["7 pods, 64-GPU PCIe node, 32 bridged pairs"] = (_one(lambda: bridged_pairs(64), "bridged"), pairs, 64)
    return out


def run_one(name: str, impl: str) -> dict[str, object]:
    """One search in this process: its CPU seconds and result (and the whole simulate call's, new only)."""
    make_nodes, jobs, _ = cases()[name]
    nodes = make_nodes()
    pods = prepare_pods(jobs)
    start = time.process_time()
    if impl == "old":
        old = exhaustive_reference.best_placement(nodes, pods, DEFAULT_TIERS, MSG, MSG)
        placed, comm, complete = old.jobs_placed, old.seconds, old.complete
    else:
        new = exhaustive.best_placement(nodes, pods, DEFAULT_TIERS, MSG, MSG)
        placed, comm, complete = new.jobs_placed, new.seconds, new.complete
    seconds = time.process_time() - start
    out: dict[str, object] = {"s": seconds, "result": f"{placed} / {comm * 1e3:.3f}{'' if complete else '*'}"}
    if impl == "new":
        start = time.process_time()
        simulate(make_nodes(), jobs, "gputopo", DEFAULT_TIERS)
        out["simulate_s"] = time.process_time() - start
    return out


def _child(name: str, impl: str, timeout: float) -> dict[str, object] | None:
    cmd = [sys.executable, __file__, "--case", name, "--impl", impl]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    got: dict[str, object] = json.loads(done.stdout)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-max-gpus", type=int, default=10, help="run the old search on nodes of at most this many")
    ap.add_argument("--old-timeout", type=float, default=120.0, help="stop the old search after this many seconds")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=("old", "new"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_one(args.case, args.impl)))
        return 0
    header = f"{'case':<46} {'before s':>9} {'result':>13} {'after s':>8} {'result':>13} {'simulate s':>10}  same"
    print(header)
    print("-" * len(header))
    for name, (_, _, gpus) in cases().items():
        if args.only not in name:
            continue
        new = _child(name, "new", 600)
        assert new is not None
        if gpus > args.old_max_gpus:
            old_s, old_result, same = "not run", "", "n/a"
        else:
            old = _child(name, "old", args.old_timeout)
            if old is None:
                old_s, old_result, same = f">{args.old_timeout:.0f}", "", "n/a"
            else:
                old_s, old_result = f"{old['s']:.2f}", str(old["result"])
                same = "yes" if old_result == new["result"] else "old cut" if old_result.endswith("*") else "NO"
        print(
            f"{name:<46} {old_s:>9} {old_result:>13} {new['s']:>8.2f} {new['result']!s:>13} "
            f"{new['simulate_s']:>10.2f}  {same}"
        )
    print("\nresult: jobs placed / communication ms of the best placement (* budget reached: best found so far);")
    print("old cut: the results differ because the old search's budget (100,000 options) ran out first")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
