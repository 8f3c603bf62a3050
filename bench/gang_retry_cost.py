"""The extender's CPU for a gang that cannot be placed, in process: a retry round, and a filter beside
thousands of members whose selectors match nothing. Three switches of one tree, side by side in one run:

- `planned`: the group desk's `reuse` and `indexed` off (every filter plans again, selectors matched node
  by node: the references both are tested against), and the repeats below off;
- `kept`: a group's failed plan kept and told while nothing it read changed, selectors looked up in the
  label index; every filter still decodes its node names and builds and encodes its failure map;
- `after` (the default): `kept`, plus a filter's repeated node names decoded once and one reason for
  every node encoded once (gputopo/extender/verbs/repeats.py).

- `unplaceable`: one Indexed Job of `--members` pods x 8 GPUs (no annotation: the Job's labels and
  `spec.completions` make the group) on `--nodes` DGX H100 nodes, of which only members - 1 have 8 free
  GPUs: the gang never fits. Every member exists; then a retry round, each member filtered once over
  every node, as kube-scheduler retries an unschedulable gang. CPU seconds per round. `planned` costs a
  plan per member (about 80 ms at 4,096 members and 5,000 nodes): it times `--sample` members and
  multiplies by the members (the round itself would take minutes of a shared machine).
- `selectors`: one 8-GPU pod and members - 1 pods that ask no GPU, each with its own nodeSelector that
  matches no node, all of one annotated group: the GPU pod's filter (its first, which plans; then the
  next, once the failure is kept). `planned` is timed over `--sample-selectors` filters.

Targets (printed, not asserted): a retry round at most 5 s; the GPU pod's filter at most 50 ms.
No cluster, no I/O but the in-memory fake API server's. `--modes kept,after` leaves out the slow one.

    .venv/bin/python bench/gang_retry_cost.py                       # 4,096 members, 5,000 nodes
    .venv/bin/python bench/gang_retry_cost.py --modes kept,after    # the same, without `planned`
    .venv/bin/python bench/gang_retry_cost.py --members 512 --nodes 1000
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness lives under tests/

from gputopo.extender.settings import Settings
from gputopo.model.jobs import JOB_COMPLETION_INDEX, JOB_NAME
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, FakeClock, args, gputopo_pod, make_env, node_obj, pod_obj

JOB = "pretrain"
GANG_NS = "bench-gang"
GPUS = 8
ROUND_TARGET_S = 5.0
FILTER_TARGET_MS = 50.0


def nodes(count: int, free: int, leaves: int = 157) -> list[dict[str, Any]]:
    """`count` nodes, the first `free` with every GPU free, the rest with GPU 0 taken."""
    per_leaf = math.ceil(count / leaves)
    return [
        node_obj(
            f"gpu-{i:05d}",
            leaf=f"leaf-{i // per_leaf}",
            spine=f"spine-{i // per_leaf // 8}",
            in_use=None if i < free else [0],
        )
        for i in range(count)
    ]


def member(index: int) -> dict[str, Any]:
    pod = pod_obj(f"{JOB}-{index}", GPUS, {JOB_COMPLETION_INDEX: str(index)}, namespace=GANG_NS)
    pod["metadata"]["labels"] = {JOB_NAME: JOB, JOB_COMPLETION_INDEX: str(index)}
    return pod


def job(size: int) -> dict[str, Any]:
    return {
        "metadata": {"name": JOB, "namespace": GANG_NS, "uid": "uid-job"},
        "spec": {"completions": size, "parallelism": size, "completionMode": "Indexed"},
        "status": {"active": 0},
    }


def _env() -> Any:
    settings = Settings(namespace=NS, stale_after_seconds=1e9, reservation_timeout_seconds=1e9, metrics_port=0)
    return make_env(FakeSource(NS), FakeClock(), settings)


MODES = ("planned", "kept", "after")


def _mode(env: Env, mode: str) -> None:
    ext = env.extender
    ext.groups.reuse = ext.groups.indexed = mode != "planned"
    if mode != "after":
        ext.repeated = ext.reasons = None


def _filter(env: Env, pod: dict[str, Any], names: list[str]) -> tuple[float, dict[str, Any], bytes]:
    """One filter through the door, as kube-scheduler sends it: the CPU seconds of the extender's answer
    alone (the request encoded before, the answer read after), the answer and its bytes."""
    body = orjson.dumps(args(pod, names))
    t = time.process_time()
    status, out = env.door.answer("filter", body)
    spent = time.process_time() - t
    assert status == 200, out
    answer: dict[str, Any] = orjson.loads(out)
    return spent, answer, out


def unplaceable(members: int, node_count: int, sample: int, mode: str) -> tuple[float, float, int, str]:
    """CPU seconds of a retry round (every member filtered once), the CPU ms of the first filter of the
    round (the one that plans), the members that passed a node (0: the gang never fits), and a digest of
    the first `sample` members' answers (every mode's must be the same bytes)."""
    with _env() as env:
        _mode(env, mode)
        env.add_nodes(*nodes(node_count, members - 1))
        env.source.put("jobs", job(members))
        env.resync()
        pods = [env.source.put("pods", member(i)) for i in range(members)]
        for pod in pods:
            env.cache.apply("pods", "ADDED", pod)
        names = list(env.cache.nodes)
        timed = pods[:sample] if mode == "planned" else pods
        passed, spent, first = 0, 0.0, 0.0
        digest = hashlib.sha256()
        for i, pod in enumerate(timed):
            spent_here, out, raw = _filter(env, pod, names)
            spent += spent_here
            if i < sample:
                digest.update(raw)
            passed += bool(out["NodeNames"])
            if i == 0:
                first = spent_here
        return spent * members / len(timed), first * 1000, passed, digest.hexdigest()[:12]


def selectors(members: int, node_count: int, sample: int, mode: str) -> tuple[float, float, str]:
    """CPU ms of the GPU pod's first filter and the mean of its next `sample` filters, and what it was told."""
    with _env() as env:
        _mode(env, mode)
        env.add_nodes(*nodes(node_count, node_count))
        size = str(members)
        gpu_pod = gputopo_pod("gpu-pod", GPUS, group="crowd", group_size=size)
        for i in range(1, members):
            pod = gputopo_pod(f"idle-{i}", 0, group="crowd", group_size=size)
            pod["spec"]["nodeSelector"] = {"example.com/slot": f"s-{i}"}
            env.cache.apply("pods", "ADDED", env.source.put("pods", pod))
        env.cache.apply("pods", "ADDED", env.source.put("pods", gpu_pod))
        names = list(env.cache.nodes)

        def once() -> tuple[float, dict[str, Any]]:
            spent, out, _ = _filter(env, gpu_pod, names)
            return spent * 1000, out

        first, out = once()
        told = next(iter(set(out["FailedNodes"].values()) or {"(passed)"}))
        rest = [once()[0] for _ in range(sample)]
        return first, statistics.mean(rest), told


