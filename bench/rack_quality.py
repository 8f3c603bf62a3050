"""Part 6 of bench/placement_quality.py: rack-scale NVLink (GB200 NVL72 racks beside H100 nodes).

Run alone: `.venv/bin/python bench/rack_quality.py` (about half a minute on 2 cores), or as part 6 of
`bench/placement_quality.py`.

The cluster: 8 `gb200-nvl72` racks (18 trays of 4 GPUs each, one NVLink domain per rack, the domain read
from the agent's fabric clique), racks a-d under one leaf and e-h under another, two racks with one tray
whose fabric reports degraded bandwidth; and 64 `dgx-h100` nodes under four leaves of 16. All under one
spine.

The jobs (seeded, in random order; each side asks `--load` times its GPUs):
- on the racks, groups of 4-GPU members with `gputopo.io/tp-size` 8, 16, 32 or 64 (one TP group is 2,
  4, 8 or 16 trays, consecutive stages), 1 to 4 TP groups each (data parallel), and pipelines bigger
  than a rack: TP 16 x 6 or 8 stages, TP 32 x 3 stages (24 or 32 trays); and 1-2 GPU pods, which
  strand a tray's other GPUs;
- for the H100 nodes, single 8-GPU TP-8 pods and pipelines of 2 or 4 stages x 8 GPUs (tp-size 8, so
  TP stays in a node), over InfiniBand, preferring one leaf.

Three policies on the same jobs: `gputopo` (the engine), `default` (kube-scheduler's LeastAllocated
and the device plugin, blind to annotations; see gputopo/sim/core.py), and `first-fit` (the engine for
everything but the TP groups that span trays, which go to NVLink domains in the order of their trays'
names, each member on the next tray that holds it: TP boundaries and balance ignored; the engine's node
check still refuses a 4-GPU member on a tray with a degraded GPU).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gputopo.clusterfile import JobSpec  # noqa: E402
from gputopo.engine.gang.groups import plan_group  # noqa: E402
from gputopo.engine.gang.plan import Assignment, GroupFailure, GroupPlan, Member, switches_of  # noqa: E402
from gputopo.engine.gang.tpgroups import DOMAIN, TpShape, straddle_gbps, tp_shape  # noqa: E402
from gputopo.engine.network.cost import domain_allreduce_seconds  # noqa: E402
from gputopo.engine.network.estimate import node_shape  # noqa: E402
from gputopo.engine.node.placement import evaluate_node  # noqa: E402
from gputopo.engine.state.scoring import ScoreWeights  # noqa: E402
from gputopo.engine.state.snapshot import NodeState, node_state, with_in_use  # noqa: E402
from gputopo.model import LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE  # noqa: E402
from gputopo.sim import EngineSetup, Measures, SimResult, simulate  # noqa: E402
from gputopo.sim.comm import tp_seconds  # noqa: E402
from gputopo.systems import build_rack, build_system  # noqa: E402
from gputopo.tiers import DEFAULT_TIERS, TierConfig  # noqa: E402

RACKS = "abcdefgh"
DEGRADED = {"nvl72-c": (7,), "nvl72-f": (12,)}  # rack -> trays whose GPU 2 reports degraded fabric bandwidth
H100_NODES = 64
TRAY_GPUS = 4
# (TP size, TP groups) of the rack jobs, and how often each comes: one TP group in one rack, data-parallel
# copies, and pipelines of TP groups bigger than one rack.
RACK_KINDS: tuple[tuple[int, int, int], ...] = (
    (8, 1, 3),
    (8, 2, 3),
    (8, 4, 2),
    (16, 1, 3),
    (16, 2, 2),
    (16, 4, 2),
    (32, 1, 2),
    (32, 2, 1),
    (64, 1, 1),
    (16, 6, 1),
    (16, 8, 1),
    (32, 3, 1),
)
SMALL_SHARE = 0.4  # of the rack side's jobs: 1-2 GPU pods
POLICIES = ("gputopo", "default", "first-fit")
SEEDS = 10  # mixes per run: one mix has a few dozen jobs


# --------------------------------------------------------------------------------------------------
# The cluster and the jobs


def rack_cluster() -> list[NodeState]:
    """8 GB200 NVL72 racks under two leaves, then 64 DGX H100 under four leaves, all under one spine."""
    nodes = []
    for r, letter in enumerate(RACKS):
        rack = f"nvl72-{letter}"
        labels = {LABEL_NETWORK_SPINE: "spine-0", LABEL_NETWORK_LEAF: f"leaf-rack-{r // 4}"}
        for name, topo in build_rack("gb200-nvl72", rack, degraded=DEGRADED.get(rack, ())):
            nodes.append(node_state(name, topo, labels=labels))
    for i in range(H100_NODES):
        name = f"h100-{i:03d}"
        labels = {LABEL_NETWORK_SPINE: "spine-0", LABEL_NETWORK_LEAF: f"leaf-h100-{i // 16}"}
        nodes.append(node_state(name, build_system("dgx-h100", name), labels=labels))
    return nodes


def _rack_job(rng: random.Random, i: int) -> JobSpec:
    if rng.random() < SMALL_SHARE:
        gpus = rng.choice([1, 1, 2])
        ann = {"gputopo.io/nvlink": "ignore" if gpus == 1 else "preferred"}
        return JobSpec(name=f"small{gpus}-{i}", gpus_per_pod=gpus, annotations=ann)
    tp, groups, _ = rng.choices(RACK_KINDS, weights=[w for _, _, w in RACK_KINDS])[0]
    pods = tp // TRAY_GPUS * groups
    return JobSpec(
        name=f"tp{tp}x{groups}-{i}", pods=pods, gpus_per_pod=TRAY_GPUS, annotations={"gputopo.io/tp-size": str(tp)}
    )


def _h100_job(rng: random.Random, i: int) -> JobSpec:
    if rng.random() < 0.5:
        return JobSpec(name=f"tp8-{i}", gpus_per_pod=8, annotations={"gputopo.io/nvlink": "required"})
    stages = rng.choice([2, 2, 4])
    ann = {"gputopo.io/tp-size": "8", "gputopo.io/network": "infiniband", "gputopo.io/preferred-tier": "leaf"}
    return JobSpec(name=f"tp8pp{stages}-{i}", pods=stages, gpus_per_pod=8, annotations=ann)


def rack_jobs(nodes: Sequence[NodeState], load: float, seed: int) -> list[JobSpec]:
    """Rack jobs asking `load` times the trays' GPUs and H100 jobs asking `load` times the H100s', shuffled."""
    rng = random.Random(seed)
    tray_gpus = sum(n.gpu_count for n in nodes if n.location.get(DOMAIN))
    h100_gpus = sum(n.gpu_count for n in nodes) - tray_gpus
    jobs: list[JobSpec] = []
    for budget, make in ((tray_gpus * load, _rack_job), (h100_gpus * load, _h100_job)):
        asked = 0
        while asked < budget:
            job = make(rng, len(jobs))
            jobs.append(job)
            asked += job.pods * job.gpus_per_pod
    rng.shuffle(jobs)
    return jobs


# --------------------------------------------------------------------------------------------------
# First-fit domain choice


def first_fit_domain(
    group: str, members: Sequence[Member], nodes: Sequence[NodeState], tiers: TierConfig, weights: ScoreWeights
) -> GroupPlan | GroupFailure:
    """A group whose TP groups span trays: NVLink domains in the order of their first tray's name, trays
    in name order, each member (stage order) on the next tray that holds it (the engine's node check, which
    refuses a member whose NVLink clique would hold a degraded GPU), TP boundaries, balance and the trays'
    fabric health ignored. Any other group: the engine's plan."""
    shape = tp_shape(members[0].request, [m.request.gpus for m in members])
    if not isinstance(shape, TpShape):
        return plan_group(group, members, nodes, tiers, weights)
    first: dict[str, str] = {}
    for n in nodes:
        d = n.location.get(DOMAIN)
        if d is not None and (d not in first or n.name < first[d]):
            first[d] = n.name
    trays = sorted(
        (n for n in nodes if n.location.get(DOMAIN)), key=lambda n: (first[n.location[DOMAIN] or ""], n.name)
    )
    staged = sorted(members, key=lambda m: (m.request.stage or 0, m.name))
    assignments: list[Assignment] = []
    at = 0
    for member in staged:
        while at < len(trays):
            outcome = evaluate_node(trays[at], member.request, weights)
            if outcome.fits:
                assignments.append(Assignment(member.name, member.request.stage or 0, trays[at], outcome))
                trays[at] = with_in_use(trays[at], frozenset(outcome.gpus), tiers)
                break
            at += 1
        else:
            return GroupFailure(group, f"group {group}: first fit found trays for {len(assignments)} of {len(members)}")
    return GroupPlan(group, tuple(assignments), switches_of(assignments, tiers))


