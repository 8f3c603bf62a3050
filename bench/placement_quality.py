"""Placement quality of gputopo against what Kubernetes does today, on real and synthetic clusters.

Run: `.venv/bin/python bench/placement_quality.py` (a few minutes on 2 cores; `--quick` for less).

Three parts, each printed with the three policies side by side (`gputopo`, `default`, `random`; see
gputopo/sim/core.py and docs/simulator.md for what each policy does and what each figure means):

1. **Alibaba v2023 replay.** The 1,213 GPU nodes of `openb_node_list_gpu_node.csv` as the cluster and
   the pods of `openb_pod_list_multigpu50.csv` as arrivals, in file order (the file has no times):
   0-GPU pods are skipped, fractional-GPU pods (`gpu_milli` < 1000) count as 1 GPU, and the list is cut
   where the requested GPUs first reach `--load` times the cluster's GPUs (default 1.05, so the
   cluster fills and a queue is left). The trace says nothing about what the pods need from the links,
   so every multi-GPU pod is annotated `gputopo.io/nvlink: preferred` (placed with or without a
   clique, so all three policies face the same feasibility by GPU count) and every 1-GPU pod
   `gputopo.io/nvlink: ignore` (it opts in, as on a cluster that runs gputopo for all GPU pods).

   The trace has no link layout; each (GPU model, GPUs per node) maps to a named system:

   | trace model x GPUs       | system used                                                           |
   |--------------------------|-----------------------------------------------------------------------|
   | V100M32 x8, V100M16 x8   | `dgx-1v` (hybrid cube mesh; V100M16 gets 16 GB HBM)                   |
   | G2 x8                    | `dgx-a100` (NVSwitch, NV12): an assumption, the code is undisclosed   |
   | G3 x8                    | `dgx-h100` (NVSwitch, NV18): an assumption, the code is undisclosed   |
   | V100M32 x4, V100M16 x4   | one quad of `dgx-1v` (GPUs 0-3: a full NVLink clique of NV1/NV2)      |
   | V100M16 x1               | one GPU of `dgx-1v` (no NVLink)                                       |
   | T4, P100, A10 x1/x2/x4   | `l40s-4` trimmed to the GPU count, PCIe only, with the model's HBM     |

   G2 and G3 are Alibaba's internal codes for GPU types it does not name. G2 boxes are the bulk of
   the fleet (549 of 1,213 nodes) and G3 a small newer set (39); both are 8-GPU, so both are given
   NVSwitch layouts, the A100 generation for the bulk and the H100 generation for the newer set.
   Treat the G2/G3 mapping as a modelling choice, not a fact. P100 boxes are modelled as PCIe cards
   (the trace does not say SXM2), T4 and A10 have no NVLink at all.

   Network: every node gets `gputopo.io/network-spine` = PSW and `gputopo.io/network-leaf` = ASW of a
   host of the Lingjun 2023 `topo.csv` (spine = PSW, leaf = (PSW, ASW)), cycling through the 847 hosts
   in file order (node i gets host i mod 847).

2. **Synthetic LLM training mix** on an all-NVSwitch InfiniBand cluster: 192 `dgx-h100` and 64
   `hgx-h200` nodes on the first 256 hosts of `topo.csv` sorted by (PSW, ASW) (whole racks). Jobs
   (seeded): TP-8, TP-4 and TP-2 single pods (`nvlink: required`), and pipeline groups of 2, 4, 8 or
   16 stages of 8 GPUs with `network: infiniband` and `preferred-tier: leaf`, a third of them also
   `required-tier: spine`; the total asks for `--load` times the cluster's GPUs.

   Under each mix, the same jobs placed as DRA would place them (gputopo/sim/dra.py): the claim each
   pod gets under one of three encodings (`none`: KEP-5004's `nvidia.com/gpu: N`, no constraint;
   `partitions`: the scalar `nvlinkPartition0..3` firstAvailable list; `list`: one `matchAttribute`
   on the `nvlinkCliques` list, KEP-5491), the GPUs kube-scheduler's allocator picks (first fit in
   slice order), and two node choices: the engine's (the extender ranks, the allocator picks the
   GPUs) beside the device-plugin `gputopo` column, and kube-scheduler's alone beside `default`:
   1.34 scores no DRA device (the first node by name where the claim fits stands for its random
   pick among ties), 1.35+ prefers nodes that meet an earlier `firstAvailable` subrequest.

2b. **NVLink islands** (only with the DRA columns): 64 `dgx-1v` and 64 `a100-pcie-bridged` nodes,
   where NVLink reaches only part of a node and cliques overlap (DGX-1V). Jobs (seeded): 1-GPU
   pods (45%), TP-2 (35%) and TP-4 (20%), two in three `nvlink: required`, the rest `preferred`;
   the total asks for `--load` times the cluster's GPUs.

5. **Fabric packing** (printed after part 2b): mixes at `--fabric-load` (0.6) of the LLM cluster, so room is
   left, placed by gputopo, by gputopo before fabric-level best fit (ties by node name, groups by score) and
   by the default policy; per tier, the largest free domain and the domains left empty, how many copies of
   the mix's largest job still fit, and how many gangs that need one leaf (as many 8-GPU nodes as the
   smallest and as the most common leaf has) still fit. Once with the cluster's node names in fabric order
   and once shuffled, since a name tie-break fills leaf by leaf only by accident of naming.

3. **Decision time** at scale: one 8-GPU decision (`evaluate_pod` + `rank`) over 5,000 nodes of mixed
   named systems with random in-use GPUs and Lingjun switch labels, and one 32-stage group plan
   (`plan_group`) over the same nodes; printed against the targets (20 ms and 200 ms), not asserted.

4. **DRA clique encodings per named system**: the maximal NVLink cliques, the scalar partitions that
   hold them all, the cliques the 4 published partitions leave out, and for k = 2, 4, 8 the share of
   the node's fully connected k-sets a claim can ask for under each encoding (two synthetic layouts
   at the end show what the partitions lose when cliques overlap more than on DGX-1V).

6. **Rack-scale NVLink** (bench/rack_quality.py, printed last): GB200 NVL72 racks beside H100 nodes, TP
   groups of 8-64 GPUs over 4-GPU trays and pipelines bigger than a rack, placed by gputopo, the default
   policy and a first-fit NVLink-domain choice; TP groups in one domain, balanced splits, stranded GPUs
   and the predicted TP all-reduce.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import rack_quality  # noqa: E402  (beside this script)

from gputopo.clusterfile import JobSpec  # noqa: E402
from gputopo.engine.gang.groups import plan_group  # noqa: E402
from gputopo.engine.gang.plan import GroupFailure, Member  # noqa: E402
from gputopo.engine.network.domains import domain_free, domain_of, free_gpus  # noqa: E402
from gputopo.engine.node.placement import evaluate_pod, rank  # noqa: E402
from gputopo.engine.state.snapshot import NodeState, node_state, with_in_use  # noqa: E402
from gputopo.model import (  # noqa: E402
    LABEL_NETWORK_LEAF,
    LABEL_NETWORK_SPINE,
    GpuInfo,
    NodeTopology,
    NvlinkInfo,
    parse_pod_request,
)
from gputopo.sim import EngineSetup, Measures, SimResult, simulate  # noqa: E402
from gputopo.sim.core import prepare_pods  # noqa: E402
from gputopo.sim.dra import NodeChoice, expressiveness, simulate_dra  # noqa: E402
from gputopo.sim.draallocator import ENCODINGS, Encoding  # noqa: E402
from gputopo.sim.drachurn import MODES, Arrival, simulate_churn  # noqa: E402
from gputopo.sim.drachurn import NodeChoice as ChurnNodeChoice  # noqa: E402
from gputopo.systems import SYSTEMS, build_system  # noqa: E402
from gputopo.tiers import DEFAULT_TIERS  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
NODES_CSV = DATA / "alibaba-gpu-v2023" / "openb_node_list_gpu_node.csv"
PODS_CSV = DATA / "alibaba-gpu-v2023" / "openb_pod_list_multigpu50.csv"
DEFAULT_PODS_CSV = DATA / "alibaba-gpu-v2023" / "openb_pod_list_default.csv"  # has creation and deletion times
TOPO_CSV = DATA / "alibaba-lingjun-2023" / "topo.csv"

POLICIES = ("gputopo", "default", "random")

# HBM per GPU as nvidia-smi reports it (MiB), and the name it shows.
PCIE_MODELS = {
    "T4": ("Tesla T4", 15360),
    "P100": ("Tesla P100-PCIE-16GB", 16280),
    "A10": ("NVIDIA A10", 23028),
}


# --------------------------------------------------------------------------------------------------
# Topologies for the trace's node models


def trim(
    topo: NodeTopology, keep: Sequence[int], model: str | None = None, memory_mib: int | None = None
) -> NodeTopology:
    """The same system cut down to GPUs `keep` (renumbered 0..), optionally with another GPU model."""
    gpus = tuple(
        GpuInfo(
            index=new,
            uuid=topo.gpus[old].uuid,
            model=model or topo.gpus[old].model,
            memory_mib=memory_mib or topo.gpus[old].memory_mib,
            pci_bus_id=topo.gpus[old].pci_bus_id,
            numa_node=topo.gpus[old].numa_node,
        )
        for new, old in enumerate(keep)
    )
    links = tuple(tuple(topo.link_count(a, b) for b in keep) for a in keep)
    nics = tuple(
        nic.model_copy(update={"gpu_affinity": tuple(nic.gpu_affinity[g] for g in keep)})
        for nic in topo.nics
        if nic.gpu_affinity and min(nic.gpu_affinity[g].rank for g in keep) <= 1  # PIX/PXB to a kept GPU
    ) or tuple(nic.model_copy(update={"gpu_affinity": tuple(nic.gpu_affinity[g] for g in keep)}) for nic in topo.nics)
    nvlink = NvlinkInfo(
        generation=topo.nvlink.generation if any(any(r) for r in links) else 0,
        gbps_per_link=topo.nvlink.gbps_per_link if any(any(r) for r in links) else 0.0,
        nvswitch=topo.nvlink.nvswitch,
        links=links,
    )
    return NodeTopology(gpus=gpus, nvlink=nvlink, nics=nics)


def trace_topology(model: str, gpus: int) -> tuple[str, NodeTopology]:
    """(description, topology) for one trace node model; see the module docstring for the mapping."""
    if model in ("V100M32", "V100M16"):
        mem = 32768 if model == "V100M32" else 16384
        name = f"Tesla V100-SXM2-{mem // 1024}GB"
        base = build_system("dgx-1v")
        if gpus == 8:
            return "dgx-1v", trim(base, range(8), name, mem)
        if gpus == 4:
            return "dgx-1v quad 0-3", trim(base, range(4), name, mem)
        return f"dgx-1v, {gpus} GPU(s), no NVLink", trim(base, [0, 4, 1, 5][:gpus], name, mem)
    if model == "G2" and gpus == 8:
        return "dgx-a100 (assumed)", build_system("dgx-a100")
    if model == "G3" and gpus == 8:
        return "dgx-h100 (assumed)", build_system("dgx-h100")
    if model in PCIE_MODELS and gpus <= 4:
        name, mem = PCIE_MODELS[model]
        return f"l40s-4 trimmed to {gpus}, PCIe only", trim(build_system("l40s-4"), range(gpus), name, mem)
    raise ValueError(f"no mapping for {gpus}x {model}")


def lingjun_hosts(sort: bool = False) -> list[tuple[str, str]]:
    with TOPO_CSV.open() as f:
        rows = [(r["PSW"], r["ASW"], r["ip"]) for r in csv.DictReader(f)]
    if sort:
        rows.sort()
    return [(psw, asw) for psw, asw, _ in rows]


def labels_for(host: tuple[str, str]) -> dict[str, str]:
    return {LABEL_NETWORK_SPINE: host[0], LABEL_NETWORK_LEAF: host[1]}


# --------------------------------------------------------------------------------------------------
# Workloads


def alibaba_cluster() -> tuple[list[NodeState], dict[str, tuple[str, int]]]:
    hosts = lingjun_hosts()
    cache: dict[tuple[str, int], tuple[str, NodeTopology]] = {}
    mapping: dict[str, tuple[str, int]] = {}
    nodes = []
    with NODES_CSV.open() as f:
        for i, r in enumerate(csv.DictReader(f)):
            key = (r["model"], int(r["gpu"]))
            if key not in cache:
                cache[key] = trace_topology(*key)
            desc, topo = cache[key]
            label = f"{key[0]} x{key[1]}"
            mapping[label] = (desc, mapping.get(label, (desc, 0))[1] + 1)
            nodes.append(node_state(r["sn"], topo, labels=labels_for(hosts[i % len(hosts)])))
    return nodes, mapping


def alibaba_jobs(capacity: int, load: float) -> list[JobSpec]:
    jobs = []
    asked = 0
    with PODS_CSV.open() as f:
        for r in csv.DictReader(f):
            gpus = int(r["num_gpu"])
            if gpus == 0:
                continue
            # Every GPU pod opts in, as on a cluster running gputopo (e.g. through its webhook): a
            # 1-GPU pod needs no NVLink, but gputopo still picks the GPU that fragments least.
            ann = {"gputopo.io/nvlink": "preferred" if gpus > 1 else "ignore"}
            jobs.append(JobSpec(name=r["name"], pods=1, gpus_per_pod=gpus, annotations=ann))
            asked += gpus
            if asked >= capacity * load:
                break
    return jobs


def llm_cluster() -> list[NodeState]:
    hosts = lingjun_hosts(sort=True)[:256]
    h100, h200 = build_system("dgx-h100"), build_system("hgx-h200")
    return [
        node_state(f"gpu-{i:03d}", h200 if i % 4 == 3 else h100, labels=labels_for(host))
        for i, host in enumerate(hosts)
    ]


def llm_jobs(capacity: int, load: float, seed: int) -> list[JobSpec]:
    rng = random.Random(seed)
    jobs: list[JobSpec] = []
    asked = 0
    while asked < capacity * load:
        i = len(jobs)
        r = rng.random()
        if r < 0.70:
            gpus = rng.choice([8, 8, 8, 4, 4, 2])
            jobs.append(JobSpec(name=f"tp{gpus}-{i}", gpus_per_pod=gpus, annotations={"gputopo.io/nvlink": "required"}))
            asked += gpus
        else:
            stages = rng.choice([2, 2, 4, 4, 8, 16])
            ann = {"gputopo.io/network": "infiniband", "gputopo.io/preferred-tier": "leaf"}
            if rng.random() < 1 / 3:
                ann["gputopo.io/required-tier"] = "spine"
            jobs.append(JobSpec(name=f"pp{stages}-{i}", pods=stages, gpus_per_pod=8, annotations=ann))
            asked += 8 * stages
    return jobs


# --------------------------------------------------------------------------------------------------
# Reporting


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.1f}%)" if b else f"{a}/{b}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def quality_table(results: dict[str, SimResult], only: Sequence[str] | None = None) -> list[str]:
    """The figures side by side, one column per result; `only`: these rows (by label), in table order."""
    rows: list[tuple[str, Callable[[SimResult], str]]] = [
        ("pods placed", lambda r: pct(r.summary.pods_placed, r.summary.pods)),
        ("GPUs placed", lambda r: str(r.summary.gpus_placed)),
        (
            "multi-GPU pods on a full NVLink clique (of placed)",
            lambda r: pct(r.summary.on_full_clique, r.summary.multi_gpu_placed),
        ),
        (
            "  ... of those that could have had one",
            lambda r: pct(r.summary.on_full_clique_of_could, r.summary.could_have_clique),
        ),
        ("groups placed in full", lambda r: pct(r.summary.groups_placed, r.summary.groups)),
        ("groups placed only in part", lambda r: str(r.summary.groups_partial)),
        (
            "groups within one leaf (of placed)",
            lambda r: pct(r.summary.groups_within.get("leaf", 0), r.summary.groups_placed),
        ),
        (
            "groups within one spine (of placed)",
            lambda r: pct(r.summary.groups_within.get("spine", 0), r.summary.groups_placed),
        ),
        (
            "rail-aligned groups (of those on part of a node)",
            lambda r: pct(r.summary.rail_aligned, r.summary.rail_groups),
        ),
        (
            "pods placed against their requests",
            lambda r: ", ".join(f"{n} {k}" for k, n in r.summary.broken.items()) or "0",
        ),
        ("free GPUs at the end", lambda r: str(r.summary.free_gpus)),
        ("stranded GPUs (fit no waiting pod)", lambda r: str(r.summary.stranded_gpus)),
        ("est. TP allreduce time, s (64 MiB/pod)", lambda r: f"{r.summary.tp_allreduce_seconds:.3f}"),
        ("est. PP transfer time, s (64 MiB/boundary)", lambda r: f"{r.summary.pp_transfer_seconds:.3f}"),
        ("TP time per clique-wanting pod placed, ms", lambda r: _per_pod_tp(r)),
        ("decisions", lambda r: str(len(r.decisions))),
        ("decision time mean / p50 / p99 / max, ms", lambda r: _decision_times(r)),
    ]
    if only is not None:
        rows = [r for r in rows if r[0] in only]
    width = max(len(k) for k, _ in rows)
    cols = {p: [fn(results[p]) for _, fn in rows] for p in results}
    colw = {p: max(len(p), *(len(v) for v in cols[p])) for p in results}
    out = ["  " + " " * width + "  " + "  ".join(f"{p:>{colw[p]}}" for p in results)]
    for i, (label, _) in enumerate(rows):
        out.append(f"  {label:<{width}}  " + "  ".join(f"{cols[p][i]:>{colw[p]}}" for p in results))
    return out


def _per_pod_tp(r: SimResult) -> str:
    n = r.summary.multi_gpu_placed
    return f"{r.summary.tp_allreduce_seconds / n * 1e3:.3f}" if n else "-"


def _decision_times(r: SimResult) -> str:
    t = sorted(d.seconds for d in r.decisions)
    if not t:
        return "-"
    p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
    return f"{ms(statistics.fmean(t))} / {ms(statistics.median(t))} / {ms(p99)} / {ms(t[-1])}"


def run_policies(nodes: list[NodeState], jobs: list[JobSpec], seed: int) -> dict[str, SimResult]:
    out = {}
    for policy in POLICIES:
        t0 = time.perf_counter()
        out[policy] = simulate(nodes, jobs, policy, DEFAULT_TIERS, seed, measures=Measures(exhaustive=False))
        print(f"  ({policy}: {time.perf_counter() - t0:.1f} s wall)", flush=True)
    return out


# --------------------------------------------------------------------------------------------------
# DRA

DRA_ROWS = (
    "pods placed",
    "GPUs placed",
    "multi-GPU pods on a full NVLink clique (of placed)",
    "  ... of those that could have had one",
    "groups placed in full",
    "pods placed against their requests",
    "free GPUs at the end",
    "stranded GPUs (fit no waiting pod)",
    "decision time mean / p50 / p99 / max, ms",
)


def dra_tables(nodes: list[NodeState], jobs: list[JobSpec], device_plugin: dict[str, SimResult]) -> list[str]:
    """The mix placed under each DRA encoding and node choice, beside the device-plugin columns."""
    out: list[str] = []
    tables: tuple[tuple[str, str, tuple[tuple[str, Encoding, NodeChoice], ...]], ...] = (
        (
            "the engine picks the node (extender), the DRA allocator the GPUs",
            "gputopo",
            tuple((f"dra {e}", e, "gputopo") for e in ENCODINGS),
        ),
        (
            "kube-scheduler alone (1.34: first fitting node by name; 1.35+: best subrequest first)",
            "default",
            (
                *((f"dra {e}", e, "first") for e in ENCODINGS),
                ("dra partitions 1.35+", "partitions", "scored"),
                ("dra list 1.35+", "list", "scored"),
            ),
        ),
    )
    for title, beside, runs in tables:
        cols: dict[str, SimResult] = {}
        if beside in device_plugin:
            cols[f"{beside} (dev. plugin)"] = device_plugin[beside]
        for label, enc, choice in runs:
            t0 = time.perf_counter()
            cols[label] = simulate_dra(nodes, jobs, enc, choice)
            print(f"  ({label}, node choice {choice}: {time.perf_counter() - t0:.1f} s wall)", flush=True)
        out.append(f"  DRA, {title}:")
        out += quality_table(cols, DRA_ROWS)
    return out


CHURN_SYSTEMS = ("dgx-h100", "dgx-1v", "a100-pcie-bridged", "gb200-tray")
CHURN_NODES = 8
CHURN_LABELS = {
    "device-plugin": "device plugin (engine's GPUs)",
    "dra-stock": "DRA, index order (stock)",
    "dra-best-fit": "DRA, best-fit order",
    "dra-blocks": "DRA, clique blocks",
}


def churn_arrivals(
    node_gpus: int, count: int, capacity: int, load: float, seed: int, *, exponential: bool = False
) -> list[Arrival]:
    """The Alibaba multi-GPU replay's sizes (1/2/4/8, those a node holds) in a seeded order, each holding its
    GPUs for the next duration of the default trace (deletion - creation, file order), scaled so the
    GPUs asked average `load` of `capacity` (one arrival per time unit). `exponential`: durations drawn
    from an exponential distribution instead (seeded), scaled the same way."""
    sizes: list[int] = []
    with PODS_CSV.open() as f:
        for r in csv.DictReader(f):
            g = int(r["num_gpu"])
            if 0 < g <= node_gpus:
                sizes.append(g)
    # The file lists its 1-GPU pods first: a seeded shuffle mixes the sizes as they would arrive.
    random.Random(seed).shuffle(sizes)
    sizes = sizes[:count]
    durations: list[int] = []
    with DEFAULT_PODS_CSV.open() as f:
        for r in csv.DictReader(f):
            if int(r["num_gpu"]) > 0 and r["deletion_time"] and r["creation_time"]:
                durations.append(max(1, int(r["deletion_time"]) - int(r["creation_time"])))
    if exponential:  # the trace's durations are extreme (median 545 s, mean 27,176 s): few pods overlap
        rng = random.Random(seed + 1)
        durations = [max(1, round(rng.expovariate(1 / 1000))) for _ in sizes]
    held = [sizes[i] * durations[i % len(durations)] for i in range(len(sizes))]
    scale = load * capacity * len(sizes) / sum(held)  # Little's law: GPUs in use = arrival rate x GPU-time
    return [Arrival(k, durations[i % len(durations)] * scale) for i, k in enumerate(sizes)]


def churn_section(quick: bool, seed: int, load: float = 0.9) -> list[str]:
    count = 1000 if quick else 3000
    out = [
        f"  {CHURN_NODES} nodes of each system; {count} claims arriving one per time unit, each leaving after",
        f"  its duration (sizes: openb_pod_list_multigpu50.csv shuffled with seed {seed}; durations: the trace's",
        "  (openb_pod_list_default.csv, deletion - creation, in file order) or exponential (seeded), both scaled to",
        f"  {load:.0%} of the GPUs asked on average); the first {count // 6} arrivals warm up. The node: the engine's",
        "  choice (the extender) or the first node by name that fits; the GPUs: the engine's (device plugin), or",
        "  the DRA allocator's first fit for gputopo's partition claim over index order (stock) or best-fit order,",
        "  or, with clique blocks, the first free block of the claim's size in the published best-fit order (2, 4",
        "  and 8 GPUs where the node publishes such blocks; 1 GPU and other sizes as best-fit order).",
    ]
    for system in CHURN_SYSTEMS:
        topo = build_system(system)
        nodes = [node_state(f"{system}-{i:02d}", topo) for i in range(CHURN_NODES)]
        capacity = sum(n.gpu_count for n in nodes)
        for exponential in (False, True):
            out += _churn_rows(system, nodes, count, capacity, load, seed, exponential)
    return out


def _churn_rows(
    system: str, nodes: list[NodeState], count: int, capacity: int, load: float, seed: int, exponential: bool
) -> list[str]:
    topo = nodes[0].topology
    assert topo is not None
    arrivals = churn_arrivals(len(topo.gpus), count, capacity, load, seed, exponential=exponential)
    multi = sum(1 for a in arrivals if a.gpus > 1)
    durations = "exponential durations" if exponential else "the trace's durations"
    out = [
        f"  {system} ({len(topo.gpus)} GPUs/node, {multi} multi-GPU claims, {durations}):",
        f"    {'':<52} {'on one clique':>14} {'clique refused':>15} {'stranded':>9} {'largest free':>13}"
        f" {'unplaced':>9} {'cpu s':>6}",
    ]
    choices: tuple[tuple[ChurnNodeChoice, str], ...] = (
        ("engine", "extender picks the node"),
        ("first", "first node by name"),
    )
    for choice, words in choices:
        for mode in MODES:
            t0 = time.process_time()
            f = simulate_churn(nodes, arrivals, mode, warmup=count // 6, node_choice=choice)
            cpu = time.process_time() - t0
            out.append(
                f"    {CHURN_LABELS[mode] + ', ' + words:<52} {f.on_clique_pct:>13.1f}% {f.clique_refused:>15} "
                f"{f.stranded_pct:>8.1f}% {f.largest_free_clique:>13.2f} {f.unplaced:>9} {cpu:>6.1f}"
            )
    return out


def island_cluster() -> list[NodeState]:
    v, b = build_system("dgx-1v"), build_system("a100-pcie-bridged")
    return [node_state(f"isl-{i:03d}", v if i % 2 == 0 else b) for i in range(128)]


def island_jobs(capacity: int, load: float, seed: int) -> list[JobSpec]:
    rng = random.Random(seed)
    jobs: list[JobSpec] = []
    asked = 0
    while asked < capacity * load:
        r = rng.random()
        gpus = 1 if r < 0.45 else 2 if r < 0.80 else 4
        if gpus == 1:
            ann = {"gputopo.io/nvlink": "ignore"}
        else:
            ann = {"gputopo.io/nvlink": "required" if rng.random() < 2 / 3 else "preferred"}
        jobs.append(JobSpec(name=f"tp{gpus}-{len(jobs)}", gpus_per_pod=gpus, annotations=ann))
        asked += gpus
    return jobs


def synthetic_layouts() -> list[tuple[str, NodeTopology]]:
    """Two layouts that are no named system: DGX-1V with its 0-1 NVLink down, and 8 GPUs linked all
    to all but i to i+4 (sixteen overlapping quads)."""
    v = build_system("dgx-1v")
    links = [list(r) for r in v.nvlink.links]
    links[0][1] = links[1][0] = 0
    down = v.model_copy(update={"nvlink": v.nvlink.model_copy(update={"links": tuple(map(tuple, links))})})
    h = build_system("dgx-h100")
    quads = tuple(tuple(0 if i == j or abs(i - j) == 4 else 18 for j in range(8)) for i in range(8))
    dense = h.model_copy(update={"nvlink": h.nvlink.model_copy(update={"links": quads})})
    return [("dgx-1v, NVLink 0-1 down (synthetic)", down), ("8 GPUs, all pairs but i,i+4 (synthetic)", dense)]


def encoding_section() -> list[str]:
    layouts = [(name, build_system(name)) for name in SYSTEMS] + synthetic_layouts()
    ks = (2, 4, 8)
    head = f"  {'system':<40} {'maximal cliques (2+ GPUs)':<34} {'parts':>5}  {'left out by 4':<14}"
    head += "".join(f"  {f'k={k}: conn/all  part  list':<27}" for k in ks)
    out = [head.rstrip()]
    for name, topo in layouts:
        e = expressiveness(topo, ks)
        cliques = " ".join(e.clique_ids()) or "-"
        left = " ".join(e.left_out_ids()) or "-"
        if len(cliques) > 34:
            cliques = f"{len(e.cliques)} cliques"
        if len(left) > 14:
            left = f"{len(e.left_out)} cliques"
        row = f"  {name:<40} {cliques:<34} {e.partitions_needed:>5}  {left:<14}"
        by_k = {s.k: s for s in e.ksets}
        for k in ks:
            s = by_k.get(k)
            if s is None:
                row += f"  {'-':<27}"
                continue
            part = f"{100 * s.by_partitions / s.connected:.0f}%" if s.connected else "-"
            lst = f"{100 * s.by_list / s.connected:.0f}%" if s.connected else "-"
            row += f"  {f'{s.connected}/{s.all}':>11} {part:>5} {lst:>5}     "
        out.append(row.rstrip())
    out += [
        "  (parts: scalar partitions needed to hold every maximal clique as a block; conn/all: fully",
        "   connected k-sets of the healthy GPUs; part / list: the share of those a claim can ask for",
        "   under the scalar partitions / the list attribute; without a constraint a claim asks for none)",
    ]
    return out


# --------------------------------------------------------------------------------------------------
# Decision time at scale


def scale_nodes(count: int, seed: int) -> list[NodeState]:
    rng = random.Random(seed)
    fixtures = ["dgx-h100"] * 4 + ["hgx-h200"] * 2 + ["dgx-a100"] * 2 + ["dgx-1v", "a100-pcie-bridged", "l40s-4"]
    fixtures += ["hgx-a100-4", "rtx4090-8"]
    topos = {f: build_system(f) for f in set(fixtures)}
    hosts = lingjun_hosts()
    nodes = []
    for i in range(count):
        f = rng.choice(fixtures)
        topo = topos[f]
        n = len(topo.gpus)
        busy = rng.random()
        in_use = frozenset(g for g in range(n) if rng.random() < busy * 0.8)
        nodes.append(node_state(f"node-{i:05d}", topo, labels=labels_for(hosts[i % len(hosts)]), in_use=in_use))
    return nodes


def time_it(fn: Callable[[], object], repeat: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


def scale_section(count: int, seed: int) -> list[str]:
    nodes = scale_nodes(count, seed)
    free8 = sum(1 for n in nodes if n.shape is not None and (n.free_mask).bit_count() >= 8)
    req8 = parse_pod_request({"gputopo.io/nvlink": "required"}, 8)
    cold8, warm8 = time_it(lambda: rank(evaluate_pod(nodes, req8)), 6)
    ann = {
        "gputopo.io/group": "llm",
        "gputopo.io/group-size": "32",
        "gputopo.io/network": "infiniband",
        "gputopo.io/preferred-tier": "leaf",
    }
    members = [
        Member(f"llm-{i}", parse_pod_request({**ann, "gputopo.io/stage": str(i)}, 8, DEFAULT_TIERS.names))
        for i in range(32)
    ]
    plan_box: list[object] = []
    cold32, warm32 = time_it(lambda: plan_box.append(plan_group("llm", members, nodes)), 4)
    plan = plan_box[-1]
    planned = getattr(plan, "assignments", None)
    verdict = f"{len(planned)} stages placed" if planned is not None else f"no plan: {getattr(plan, 'message', '')}"
    lines = [
        f"  {count} nodes of mixed named systems, random in-use GPUs; {free8} nodes have 8 free GPUs",
        f"  one 8-GPU decision (evaluate_pod + rank):  cold {ms(cold8)} ms, warm median "
        f"{ms(statistics.median(warm8))} ms   target <= 20 ms   "
        + ("OK" if statistics.median(warm8) <= 0.020 else "MISSED"),
        f"  one 32-stage group plan (plan_group):     cold {ms(cold32)} ms, warm median "
        f"{ms(statistics.median(warm32))} ms   target <= 200 ms  "
        + ("OK" if statistics.median(warm32) <= 0.200 else "MISSED")
        + f"   ({verdict})",
        "  (cold: first call in the process, the engine's GPU-set caches empty; warm: caches filled, as in a",
        "   long-running extender)",
    ]
    return lines


# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Fabric packing: what a mix leaves whole for the next big gang


def largest_job(jobs: Sequence[JobSpec]) -> JobSpec:
    """The mix's largest job by GPUs (a group counts all its pods)."""
    return max(jobs, key=lambda j: (j.pods * j.gpus_per_pod, j.pods, j.name))


