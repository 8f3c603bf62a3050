"""Per-node verdicts for one pod: fits or not, which GPUs, a score in [0, 1] with its breakdown."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gputopo.engine.network.cost import REFERENCE_BUSBW_GBPS, Estimate, SetBandwidth, intra_node_bandwidth, tp_estimate
from gputopo.engine.network.domains import DomainFree, narrow_first
from gputopo.engine.node.blocks import MAX_BLOCK_GPUS, first_fit_block, published_blocks
from gputopo.engine.node.gpusets import (
    GpuChoice,
    Kind,
    choice_of,
    choose_any,
    choose_clique,
    choose_connected,
    largest_clique,
)
from gputopo.engine.state.cliques import bits, mask_of, popcount
from gputopo.engine.state.reasons import Code, Reason, code_for, message
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import NetworkKind, NvlinkPolicy, PodRequest, format_mib
from gputopo.model.dra import block_name
from gputopo.tiers import DEFAULT_TIERS, TierConfig

# A pod that names no HBM minimum is steered gently off GPUs with more than this, keeping large-HBM
# GPUs (H200, B200) free for the pods that need them.
UNASKED_HBM_MIB = 80 * 1024


@dataclass(frozen=True)
class Search:
    """Where the GPU set of a fitting outcome was chosen from: what a group needs to choose another set
    of the same node by the same ranking (gpusets.rail_options)."""

    kind: Kind
    candidates: int  # the GPUs the set was chosen among
    free: int  # the node's free GPUs the score's fragmentation term compares against
    near: int  # GPUs near an accepted NIC


@dataclass(frozen=True)
class Outcome:
    """What one node means for one pod. Shared between equivalent nodes, so it names no node."""

    code: Code
    reason: Reason | None = None
    message: str = ""  # categorical, aggregates across nodes
    detail: str = ""  # the node-specific story, for explain and logs
    gpus: tuple[int, ...] = ()
    score: float = 0.0
    components: Mapping[str, float] = field(default_factory=dict)
    choice: GpuChoice | None = None
    bandwidth: SetBandwidth | None = None
    free_clique: int = 0  # largest free clique on the node before this pod
    estimate: Estimate | None = None  # the pod's all-reduce over these GPUs (gputopo.io/message-size)
    search: Search | None = None
    block: str = ""  # the block device the allocator hands a pod asking one whole block (req.block)

    @property
    def fits(self) -> bool:
        return self.code is Code.SUCCESS


@dataclass(slots=True)
class NodeVerdict:
    node: NodeState
    outcome: Outcome

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def fits(self) -> bool:
        return self.outcome.fits


def _fail(reason: Reason, detail: str, **kw: object) -> Outcome:
    return Outcome(code=code_for(reason), reason=reason, message=message(reason, **kw), detail=detail)  # type: ignore[arg-type]


def _network_word(kind: NetworkKind) -> str:
    return {"infiniband": "InfiniBand", "roce": "RoCE", "rdma": "RDMA", "any": "RDMA"}[kind.value]


def _gpu_list(mask: int) -> str:
    return ", ".join(str(i) for i in bits(mask))


def evaluate_node(node: NodeState, req: PodRequest, weights: ScoreWeights = DEFAULT_WEIGHTS) -> Outcome:
    """Can `node` take `req`, on which GPUs, and how good is it? Pure."""
    if node.problem is not None or node.shape is None:
        reason = node.problem or Reason.TOPOLOGY_MISSING
        return _fail(reason, node.problem_detail or message(reason))
    shape = node.shape
    k = req.gpus
    if k == 0:
        return Outcome(code=Code.SUCCESS, score=0.5, components={}, detail="the pod asks for no GPUs")
    # The hot path only narrows masks; each refusal's story is told apart, in the order it is checked.
    eligible = node.all_mask & ~node.failed_mask
    if req.min_gpu_memory_mib:
        eligible &= mask_of([i for i, m in enumerate(node.memory_mib) if m >= req.min_gpu_memory_mib])
    if shape.n < k or popcount(eligible) < k or not node.has_network(req.network):
        return _ineligible(node, req)
    needs_nvlink = k > 1 and req.nvlink is not NvlinkPolicy.IGNORE
    good = eligible & ~node.impaired_mask if needs_nvlink else eligible
    # `good` is inside `eligible`: a clique of k among `good` means one among `eligible` too.
    if needs_nvlink and req.nvlink is NvlinkPolicy.REQUIRED and largest_clique(shape, good) < k:
        return _no_clique(node, k, eligible)
    free = good & ~node.in_use_mask
    if popcount(free) < k and needs_nvlink and popcount(eligible & ~node.in_use_mask) >= k:
        if req.nvlink is not NvlinkPolicy.PREFERRED:
            return _fail(Reason.NVLINK_DEGRADED, _degraded_detail(node, k))
        free = eligible & ~node.in_use_mask  # preferred: degraded GPUs rather than nothing (scored lower)
    if popcount(free) < k:
        return _fail(
            Reason.INSUFFICIENT_FREE_GPUS,
            f"{popcount(free)} of {shape.n} GPUs free (in use: {_gpu_list(node.in_use_mask) or 'none'}), pod needs {k}",
            k=k,
        )

    near = node.near_nic_mask(req.network) if (req.network is not NetworkKind.ANY or req.is_group) else 0
    choice: GpuChoice | None
    search: Search
    if k == 1:
        preferred = free & ~node.impaired_mask
        search = Search("any", preferred if preferred else free, free, near)
        choice = choose_any(shape, search.candidates, 1, near)
    elif req.block:
        search = Search("clique", free, free, near)
        picked = _block(node, req, eligible, free)
        if isinstance(picked, Outcome):
            return picked
        choice = choice_of(shape, free, picked)
    elif req.nvlink is NvlinkPolicy.REQUIRED:
        search = Search("clique", free, free, near)
        choice = choose_clique(shape, free, k, near)
        if choice is None:
            return _fail(
                Reason.NO_FREE_CLIQUE, f"free GPUs {_gpu_list(free)} hold no fully NVLink-connected set of {k}", k=k
            )
    elif req.nvlink is NvlinkPolicy.PREFERRED:
        healthy_free = free & ~node.impaired_mask
        search = Search("clique", healthy_free, free, near)
        choice = choose_clique(shape, healthy_free, k, near)
        if choice is None:
            search = Search("clique", free, free, near)
            choice = choose_clique(shape, free, k, near)
        if choice is None:
            search = Search("connected", free, free, near)
            choice = choose_connected(shape, free, k, near)
    else:
        search = Search("any", free, free, near)
        choice = choose_any(shape, free, k, near)
    assert choice is not None  # free has at least k GPUs, so some k-set exists
    return _success(node, req, choice, free, near, weights, search)


def _block(node: NodeState, req: PodRequest, eligible: int, free: int) -> int | Outcome:
    """The block the allocator hands a pod asking one whole block of `req.gpus` (gputopo.engine.node.blocks),
    or why the node fails: it publishes no block of that size, none is free, or the first free one holds a
    GPU the pod may not have (`free` holds those it may)."""
    assert node.shape is not None
    k, usable = req.gpus, node.all_mask & ~node.failed_mask
    if not published_blocks(node.shape, usable, k):
        why = f"node has {node.shape.n} GPUs, over {MAX_BLOCK_GPUS}" if node.shape.n > MAX_BLOCK_GPUS else "none"
        return _fail(Reason.NO_NVLINK_DOMAIN, f"node publishes no {k}-GPU block ({why})", k=k)
    pick = first_fit_block(node.shape, usable, usable & ~node.in_use_mask, k)
    if pick is None:
        in_use = _gpu_list(node.in_use_mask) or "none"
        return _fail(Reason.NO_FREE_CLIQUE, f"every {k}-GPU block holds a GPU in use (in use: {in_use})", k=k)
    if pick & ~free:
        name = block_name(bits(pick))
        if pick & ~eligible:
            need = format_mib(req.min_gpu_memory_mib or 0)
            detail = f"the allocator's first free {k}-GPU block, {name}, has GPUs under {need} HBM"
            return _fail(Reason.INSUFFICIENT_GPU_MEMORY, detail, k=k, memory=need)
        return _fail(Reason.NVLINK_DEGRADED, f"the allocator's first free {k}-GPU block, {name}, has degraded links")
    return pick


def _ineligible(node: NodeState, req: PodRequest) -> Outcome:
    """Why too few of the node's GPUs may hold the pod at all (count, health, HBM) or why the node lacks
    the network asked, the first that applies in that order."""
    assert node.shape is not None
    k = req.gpus
    if node.shape.n < k:
        return _fail(Reason.TOO_FEW_GPUS, f"node has {node.shape.n} GPUs, pod needs {k}", k=k)
    healthy = node.all_mask & ~node.failed_mask
    if popcount(healthy) < k:
        return _fail(
            Reason.TOO_FEW_HEALTHY_GPUS,
            f"GPUs {_gpu_list(node.failed_mask)} failed; {popcount(healthy)} healthy, pod needs {k}",
            k=k,
        )
    if req.min_gpu_memory_mib:
        big = mask_of([i for i, m in enumerate(node.memory_mib) if m >= req.min_gpu_memory_mib])
        if popcount(healthy & big) < k:
            have = format_mib(min(node.memory_mib))
            need = format_mib(req.min_gpu_memory_mib)
            return _fail(
                Reason.INSUFFICIENT_GPU_MEMORY, f"GPUs have {have} HBM, pod needs {need} each", k=k, memory=need
            )
    word = _network_word(req.network)
    return _fail(Reason.NO_NETWORK, f"node has no active {word} NIC", network=word)


def _no_clique(node: NodeState, k: int, eligible: int) -> Outcome:
    """Why an NVLink-required pod finds no clique of `k` among the eligible GPUs: degraded links, or no
    NVLink domain that large."""
    assert node.shape is not None
    largest = largest_clique(node.shape, eligible)
    if largest < k and not node.impaired_mask & eligible:
        return _fail(Reason.NO_NVLINK_DOMAIN, f"largest NVLink-connected set has {largest} GPUs, pod needs {k}", k=k)
    return _fail(Reason.NVLINK_DEGRADED, _degraded_detail(node, k))


def outcome_on(
    node: NodeState, req: PodRequest, outcome: Outcome, gpus: int, weights: ScoreWeights = DEFAULT_WEIGHTS
) -> Outcome | None:
    """`outcome` (evaluate_node's for `node` and `req`) with the GPU set `gpus` instead, scored and
    explained as evaluate_node would have: a group plan's rail-aligned set, or at bind time the set a
    member's reservation holds. None when `gpus` is not an admissible choice there (not among the
    candidates, another size, not a clique where one was required, or for a pod asking one whole block any
    set but the block the allocator's first fit gives it)."""
    search = outcome.search
    if node.shape is None or search is None or not outcome.fits:
        return None
    if req.block and gpus != mask_of(list(outcome.gpus)):
        return None  # the allocator hands out that block and no other: another set is never the claim's
    if gpus & ~search.candidates or popcount(gpus) != len(outcome.gpus):
        return None
    choice = choice_of(node.shape, search.candidates, gpus)
    if search.kind == "clique" and not choice.clique:
        return None
    return _success(node, req, choice, search.free, search.near, weights, search)


def _degraded_detail(node: NodeState, k: int) -> str:
    topo = node.topology
    parts = []
    if topo is not None:
        for d in topo.degraded_links:
            parts.append(f"GPU {d.gpu} link {d.link} {d.state.value}" + (f" ({d.detail})" if d.detail else ""))
        for g in topo.gpus:
            if g.health.value == "degraded":
                parts.append(f"GPU {g.index} degraded" + (f": {'; '.join(g.reasons)}" if g.reasons else ""))
    return f"no {k}-GPU NVLink clique without degraded GPUs: " + ", ".join(parts or ["links degraded"])


def _success(
    node: NodeState,
    req: PodRequest,
    choice: GpuChoice,
    free: int,
    near: int,
    weights: ScoreWeights,
    search: Search | None = None,
) -> Outcome:
    shape = node.shape
    assert shape is not None
    k = len(choice.gpus)
    chosen = mask_of(choice.gpus)
    bw = intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, choice.gpus)
    ignore = req.nvlink is NvlinkPolicy.IGNORE or k == 1
    taken_after = popcount((node.in_use_mask | node.failed_mask | chosen) & node.all_mask)
    free_clique = largest_clique(shape, free)
    components = {
        "clique": 1.0 if (ignore or choice.clique) else 0.0,
        "bandwidth": 1.0 if ignore else min(1.0, bw.gbps / REFERENCE_BUSBW_GBPS),
        "pack": taken_after / shape.n,
        # Fragmentation: the best clique left free, against the best that could be left (what was free).
        "intact": 1.0
        if choice.remaining_free == 0
        else choice.remaining_clique / min(free_clique, choice.remaining_free),
        "memory": (req.min_gpu_memory_mib / min(node.memory_mib[i] for i in choice.gpus))
        if req.min_gpu_memory_mib
        else min(1.0, UNASKED_HBM_MIB / min(node.memory_mib[i] for i in choice.gpus)),
        "nic": popcount(chosen & near) / k if near or req.network is not NetworkKind.ANY else 1.0,
        "health": 0.0 if chosen & node.impaired_mask else (0.5 if node.impaired_mask else 1.0),
    }
    return Outcome(
        code=Code.SUCCESS,
        # A node too irregular to search fully within the budget: say so rather than claim the best set.
        detail=f"GPUs {_gpu_list(chosen)} are the best set found within the search budget, not proven best"
        if choice.truncated
        else "",
        gpus=choice.gpus,
        score=weights.combine(components),
        components=components,
        choice=choice,
        bandwidth=bw,
        free_clique=free_clique,
        estimate=tp_estimate(req.message_bytes, bw, k),
        search=search,
        block=block_name(choice.gpus) if req.block and choice.clique else "",
    )