def run_policy(nodes: list[NodeState], jobs: list[JobSpec], policy: str, seed: int) -> SimResult:
    planner = first_fit_domain if policy == "first-fit" else None
    sim_policy = "gputopo" if policy == "first-fit" else policy
    return simulate(
        nodes,
        jobs,
        sim_policy,
        DEFAULT_TIERS,
        seed,
        engine=EngineSetup(group_planner=planner),
        measures=Measures(exhaustive=False),
    )


# --------------------------------------------------------------------------------------------------
# Figures


@dataclass
class RackFigures:
    tp_groups: int = 0  # TP groups that span trays with every member placed
    in_one_domain: int = 0  # in one rack's NVLink domain, or on one node (its own NVLink)
    on_degraded: int = 0  # of those, with a member on a tray whose fabric is not healthy
    tp_seconds: list[float] = field(default_factory=list)
    split_gangs: int = 0  # placed rack groups whose members sit in 2+ NVLink domains (and only in domains)
    balanced: int = 0
    jobs: Counter[str] = field(default_factory=Counter)  # placed / partly / waiting
    stranded_trays: int = 0  # free GPUs on trays partly in use
    stranded_h100: int = 0  # free GPUs on H100 nodes partly in use
    cpu_s: float = 0.0
    decisions: int = 0