def gangs_that_fit(final: Sequence[NodeState], job: JobSpec, cap: int = 500) -> int:
    """How many copies of `job` still fit, one after the other, on what the mix left (each placed as
    gputopo would place it)."""
    nodes = list(final)
    (pods,) = prepare_pods([job], DEFAULT_TIERS)
    members = [Member(p.name, p.request) for p in pods]
    by_name = {n.name: i for i, n in enumerate(nodes)}
    count = 0
    while count < cap:
        if len(members) > 1 or members[0].request.is_group:
            plan = plan_group(job.name, members, nodes, DEFAULT_TIERS)
            if isinstance(plan, GroupFailure):
                break
            taken = [(a.node.name, a.outcome.gpus) for a in plan.assignments]
        else:
            ranked = rank(evaluate_pod(nodes, members[0].request))
            if not ranked:
                break
            taken = [(ranked[0].name, ranked[0].outcome.gpus)]
        for name, gpus in taken:
            i = by_name[name]
            nodes[i] = with_in_use(nodes[i], frozenset(gpus), DEFAULT_TIERS)
        count += 1
    return count


FABRIC_RUNS: tuple[tuple[str, str, bool], ...] = (
    ("gputopo", "gputopo", True),
    ("gputopo before best fit", "gputopo", False),
    ("default", "default", True),
)


