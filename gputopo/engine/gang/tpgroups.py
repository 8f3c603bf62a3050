"""A group's tensor-parallel groups across nodes and how a placement lies over NVLink domains
(docs/annotations.md, "Tensor parallelism across nodes"): which members form each TP group
(`tp_shape`), the bandwidth a TP group straddling two domains gets, and the split of a group whose trays
something else chose (`placed_split`). gputopo.engine.gang.rack plans such groups. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gputopo.engine.gang.plan import DomainShare, DomainSplit
from gputopo.engine.network.cost import domain_allreduce_seconds, nic_gbps
from gputopo.engine.network.estimate import best_nics, domain_busbw
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import PodRequest
from gputopo.tiers import TierConfig

DOMAIN = "nvlink-domain"


@dataclass(frozen=True)
class TpShape:
    tp_gpus: int
    per_group: int  # members per TP group
    groups: int  # TP groups in the whole group (members placed before included)
    one_domain: bool  # a ComputeDomain's pods: every TP group in the same domain


def tp_shape(lead: PodRequest, gpus: Sequence[int]) -> TpShape | str | None:
    """The group's TP groups across nodes, a sentence when the sizes do not divide, or None when no TP
    group spans nodes (each member's TP stays on its node: the other planners' case). `gpus`: each
    GPU-holding member's count, the members placed before included."""
    cd = lead.compute_domain is not None
    tp = lead.tp_size
    if (tp is None and not cd) or not gpus:
        return None
    if len(set(gpus)) != 1:
        return f"gputopo.io/tp-size needs members of one GPU count; they ask {sorted(set(gpus))}"
    g, n = gpus[0], len(gpus)
    if tp is None or (cd and tp <= g):
        tp = g * n if cd else tp
    assert tp is not None
    if tp <= g and not cd:
        return None
    if tp % g:
        return f"gputopo.io/tp-size {tp} is not a multiple of each member's {g} GPUs"
    k = max(1, min(n, tp // g))
    if n % k:
        return f"{n} members of {g} GPUs are not a whole number of TP groups of {tp} GPUs"
    return TpShape(tp, k, n // k, cd)


def straddle_gbps(tray: NodeState, gpus: int) -> float:
    """The bus bandwidth a TP group straddling two NVLink domains gets from a tray with `gpus` of its GPUs:
    NCCL leaves the domain at the tray's NICs, one per GPU at most, at the best active rate."""
    rate, count = best_nics(tray)
    return min(count, gpus or 1) * nic_gbps(rate)


def placed_split(
    shape: TpShape, holders: Sequence[tuple[NodeState, int]], lead: PodRequest, tiers: TierConfig
) -> DomainSplit | str:
    """The split of a group whose GPU holders, in stage order, are on these (tray, GPUs) as something else
    chose (each member held to its nodes by its own nodeSelector: gputopo.engine.gang.assigned), or what breaks
    the TP rule there: the first TP group over two domains or outside any, a ComputeDomain over two."""
    per = shape.per_group
    if shape.one_domain:
        used = sorted({node.location.get(DOMAIN) or "(none)" for node, _ in holders})
        if len(used) > 1:
            return f"puts the ComputeDomain's pods in NVLink domains {', '.join(used)}"
    shares: list[DomainShare] = []
    trays: dict[str, set[str]] = {}
    for t in range(shape.groups):
        part = holders[t * per : (t + 1) * per]
        domains = sorted({node.location.get(DOMAIN) or "" for node, _ in part})
        if domains == [""] or len(domains) > 1:
            where = (
                "no NVLink domain" if domains == [""] else "NVLink domains " + ", ".join(d or "(none)" for d in domains)
            )
            ranks = f"rank {t * per}" if per == 1 else f"ranks {t * per}-{t * per + len(part) - 1}"
            return f"puts TP group {t}/{shape.groups} ({shape.tp_gpus} GPUs, {ranks}) on trays of {where}"
        name = domains[0]
        trays.setdefault(name, set()).update(node.name for node, _ in part)
        if shares and shares[-1].domain == name:
            shares[-1] = replace(shares[-1], tp_groups=shares[-1].tp_groups + 1)
        else:
            shares.append(DomainShare(name, 1, 0, None, 0, 0))
    shares = [replace(s, trays=len(trays[s.domain])) for s in shares]
    tray, gpus = holders[0]
    message = lead.message_bytes
    inside = domain_allreduce_seconds(message, shape.tp_gpus, domain_busbw(tiers.of_set(tray.tier_set)))
    across = domain_allreduce_seconds(message, shape.tp_gpus, straddle_gbps(tray, gpus))
    return DomainSplit(shape.tp_gpus, per, tuple(shares), inside, across, (), 0)