def tp_group_seconds(where: Sequence[tuple[NodeState, tuple[int, ...]]], tp: int, message: float) -> float:
    """One TP all-reduce of `message` over the group's GPUs: inside one NVLink domain at the domain's bus
    bandwidth, inside one node over its links, else over the members' NICs (one per GPU, shared by the
    members on a node), as gputopo.engine.gang.rack predicts a TP group straddling two domains."""
    domains = {node.location.get(DOMAIN) for node, _ in where}
    if len(domains) == 1 and None not in domains:
        return domain_allreduce_seconds(message, tp)
    if len({node.name for node, _ in where}) == 1:
        return tp_seconds(node_shape(where[0][0]), [g for _, gpus in where for g in gpus], message)
    sharing = Counter(node.name for node, _ in where)
    per_member = [straddle_gbps(node, len(gpus)) / sharing[node.name] for node, gpus in where]
    return domain_allreduce_seconds(message, tp, min(per_member))


def add_figures(f: RackFigures, result: SimResult, jobs: Sequence[JobSpec], cpu_s: float) -> None:
    """Add one run's figures to `f`."""
    f.cpu_s += cpu_s
    f.decisions += len(result.decisions)
    final = {n.name: n for n in result.final}
    where = {p.pod: (final[p.node], p.gpus) for p in result.placements}
    for job, pods in zip(jobs, result.jobs, strict=True):
        placed = [where.get(p.name) for p in pods]
        f.jobs["placed" if all(placed) else "partly" if any(placed) else "waiting"] += 1
        tp = pods[0].request.tp_size
        if tp is None or tp <= job.gpus_per_pod:
            continue
        k = tp // job.gpus_per_pod
        for t in range(len(pods) // k):
            members = placed[t * k : (t + 1) * k]
            if not all(members):
                continue
            on = [m for m in members if m is not None]
            f.tp_groups += 1
            domains = {n.location.get(DOMAIN) for n, _ in on}
            f.in_one_domain += (len(domains) == 1 and None not in domains) or len({n.name for n, _ in on}) == 1
            f.on_degraded += any(n.location.get(DOMAIN) and n.fabric.value != "healthy" for n, _ in on)
            f.tp_seconds.append(tp_group_seconds(on, tp, pods[0].request.message_bytes))
        shares = Counter(m[0].location.get(DOMAIN) for m in placed if m is not None)
        if all(placed) and len(shares) > 1 and None not in shares:
            f.split_gangs += 1
            f.balanced += max(shares.values()) - min(shares.values()) <= k
    for n in result.final:
        used, free = len(n.in_use), n.free_mask.bit_count()
        if used and free:
            if n.location.get(DOMAIN):
                f.stranded_trays += free
            else:
                f.stranded_h100 += free


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.1f}%)" if b else f"{a}/{b}"


def _mean_ms(f: RackFigures) -> str:
    return f"{statistics.fmean(f.tp_seconds) * 1e3:.2f}" if f.tp_seconds else "-"


def _ratio(a: RackFigures, b: RackFigures) -> str:
    if not a.tp_seconds or not b.tp_seconds:
        return "-"
    return f"{statistics.fmean(a.tp_seconds) / statistics.fmean(b.tp_seconds):.2f}"