def fabric_table(name: str, nodes: list[NodeState], jobs: list[JobSpec], seed: int) -> list[str]:
    """Per tier, the largest free domain the mix leaves and how many of its largest job still fit."""
    big = largest_job(jobs)
    tiers = [t for t in DEFAULT_TIERS.network_tiers() if any(n.location.get(t) for n in nodes)]
    finals = {}
    for label, policy, best_fit in FABRIC_RUNS:
        finals[label] = simulate(
            nodes,
            jobs,
            policy,
            DEFAULT_TIERS,
            seed,
            engine=EngineSetup(best_fit=best_fit),
            measures=Measures(exhaustive=False),
        ).final
    head = f"  {'after the mix':<44}" + "".join(f"{label:>26}" for label, _, _ in FABRIC_RUNS)
    out = [f"  {name}: largest job {big.name} ({big.pods} x {big.gpus_per_pod} GPUs)", head]
    for tier in tiers:
        cells = []
        for label, _, _ in FABRIC_RUNS:
            free = domain_free(finals[label], DEFAULT_TIERS).by_tier[tier]
            whole = sum(1 for d, f in free.items() if f == _capacity(finals[label], tier, d))
            cells.append(f"{max(free.values(), default=0)} GPUs, {whole} whole")
        what = f"largest free {tier}; {tier} domains left empty"
        out.append(f"  {what:<44}" + "".join(f"{c:>26}" for c in cells))
    fits = [str(gangs_that_fit(finals[label], big)) for label, _, _ in FABRIC_RUNS]
    out.append(f"  {'copies of the largest job that still fit':<44}" + "".join(f"{c:>26}" for c in fits))
    # Gangs that need one leaf: as many nodes as the smallest leaf has, and as the most common leaf has.
    sizes = Counter(Counter(domain_of(n, "leaf") for n in nodes).values())
    for leaf_nodes in sorted({min(sizes, default=1), sizes.most_common(1)[0][0] if sizes else 1}):
        gang = JobSpec(
            name="leaf-gang", pods=leaf_nodes, gpus_per_pod=8, annotations={"gputopo.io/required-tier": "leaf"}
        )
        fits = [str(gangs_that_fit(finals[label], gang)) for label, _, _ in FABRIC_RUNS]
        what = f"{leaf_nodes} x 8-GPU gangs in one leaf that still fit"
        out.append(f"  {what:<44}" + "".join(f"{c:>26}" for c in fits))
    free_all = [str(sum(free_gpus(n) for n in finals[label])) for label, _, _ in FABRIC_RUNS]
    out.append(f"  {'free GPUs in all':<44}" + "".join(f"{c:>26}" for c in free_all))
    return out