def evaluate_pod(
    nodes: Iterable[NodeState], req: PodRequest, weights: ScoreWeights = DEFAULT_WEIGHTS
) -> list[NodeVerdict]:
    """Verdicts for every node; equivalent nodes are evaluated once."""
    memo: dict[int, Outcome] = {}
    out: list[NodeVerdict] = []
    append = out.append
    for node in nodes:
        outcome = memo.get(node.key)
        if outcome is None:
            outcome = memo[node.key] = evaluate_node(node, req, weights)
        append(NodeVerdict(node, outcome))
    return out


def rank(
    verdicts: Sequence[NodeVerdict], fabric: DomainFree | None = None, tiers: TierConfig = DEFAULT_TIERS
) -> list[NodeVerdict]:
    """Feasible verdicts best first. Equal scores: with `fabric` (free GPUs per domain over every node
    known) best fit above the node (`DomainFree.tie_key`: the fullest domains with room, then the name),
    as the extender ranks on the wire; without it by name. Either way every run decides the same."""
    ok = Code.SUCCESS
    feasible = (v for v in verdicts if v.outcome.code is ok)
    if fabric is None:
        return sorted(feasible, key=lambda v: (-v.outcome.score, v.node.name))
    narrow = narrow_first(tiers)
    return sorted(feasible, key=lambda v: (-v.outcome.score, fabric.tie_key(v.node, narrow)))


def fail_invalid(nodes: Iterable[NodeState], text: str) -> list[NodeVerdict]:
    """Every node fails with the same reason: a malformed annotation is never guessed at."""
    outcome = Outcome(code=Code.UNRESOLVABLE, reason=Reason.INVALID_POD_ANNOTATION, message=text, detail=text)
    return [NodeVerdict(n, outcome) for n in nodes]