def table(figs: dict[str, RackFigures]) -> list[str]:
    rows: list[tuple[str, list[str]]] = [
        (
            "jobs placed / partly placed / waiting",
            [f"{f.jobs['placed']}/{f.jobs['partly']}/{f.jobs['waiting']}" for f in figs.values()],
        ),
        ("TP groups in one NVLink domain (rack or node)", [pct(f.in_one_domain, f.tp_groups) for f in figs.values()]),
        ("TP groups touching a degraded tray", [str(f.on_degraded) for f in figs.values()]),
        ("split gangs balanced (of gangs over 2+ domains)", [pct(f.balanced, f.split_gangs) for f in figs.values()]),
        ("stranded GPUs: free on trays partly in use", [str(f.stranded_trays) for f in figs.values()]),
        ("  ... on H100 nodes partly in use", [str(f.stranded_h100) for f in figs.values()]),
        ("mean predicted TP all-reduce, ms (1 GiB)", [_mean_ms(f) for f in figs.values()]),
        ("CPU ms per decision", [f"{f.cpu_s / f.decisions * 1e3:.2f}" if f.decisions else "-" for f in figs.values()]),
    ]
    width = max(len(label) for label, _ in rows)
    colw = [max(len(p), *(len(cells[i]) for _, cells in rows)) for i, p in enumerate(figs)]
    out = ["  " + " " * width + "  " + "  ".join(f"{p:>{w}}" for p, w in zip(figs, colw, strict=True))]
    for label, cells in rows:
        out.append(f"  {label:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, colw, strict=True)))
    g = figs["gputopo"]
    out.append(
        f"  mean predicted TP all-reduce, gputopo/default {_ratio(g, figs['default'])}, "
        f"gputopo/first-fit {_ratio(g, figs['first-fit'])}"
    )
    return out


DEFINITIONS = (
    "  (a TP group: tp-size / 4 consecutive stages of a rack job, counted when all are placed; balanced: the",
    "   members per NVLink domain differ by at most one TP group; stranded: free GPUs on a node some of whose",
    "   GPUs are taken, which no whole-tray member (4 GPUs) or 8-GPU H100 pod can use; TP all-reduce: ring over",
    "   the TP group's GPUs, in one domain at 745 GB/s bus bandwidth, else over the trays' NICs (4 x NDR per",
    "   tray, shared by the members on a node), inside one node over its NVLink; CPU: simulate()'s process",
    "   time over its decisions)",
)


def section(load: float, seed: int, seeds: int = SEEDS) -> list[str]:
    """The figures of every policy, summed over the mixes of seeds `seed` .. `seed + seeds - 1`."""
    nodes = rack_cluster()
    mixes = [rack_jobs(nodes, load, s) for s in range(seed, seed + seeds)]
    trays = sum(1 for n in nodes if n.location.get(DOMAIN))
    rack_side = [j for jobs in mixes for j in jobs if j.gpus_per_pod <= TRAY_GPUS]
    kinds = Counter(j.annotations.get("gputopo.io/tp-size", "small") for j in rack_side)
    h100_jobs = sum(len(jobs) for jobs in mixes) - len(rack_side)
    out = [
        f"  {len(RACKS)} gb200-nvl72 racks ({trays} trays, {trays * TRAY_GPUS} GPUs; {len(DEGRADED)} trays with "
        f"degraded fabric) + {H100_NODES} dgx-h100 ({H100_NODES * 8} GPUs); each side asks {load:.2f}x its GPUs",
        f"  {seeds} mixes (seeds {seed}-{seed + seeds - 1}), figures summed; rack side "
        + ", ".join(f"{n} {'1-2 GPU pods' if k == 'small' else f'TP-{k}'}" for k, n in sorted(kinds.items(), key=_kind))
        + f" jobs; {h100_jobs} H100 jobs (TP-8 pods, TP-8 pipelines of 2-4 stages)",
    ]
    figs: dict[str, RackFigures] = {}
    for policy in POLICIES:
        t0 = time.perf_counter()
        f = figs[policy] = RackFigures()
        for s, jobs in enumerate(mixes, start=seed):
            c0 = time.process_time()
            result = run_policy(nodes, jobs, policy, s)
            add_figures(f, result, jobs, time.process_time() - c0)
        print(f"  ({policy}: {time.perf_counter() - t0:.1f} s wall)", flush=True)
    return out + table(figs) + list(DEFINITIONS)


def _kind(item: tuple[str, int]) -> int:
    return int(item[0]) if item[0].isdigit() else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--load", type=float, default=1.05, help="requested GPUs / GPUs, per side (default 1.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"mixes, one per seed (default {SEEDS})")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1, not {args.seeds}")
    print("== 6. Rack-scale NVLink: GB200 NVL72 racks beside H100 nodes")
    print("\n".join(section(args.load, args.seed, args.seeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