def _capacity(nodes: Sequence[NodeState], tier: str, domain: str) -> int:
    return sum(n.gpu_count for n in nodes if n.problem is None and domain_of(n, tier) == domain)


def fabric_section(load: float, seed: int, quick: bool) -> list[str]:
    out = [f"  each mix asks {load:.2f}x the cluster's GPUs, so room is left; the same jobs under each policy"]
    llm = llm_cluster()
    out += fabric_table("LLM mix", llm, llm_jobs(sum(n.gpu_count for n in llm), load, seed), seed)
    small = [j for j in llm_jobs(sum(n.gpu_count for n in llm), load, seed + 1) if j.pods * j.gpus_per_pod <= 16]
    out += fabric_table("lone pods and groups of up to 16 GPUs", llm, small, seed)
    # The same cluster with node names that do not follow the fabric (as on most clusters): ties by name
    # no longer fill leaf by leaf by accident.
    names = [n.name for n in llm]
    random.Random(seed).shuffle(names)
    renamed = [dataclasses.replace(n, name=name) for n, name in zip(llm, names, strict=True)]
    out += fabric_table("lone pods and groups of up to 16 GPUs, node names shuffled", renamed, small, seed)
    if not quick:
        nodes, _ = alibaba_cluster()
        out += fabric_table("Alibaba replay", nodes, alibaba_jobs(sum(n.gpu_count for n in nodes), load), seed)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--load", type=float, default=1.05, help="requested GPUs / cluster GPUs (default 1.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a quarter of the Alibaba pods, 1,000 nodes at scale")
    ap.add_argument("--skip", choices=("alibaba", "llm", "scale", "dra", "fabric", "rack"), action="append", default=[])
    ap.add_argument("--only", choices=("dra-churn",), help="run only this section")
    ap.add_argument("--fabric-load", type=float, default=0.6, help="the fabric-packing mixes' load (default 0.6)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.only == "dra-churn":
        print("== 2c. DRA with departures: device plugin vs the DRA allocator over index or best-fit order, and blocks")
        print("\n".join(churn_section(args.quick, args.seed)))
        print(f"total wall time {time.perf_counter() - t_start:.0f} s")
        return 0

    if "alibaba" not in args.skip:
        nodes, mapping = alibaba_cluster()
        capacity = sum(n.gpu_count for n in nodes)
        load = args.load / 4 if args.quick else args.load
        jobs = alibaba_jobs(capacity, load)
        print("== 1. Alibaba v2023 replay: openb_node_list_gpu_node.csv + openb_pod_list_multigpu50.csv")
        print(f"  {len(nodes)} nodes, {capacity} GPUs; network labels from Lingjun topo.csv (spine = PSW, leaf = ASW)")
        print("  GPU models mapped to named systems:")
        for label, (desc, count) in sorted(mapping.items(), key=lambda kv: -kv[1][1]):
            print(f"    {label:<12} {count:>4} nodes -> {desc}")
        multi = sum(1 for j in jobs if j.gpus_per_pod > 1)
        asked = sum(j.gpus_per_pod for j in jobs)
        print(
            f"  {len(jobs)} GPU pods in file order ({multi} multi-GPU, annotated nvlink: preferred; "
            "1-GPU pods nvlink: ignore), "
            f"{asked} GPUs asked = {asked / capacity:.2f}x capacity; fractional GPUs count as 1, 0-GPU pods skipped"
        )
        results = run_policies(nodes, jobs, args.seed)
        print("\n".join(quality_table(results)))
        if "dra" not in args.skip:
            print("\n".join(dra_tables(nodes, jobs, results)))
        print()

    if "llm" not in args.skip:
        nodes = llm_cluster()
        capacity = sum(n.gpu_count for n in nodes)
        jobs = llm_jobs(capacity, args.load, args.seed)
        groups = [j for j in jobs if j.pods > 1]
        print("== 2. Synthetic LLM training mix: 192 dgx-h100 + 64 hgx-h200, NDR InfiniBand, Lingjun racks")
        print(
            f"  {len(nodes)} nodes, {capacity} GPUs; {len(jobs) - len(groups)} TP pods (8/4/2 GPUs, nvlink: required), "
            f"{len(groups)} PP groups of 2-16 stages x 8 GPUs "
            f"({sum(1 for g in groups if 'gputopo.io/required-tier' in g.annotations)} with required-tier: spine); "
            f"{sum(j.pods * j.gpus_per_pod for j in jobs) / capacity:.2f}x capacity asked"
        )
        results = run_policies(nodes, jobs, args.seed)
        print("\n".join(quality_table(results)))
        if "dra" not in args.skip:
            print("\n".join(dra_tables(nodes, jobs, results)))
        print()

    if "dra" not in args.skip:
        nodes = island_cluster()
        capacity = sum(n.gpu_count for n in nodes)
        jobs = island_jobs(capacity, args.load, args.seed)
        print("== 2b. NVLink islands: 64 dgx-1v + 64 a100-pcie-bridged")
        counts = {g: sum(1 for j in jobs if j.gpus_per_pod == g) for g in (1, 2, 4)}
        req = sum(1 for j in jobs if j.annotations.get("gputopo.io/nvlink") == "required")
        print(
            f"  {len(nodes)} nodes, {capacity} GPUs; {counts[1]} 1-GPU, {counts[2]} TP-2, {counts[4]} TP-4 pods "
            f"({req} nvlink: required, the other multi-GPU pods preferred); "
            f"{sum(j.gpus_per_pod for j in jobs) / capacity:.2f}x capacity asked"
        )
        results = run_policies(nodes, jobs, args.seed)
        print("\n".join(quality_table(results, DRA_ROWS)))
        print("\n".join(dra_tables(nodes, jobs, results)))
        print()

    if "fabric" not in args.skip:
        print("== 5. Fabric packing: the largest free domains a mix leaves, and the next big gang")
        print("\n".join(fabric_section(args.fabric_load, args.seed, args.quick)))
        print()

    if "scale" not in args.skip:
        count = 1000 if args.quick else 5000
        print(f"== 3. Decision time at scale ({count} nodes)")
        print("\n".join(scale_section(count, args.seed)))
        print()

    if "dra" not in args.skip:
        print("== 2c. DRA with departures: device plugin vs the DRA allocator over index or best-fit order, and blocks")
        print("\n".join(churn_section(args.quick, args.seed)))
        print()

    if "dra" not in args.skip:
        print("== 4. DRA clique encodings per named system")
        print("\n".join(encoding_section()))
        print()

    if "rack" not in args.skip:
        print("== 6. Rack-scale NVLink: GB200 NVL72 racks beside H100 nodes")
        print("\n".join(rack_quality.section(args.load, args.seed)))
        print()

    print(f"total wall time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
