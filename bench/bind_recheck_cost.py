"""Bind's re-check of the rules filter applied, per member of a TP gang over NVL72 racks, in process: what the
ComputeDomain rules, the plan's node and tier set and the NVLink domain cap (read again from the trays' labels)
add to a bind.

`--racks` racks of 18 GB200 trays, every tray labelled `gputopo.io/nvlink-domain-cap: 16`, one gang of
`--members` 4-GPU members with `gputopo.io/tp-size: 16` (so the plan splits over racks under the cap). Each
member is filtered, then bound through the door; the binds' CPU is summed. Run once with the plan re-check
switched off (`Binder._plan_changed` answering '') and once as shipped, alternating `--rounds` times after a
warm-up of each. Prints the median CPU ms per bind of each and their ratio; printed, not asserted. No cluster,
no I/O but the fake's.

    .venv/bin/python bench/bind_recheck_cost.py                      # 64 racks (1,152 trays), 128 members
    .venv/bin/python bench/bind_recheck_cost.py --racks 8 --members 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness lives under tests/

from gputopo.extender.settings import Settings
from gputopo.extender.verbs.binder import Binder
from gputopo.model import HEALTHY_MASK, GpuFabric
from gputopo.systems import build_system
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, FakeClock, gputopo_pod, make_env, node_obj


def tray(name: str, rack: str) -> JSON:
    topo = build_system("gb200-tray", name)
    fabric = GpuFabric(state="completed", health_mask=HEALTHY_MASK)
    topo = topo.model_copy(update={"gpus": tuple(g.model_copy(update={"fabric": fabric}) for g in topo.gpus)})
    node = node_obj(name, None, topology_text=topo.to_annotation(), leaf=f"leaf-{rack}")
    node["metadata"]["labels"].update({"nvidia.com/gpu.clique": rack, "gputopo.io/nvlink-domain-cap": "16"})
    return node


def bind_ms(racks: int, members: int, recheck: bool) -> float:
    """CPU ms per bind of the gang's members."""
    shipped = Binder._plan_changed
    if not recheck:
        Binder._plan_changed = lambda *_a: ""  # type: ignore[method-assign]
    try:
        settings = Settings(namespace=NS, stale_after_seconds=10**6, reservation_timeout_seconds=10**6)
        with make_env(FakeSource(NS), FakeClock(), settings) as env:
            trays = [f"r{r:03d}-t{t:02d}" for r in range(racks) for t in range(18)]
            env.add_nodes(*(tray(n, n[:4]) for n in trays))
            tp = {"tp-size": "16"}
            size = str(members)
            pods = [gputopo_pod(f"m-{i}", 4, group="g", group_size=size, stage=str(i), **tp) for i in range(members)]
            env.add_pods(*pods)
            cpu = 0.0
            for pod in pods:
                (node,) = env.filter(pod, trays)["NodeNames"]
                start = time.process_time()
                error = env.bind(pod, node)
                cpu += time.process_time() - start
                assert error == "", error
            return cpu / members * 1000
    finally:
        Binder._plan_changed = shipped  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--racks", type=int, default=64)
    parser.add_argument("--members", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    bind_ms(args.racks, args.members, False), bind_ms(args.racks, args.members, True)  # warm-up
    offs, ons = [], []
    for _ in range(args.rounds):
        offs.append(bind_ms(args.racks, args.members, False))
        ons.append(bind_ms(args.racks, args.members, True))
    off, on = statistics.median(offs), statistics.median(ons)
    trays = args.racks * 18
    print(f"{args.members}-member TP-16 gang on {trays:,} trays, CPU ms per bind:")
    print(f"  without the plan re-check {off:.2f}, with it {on:.2f}: ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