def _row(label: str, values: list[float], fmt: str) -> str:
    return f"{label:<38}" + "".join(f"{v:>13{fmt}}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--members", type=int, default=4096, help="gang members (default 4096)")
    ap.add_argument("--nodes", type=int, default=5000, help="nodes (default 5000)")
    ap.add_argument("--sample", type=int, default=32, help="members timed for `planned`'s round (default 32)")
    ap.add_argument("--sample-selectors", type=int, default=3, help="`planned` filters of the GPU pod (default 3)")
    ap.add_argument("--modes", default=",".join(MODES), help="which of planned,kept,after to run (default all)")
    args = ap.parse_args()
    modes = [m for m in MODES if m in args.modes.split(",")]
    if args.members > args.nodes:
        ap.error("--nodes must hold --members (members - 1 nodes are left free)")
    if not modes:
        ap.error(f"--modes names none of {', '.join(MODES)}")
    say: Callable[[str], None] = print
    head = f"{'':<38}" + "".join(f"{m:>13}" for m in modes)
    say(f"unplaceable gang: {args.members} x {GPUS}-GPU members, {args.nodes} nodes ({args.members - 1} free)")
    rounds = [unplaceable(args.members, args.nodes, args.sample, m) for m in modes]
    say(head)
    say(_row("CPU s per retry round", [r[0] for r in rounds], ".2f"))
    say(_row("ms per member filter", [r[0] * 1000 / args.members for r in rounds], ".3f"))
    say(_row("ms of the filter that plans", [r[1] for r in rounds], ".1f"))
    say(_row("members that passed a node", [r[2] for r in rounds], "d"))
    say(_row("round's CPU / the last column's", [r[0] / rounds[-1][0] for r in rounds], ".1f"))
    say(f"{'answers to the first ' + str(args.sample):<38}" + "".join(f"{r[3]:>13}" for r in rounds))
    verdict = "met" if rounds[-1][0] <= ROUND_TARGET_S else "NOT met"
    say(f"target: a retry round at most {ROUND_TARGET_S:g} s of extender CPU ({modes[-1]}): {verdict}")
    say("")
    say(f"selectors: one {GPUS}-GPU pod beside {args.members - 1} members asking no GPU, selectors matching nothing")
    filters = [selectors(args.members, args.nodes, args.sample_selectors, m) for m in modes]
    say(head)
    say(_row("first filter ms (plans)", [f[0] for f in filters], ".1f"))
    say(_row("next filters ms (mean)", [f[1] for f in filters], ".2f"))
    say(f"told: {filters[-1][2][:160]}")
    verdict = "met" if max(filters[-1][:2]) <= FILTER_TARGET_MS else "NOT met"
    say(f"target: the GPU pod's filter at most {FILTER_TARGET_MS:g} ms ({modes[-1]}): {verdict}")


if __name__ == "__main__":
    main()
