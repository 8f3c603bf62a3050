"""The simulator against the real kube-scheduler: the same job mix, pod by pod, on the same nodes.

Starts etcd, kube-apiserver, the real gputopo-extender and kube-scheduler with the chart's
KubeSchedulerConfiguration (`localcluster.Stack`), then per mix creates the mix's nodes as
simulated Nodes (the agent's annotations and a Lease each, CPU and memory in proportion to the GPUs)
and feeds its jobs one at a time, in order (`gputopo.localcluster.replay`). Before each job the engine
says what it would do in the state the real placements so far left (`gputopo.sim.fidelity.Follower`);
a pod agrees when it went to the engine's node or to one the engine scores equal, or when neither
places it. `gputopo simulate` also runs over each mix on its own, for its quality figures beside the
real run's (the same definitions, `gputopo.sim.metrics`), and the engine's own decisions with
kube-scheduler's tie-break, a random node among those the engine scores equal (`--tie-seeds`, offline).

Mixes: `examples` (examples/cluster.yaml + examples/jobs.yaml), `llm` (bench/placement_quality.py part
2), `alibaba` (the first `--pods` pods of bench/placement_quality.py part 1, on its 1,213 nodes) and
`rack` (bench/rack_quality.py's mix of seed `--seed`: GB200 NVL72 racks beside H100 nodes, TP groups
across trays).
The last line is `agreement N/M pods (P%)` over every pod fed. Every wait is bounded, each mix by
`--deadline` seconds (a mix cut short says so); everything listens on 127.0.0.1, and teardown stops
only the processes this script started.

    .venv/bin/python bench/sim_vs_real.py                    # every mix (about 10 min on 2 cores)
    .venv/bin/python bench/sim_vs_real.py --mix examples
    .venv/bin/python bench/sim_vs_real.py --quick            # a smaller llm and rack load, 200 Alibaba pods
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import placement_quality as pq  # noqa: E402  (beside this script)
import rack_quality  # noqa: E402  (beside this script)

from gputopo.clusterfile import JobSpec, cluster_states, load_cluster, load_jobs  # noqa: E402
from gputopo.engine.state.snapshot import NodeState  # noqa: E402
from gputopo.localcluster import ControlPlane, ControlPlaneError, KubeApiError, Lifetime, find_binaries  # noqa: E402
from gputopo.localcluster.replay import MixLimits, MixRun, Replay  # noqa: E402
from gputopo.localcluster.stack import Stack, StackTiming  # noqa: E402
from gputopo.sim import Measures, SimResult, Summary, simulate  # noqa: E402
from gputopo.sim.fidelity import follow_engine  # noqa: E402
from gputopo.tiers import DEFAULT_TIERS  # noqa: E402

MIXES = ("examples", "llm", "alibaba", "rack")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------- the mixes


def examples_mix() -> tuple[list[NodeState], list[JobSpec], str]:
    nodes = cluster_states(load_cluster(ROOT / "examples" / "cluster.yaml"))
    jobs = load_jobs(ROOT / "examples" / "jobs.yaml").jobs
    return nodes, jobs, "examples/cluster.yaml + examples/jobs.yaml"


def llm_mix(load: float, seed: int) -> tuple[list[NodeState], list[JobSpec], str]:
    nodes = pq.llm_cluster()
    jobs = pq.llm_jobs(sum(n.gpu_count for n in nodes), load, seed)
    return nodes, jobs, f"placement_quality.py part 2 (LLM training mix, load {load:g})"


def alibaba_mix(pods: int) -> tuple[list[NodeState], list[JobSpec], str]:
    nodes, _ = pq.alibaba_cluster()
    jobs = pq.alibaba_jobs(sum(n.gpu_count for n in nodes), 1.05)[:pods]
    return nodes, jobs, f"placement_quality.py part 1 (Alibaba v2023), the first {len(jobs)} pods"


def rack_mix(load: float, seed: int) -> tuple[list[NodeState], list[JobSpec], str]:
    nodes = rack_quality.rack_cluster()
    jobs = rack_quality.rack_jobs(nodes, load, seed)
    return nodes, jobs, f"rack_quality.py (placement_quality.py part 6), seed {seed}, load {load:g}"


# ----------------------------------------------------------------------------------- report


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.1f}%)" if b else f"{a}/{b}"


# Figure, how to read it from a summary, and whether it counts pods (so "within one pod" applies).
FIGURES: tuple[tuple[str, Callable[[Summary], float], bool], ...] = (
    ("pods placed", lambda s: s.pods_placed, True),
    ("multi-GPU pods on a full NVLink clique", lambda s: s.on_full_clique, True),
    ("groups placed in full", lambda s: s.groups_placed, True),
    ("groups within one leaf", lambda s: s.groups_within.get("leaf", 0), True),
    ("stranded GPUs", lambda s: s.stranded_gpus, True),
    ("est. communication time, s", lambda s: s.tp_allreduce_seconds + s.pp_transfer_seconds, False),
)


def figures_table(real: Summary, sim: Summary) -> tuple[list[str], bool]:
    """The quality figures side by side, and whether every pod count is within one pod."""
    lines = [f"  {'figure':<40} {'real':>10} {'simulator':>10} {'diff':>8}"]
    ok = True
    for label, get, counts in FIGURES:
        r, s = get(real), get(sim)
        if counts:
            ok = ok and abs(r - s) <= 1
            lines.append(f"  {label:<40} {r:>10.0f} {s:>10.0f} {r - s:>+8.0f}")
        else:
            lines.append(f"  {label:<40} {r:>10.3f} {s:>10.3f} {r - s:>+8.3f}")
    lines.append(f"  (of {real.pods} pods, {real.multi_gpu_pods} multi-GPU asking for NVLink, {real.groups} groups)")
    return lines, ok


def report_mix(run: MixRun, sim: SimResult, sim_s: float, what: str, ties: Sequence[Summary]) -> None:
    verdicts = run.verdicts
    n = len(verdicts)
    exact = sum(1 for v in verdicts if v.agrees and v.real is not None and v.real.node == v.engine_node)
    equal = sum(1 for v in verdicts if v.agrees and v.real is not None and v.real.node != v.engine_node)
    both_unplaced = sum(1 for v in verdicts if v.agrees and v.real is None)
    judged_gpus = [v for v in verdicts if v.same_gpus is not None]
    sim_node = {p.pod: p.node for p in sim.placements}
    same_as_sim = sum(1 for v in verdicts if (v.real.node if v.real else None) == sim_node.get(v.pod))
    print(f"\n== {run.name}: {what}")
    print(
        f"  {len(run.follower.initial)} nodes; {len(run.records)} of {run.jobs_total} jobs fed ({n} pods) in "
        f"{run.seconds:.0f} s real, {sim_s:.1f} s simulated" + ("" if run.complete else "  [deadline: cut short]")
    )
    for note in run.notes:
        print(f"  note: {note}")
    print(f"  agreement {pct(run.agreed, n)}: {exact} on the engine's node, {equal} on a node it scores equal,")
    print(f"    {both_unplaced} left unplaced by both; {n - run.agreed} differ")
    same_gpus = sum(v.same_gpus is True for v in judged_gpus)
    print(f"  on the engine's GPUs (where on its node or an equal one): {pct(same_gpus, len(judged_gpus))}")
    print(f"  on the same node as `gputopo simulate`'s own run: {pct(same_as_sim, n)}")
    differ = [v for v in verdicts if not v.agrees]
    for v in differ[:12]:
        where = f"{v.real.node} GPUs {list(v.real.gpus)}" if v.real else "unplaced"
        print(f"    differs: {v.pod}: real {where}; {v.note}")
    if len(differ) > 12:
        print(f"    ... and {len(differ) - 12} more")
    job_notes = [note for r in run.records for note in r.notes]
    for note in job_notes[:5]:
        print(f"  note: {note}")
    if len(job_notes) > 5:
        print(f"  ... and {len(job_notes) - 5} more notes")
    # The simulator's own run over exactly the jobs the real run was fed.
    lines, ok = figures_table(run.follower.summary(), sim.summary)
    print("  quality, real vs simulator:")
    print("\n".join(lines))
    print(f"  every pod count within one pod: {'yes' if ok else 'NO'}")
    if ties:
        # Where the figures differ while every pod agrees, kube-scheduler's random choice among nodes the
        # engine scores equal is what differs: the engine's own decisions with random tie-breaks.
        print(f"  the engine with random tie-breaks among equal nodes ({len(ties)} seeds), per figure:")
        for label, get, counts in FIGURES:
            vals = ", ".join(f"{get(t):.0f}" if counts else f"{get(t):.3f}" for t in ties)
            print(f"    {label:<40} {vals}")


# ----------------------------------------------------------------------------------- main


def code_origin(cp: ControlPlane, component: str) -> str:
    """Where the running extender's code comes from: its environment and working folder, resolved
    with the same interpreter (so a PYTHONPATH pointing at another tree shows up here)."""
    pid = cp.pid(component)
    if pid is None:
        return "not running"
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        cwd = os.readlink(f"/proc/{pid}/cwd")
        # The interpreter as invoked (the script's shebang: the venv's), not /proc/<pid>/exe, which
        # resolves the venv's symlink to the base interpreter and so loses the venv's packages.
        exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError as e:
        return f"unknown ({e})"
    env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    probe = "import gputopo.extender as e, gputopo.engine.state.scoring as s; print(e.__file__, s.__file__)"
    out = subprocess.run([exe, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    return f"pid {pid}, PYTHONPATH={env.get('PYTHONPATH', '')!r}: {out.stdout.strip() or out.stderr.strip()[-200:]}"


def run(args: argparse.Namespace) -> int:
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh first", file=sys.stderr)
        return 2
    mixes = MIXES if args.mix == "all" else (args.mix,)
    builders: dict[str, Callable[[], tuple[list[NodeState], list[JobSpec], str]]] = {
        "examples": examples_mix,
        "llm": lambda: llm_mix(0.5 if args.quick else args.load, args.seed),
        "alibaba": lambda: alibaba_mix(min(args.pods, 200) if args.quick else args.pods),
        "rack": lambda: rack_mix(0.5 if args.quick else args.load, args.seed),
    }
    t_start = time.monotonic()
    agreed = total = 0
    progress = say if args.verbose else None
    with ControlPlane(bin_dir, progress=progress, lifetime=Lifetime(keep=args.keep)) as cp:
        say(f"control plane up in {cp.dir}")
        kube = cp.client()
        stack = Stack(cp, kube, timing=StackTiming(stale_after_seconds=float(LEASE_STALE_S)), progress=progress)
        stack.start()
        say(f"bench code and chart: {ROOT}")
        say(f"extender code: {code_origin(cp, stack.pods[0].extender)}")
        replay = Replay(kube, stack, progress=progress)
        for name in mixes:
            nodes, jobs, what = builders[name]()
            say(f"mix {name}: {len(nodes)} nodes, {len(jobs)} jobs, {sum(j.pods for j in jobs)} pods")
            mix_run = replay.run_mix(name, nodes, jobs, MixLimits(deadline_s=args.deadline))
            fed = [j for j in jobs if any(r.job == j.name for r in mix_run.records)]
            t0 = time.perf_counter()
            sim = simulate(nodes, fed, "gputopo", DEFAULT_TIERS, args.seed, measures=Measures(exhaustive=False))
            sim_s = time.perf_counter() - t0
            ties = [follow_engine(nodes, fed, seed).summary() for seed in range(args.tie_seeds)]
            report_mix(mix_run, sim, sim_s, what, ties)
            agreed += mix_run.agreed
            total += len(mix_run.verdicts)
        kube.close()
    print(f"\ntotal wall time {time.monotonic() - t_start:.0f} s")
    print(f"agreement {agreed}/{total} pods ({100 * agreed / total if total else 0:.1f}%)")
    return 0


LEASE_STALE_S = 3600  # the extender's staleAfterSeconds: the Leases are renewed once, at creation


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The simulator against the real kube-scheduler and extender, pod by pod.")
    p.add_argument("--mix", choices=(*MIXES, "all"), default="all")
    p.add_argument("--pods", type=int, default=1000, help="pods of the Alibaba slice (default 1000)")
    p.add_argument("--load", type=float, default=1.05, help="the LLM and rack mixes' requested GPUs / GPUs (1.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="LLM and rack load 0.5, at most 200 Alibaba pods")
    p.add_argument(
        "--tie-seeds", type=int, default=3, help="seeds of the engine with random tie-breaks, offline (default 3)"
    )
    p.add_argument("--deadline", type=float, default=420.0, help="seconds per mix (default 420)")
    p.add_argument("--keep", action="store_true", help="keep the control plane's folder (logs) after teardown")
    p.add_argument("--verbose", action="store_true", help="show control-plane progress")
    args = p.parse_args(argv)
    if args.pods < 1 or args.deadline <= 0 or args.tie_seeds < 0:
        p.error("--pods and --deadline must be positive, --tie-seeds not negative")
    try:
        return run(args)
    except (ControlPlaneError, TimeoutError, KubeApiError) as e:
        print(f"sim_vs_real: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
