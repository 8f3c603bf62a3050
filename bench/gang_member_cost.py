"""The extender's CPU per member of one big gang, in process: does a member cost more when its gang is bigger?

One Indexed Job of `--sizes` pods x 8 GPUs (no gputopo annotation: the group comes from the Job's labels and
its `spec.completions`) on `--nodes` DGX H100 nodes in `--leaves` leaves (8 leaves a spine), the extender's
listeners over the in-memory FakeSource (tests/extender/harness.py), every verb through the door as
kube-scheduler sends it. The pods arrive one by one, each filtered once as it comes (`arrival`: the group
incomplete, it waits; the last one's filter plans the group, counted apart as `plan`). Then each member in
turn: filter (naming every node kube-scheduler would still send: those no member is bound to), prioritize
(the nodes that passed), bind, then what the informers hand over after the bind (`informer`: the pod bound,
with its placement; the Job's status counting one more active pod).

Prints CPU ms per member by verb at each size side by side, and the ratio of the biggest size's to the
smallest's: flat (near 1.0) is the target, printed, not asserted. `--profile` instead runs the biggest size
alone under cProfile and writes its profile. No cluster, no I/O but the fake's.

    .venv/bin/python bench/gang_member_cost.py                         # 1,024 and 4,096 members, 5,000 nodes
    .venv/bin/python bench/gang_member_cost.py --sizes 256,1024 --nodes 1200 --leaves 38
    .venv/bin/python bench/gang_member_cost.py --profile /tmp/gang.prof
"""

from __future__ import annotations

import argparse
import cProfile
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness lives under tests/

from gputopo.extender.settings import Settings
from gputopo.model.jobs import JOB_COMPLETION_INDEX, JOB_NAME
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, FakeClock, make_env, node_obj, pod_obj

JOB = "pretrain"
GANG_NS = "bench-gang"
GPUS = 8
FLAT = 1.25  # the target: the biggest gang's CPU per member within this factor of the smallest's
VERBS = ("arrival", "filter", "prioritize", "bind", "informer")


def nodes(count: int, leaves: int) -> list[dict[str, Any]]:
    per_leaf = math.ceil(count / leaves)
    return [
        node_obj(f"gpu-{i:05d}", leaf=f"leaf-{i // per_leaf}", spine=f"spine-{i // per_leaf // 8}")
        for i in range(count)
    ]


def job(size: int, active: int = 0) -> dict[str, Any]:
    return {
        "metadata": {"name": JOB, "namespace": GANG_NS, "uid": "uid-job"},
        "spec": {"completions": size, "parallelism": size, "completionMode": "Indexed"},
        "status": {"active": active},
    }


def member(index: int) -> dict[str, Any]:
    pod = pod_obj(f"{JOB}-{index}", GPUS, {JOB_COMPLETION_INDEX: str(index)}, namespace=GANG_NS)
    pod["metadata"]["labels"] = {JOB_NAME: JOB, JOB_COMPLETION_INDEX: str(index), "app": "gang-scale"}
    return pod


@dataclass
class Figures:
    size: int
    plan_ms: float = 0.0  # the last pod's first filter: the whole group planned
    ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(VERBS, 0.0))  # summed
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERBS, 0))
    failures: int = 0

    def add(self, verb: str, seconds: float) -> None:
        self.ms[verb] += seconds * 1000
        self.calls[verb] += 1

    def per_member(self, verb: str) -> float:
        return self.ms[verb] / max(1, self.calls[verb])

    @property
    def total(self) -> float:
        return sum(self.per_member(v) for v in VERBS)


@contextmanager
def gang_env(size: int, node_count: int, leaves: int) -> Iterator[Env]:
    settings = Settings(namespace=NS, stale_after_seconds=1e9, reservation_timeout_seconds=1e9, metrics_port=0)
    with make_env(FakeSource(NS), FakeClock(), settings) as env:
        env.add_nodes(*nodes(node_count, leaves))
        env.source.put("jobs", job(size))
        env.resync()
        yield env


def run(size: int, node_count: int, leaves: int) -> Figures:
    """A `size`-member gang arriving pod by pod, then every member filtered, prioritized and bound in rank
    order; CPU per verb."""
    out = Figures(size)
    clock = time.process_time
    with gang_env(size, node_count, leaves) as env:
        free = [n["metadata"]["name"] for n in nodes(node_count, leaves)]  # what kube-scheduler still sends
        for i in range(size):  # each pod as the informer hands it over, and kube-scheduler's first try of it
            pod = env.source.put("pods", member(i))
            t0 = clock()
            env.cache.apply("pods", "ADDED", pod)
            env.filter(pod, free)  # the group incomplete: it waits; the last pod's plans the group
            if i < size - 1:
                out.add("arrival", clock() - t0)
            else:
                out.plan_ms = (clock() - t0) * 1000
        for i in range(size):
            pod = member(i)
            t0 = clock()
            passed = env.filter(pod, free)["NodeNames"] or []
            t1 = clock()
            if len(passed) != 1:
                out.failures += 1
                continue
            env.prioritize(pod, passed)
            t2 = clock()
            error = env.bind(pod, passed[0])
            t3 = clock()
            bound = env.source.get("pods", GANG_NS, pod["metadata"]["name"])
            t4 = clock()
            env.cache.apply("pods", "MODIFIED", bound or pod)
            env.cache.apply("jobs", "MODIFIED", job(size, active=i + 1))
            t5 = clock()
            out.failures += bool(error)
            free.remove(passed[0])
            for verb, dt in zip(VERBS[1:], (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
                out.add(verb, dt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="1024,4096", help="gang sizes, comma-separated (default 1024,4096)")
    ap.add_argument("--nodes", type=int, default=5000, help="nodes (default 5000)")
    ap.add_argument("--leaves", type=int, default=157, help="leaves, 8 under a spine (default 157)")
    ap.add_argument("--profile", type=Path, help="only profile the biggest size (cProfile), written here")
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if sizes[-1] > args.nodes:
        ap.error("a gang of 8-GPU members needs a node each: --nodes must hold the biggest size")
    if args.profile is not None:  # the profiler's own cost would skew the figures: a run of its own
        prof = cProfile.Profile()
        prof.runcall(run, sizes[-1], args.nodes, args.leaves)
        prof.dump_stats(str(args.profile))
        print(f"cProfile of {sizes[-1]} members written to {args.profile}")
        return
    figures = [run(size, args.nodes, args.leaves) for size in sizes]
    print(f"one Indexed Job of N x {GPUS}-GPU pods on {args.nodes} nodes in {args.leaves} leaves; CPU ms per member")
    print(f"{'members':<12}" + "".join(f"{f.size:>12}" for f in figures) + f"{'ratio':>10}")
    first, last = figures[0], figures[-1]
    for verb in VERBS:
        row = "".join(f"{f.per_member(verb):>12.3f}" for f in figures)
        print(f"{verb:<12}{row}{last.per_member(verb) / max(first.per_member(verb), 1e-9):>9.2f}x")
    print(f"{'per member':<12}" + "".join(f"{f.total:>12.3f}" for f in figures) + f"{last.total / first.total:>9.2f}x")
    print(f"{'plan (ms)':<12}" + "".join(f"{f.plan_ms:>12.0f}" for f in figures) + "   (the last pod's first filter)")
    print(f"{'not bound':<12}" + "".join(f"{f.failures:>12}" for f in figures))
    ratio = last.total / first.total
    verdict = "met" if ratio <= FLAT else "NOT met"
    print(f"target: per-member CPU within {FLAT:g}x from {first.size} to {last.size}: {verdict}")


if __name__ == "__main__":
    main()
