"""ComputeDomains in placement: NVIDIA's IMEX domains over multi-node NVLink.

A ComputeDomain (NVIDIA's DRA driver) gives each of its pods an IMEX channel through a claim on the node's one
channel device (`channel-0`); its pods reach each other's GPU memory only inside one multi-node NVLink domain
(the nodes' `nvlink-domain` location). So here:

- a pod of a ComputeDomain goes only to a node of the NVLink domain its ComputeDomain's placed pods occupy
  (while none is placed, any domain with room for its numNodes nodes, where that is known: `room_for`), and
  never to a node whose channel serves another ComputeDomain;
- a pod of no ComputeDomain that needs fewer GPUs than a node has is steered first onto nodes already serving a
  channel (their free GPUs can take no other channel pod: the channel is taken) and last onto whole free
  nodes of a domain a ComputeDomain occupies (its next pods need a whole node there).

`Serving` (which ComputeDomain each node's channel serves now) is the extender's: from the pods bound there, and
from the label NVIDIA's kubelet plugin puts on a node while its channel serves a ComputeDomain
(`DRIVER_NODE_LABEL`, the ComputeDomain's UID; `with_driver_labels`), which also covers pods gputopo does not
track. A ComputeDomain is named `namespace/template`: the ResourceClaimTemplate its pods name; one known only by
the UID on a node is named `UID <uid>`. A gang of one ComputeDomain is planned only on the nodes
`group_candidates` keeps.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from gputopo.engine.node.placement import Outcome
from gputopo.engine.state.reasons import Code, Reason
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import PodRequest
from gputopo.model.claimtemplate import COMPUTE_DOMAIN_LABEL

DOMAIN_TIER = "nvlink-domain"
# The label NVIDIA's kubelet plugin sets to the ComputeDomain's UID while the node's channel serves it (and its
# channel ResourceClaimTemplates carry, so the UID names the template); one ComputeDomain per node.
DRIVER_NODE_LABEL = COMPUTE_DOMAIN_LABEL
Serving = Mapping[str, frozenset[str]]  # node -> the ComputeDomains whose IMEX channel it serves now
# Scores are in [0, 1]: a whole step orders the steering classes first, the engine's score within each.
FIRST, LAST = 1.0, -1.0


def nvlink_domain(state: NodeState) -> str | None:
    """The node's multi-node NVLink domain (any labeler's key, as the tiers read it); None when it has none."""
    return state.location.get(DOMAIN_TIER)


def domains_of(cd: str, serving: Serving, domain: Mapping[str, str | None]) -> Counter[str]:
    """The NVLink domains the ComputeDomain's placed pods occupy, with how many of its nodes each holds."""
    out: Counter[str] = Counter()
    for node, cds in serving.items():
        where = domain.get(node)
        if cd in cds and where is not None:
            out[where] += 1
    return out


def pinned_domain(cd: str, serving: Serving, domain: Mapping[str, str | None]) -> str | None:
    """The NVLink domain the ComputeDomain's next pods must join (what a group planner pins a group whose
    members claim `cd` to): the one its placed pods occupy; should they already span several, through no
    choice of gputopo's, the one holding most of its nodes, then the first by name. None while none is placed."""
    held = domains_of(cd, serving, domain)
    if not held:
        return None
    return min(held, key=lambda d: (-held[d], d))


def with_driver_labels(
    serving: Serving, labelled: Mapping[str, str], named: Callable[[str], str | None]
) -> dict[str, frozenset[str]]:
    """`serving` (from the pods bound) with each node's `DRIVER_NODE_LABEL` added: `labelled` maps nodes to the
    UID there, `named` a UID to its ComputeDomain (None when no channel template carries it: `UID <uid>`)."""
    out = dict(serving)
    for node, uid in labelled.items():
        out[node] = out.get(node, frozenset()) | {named(uid) or f"UID {uid}"}
    return out


def group_candidates(
    cd: str, states: Sequence[NodeState], serving: Serving, served: Mapping[str, str | None]
) -> tuple[list[NodeState], str]:
    """The nodes a gang of ComputeDomain `cd` may be planned on (none whose channel serves another
    ComputeDomain; only its NVLink domain once some of its pods are placed), and what was left out, as a
    clause for the gang's reason ("" when nothing was)."""
    pinned = pinned_domain(cd, serving, served)
    none: frozenset[str] = frozenset()
    taken = sorted(s.name for s in states if serving.get(s.name, none) - {cd})
    elsewhere = pinned is not None and any(nvlink_domain(s) != pinned for s in states)
    out = frozenset(taken)
    kept = [s for s in states if s.name not in out and (pinned is None or nvlink_domain(s) == pinned)]
    said = []
    if taken:
        said.append(f"{len(taken)} node(s) serve another ComputeDomain's IMEX channel (the first {taken[0]})")
    if elsewhere:
        said.append(f"ComputeDomain {cd} runs in NVLink domain {pinned}")
    return kept, "; ".join(said)


def refusal(cd: str, node: str, here: str | None, serves: frozenset[str], pinned: str | None) -> tuple[str, str] | None:
    """Why a pod of ComputeDomain `cd` may not go to `node` (in NVLink domain `here`, its channel serving
    `serves`), as (the categorical message, the node's sentence); None when it may."""
    others = sorted(serves - {cd})
    if others:
        return (
            f"IMEX channel serves another ComputeDomain than {cd}",
            f"node {node} serves the IMEX channel of ComputeDomain {others[0]}; one channel per node, and the "
            f"pod's ComputeDomain is {cd}",
        )
    if pinned is not None and here != pinned:
        return (
            f"outside NVLink domain {pinned} of ComputeDomain {cd}",
            f"ComputeDomain {cd} runs in NVLink domain {pinned}; node {node} is in "
            + (f"NVLink domain {here}" if here else "no NVLink domain"),
        )
    return None


def room_for(cd: str, needs: int, states: Sequence[NodeState], outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The first pod of ComputeDomain `cd`, whose numNodes is `needs`: only nodes of NVLink domains where at
    least that many candidates take it pass (its later pods must join this one's domain, and NVIDIA's driver
    may hold them all until that many nodes have joined). A node in no domain is a domain of one."""
    room = Counter(nvlink_domain(s) for s, o in zip(states, outcomes, strict=True) if o.fits)
    out: list[Outcome] = []
    for state, o in zip(states, outcomes, strict=True):
        here = nvlink_domain(state)
        has = room[here] if here is not None else 1
        if o.fits and has < needs:
            o = Outcome(
                Code.UNRESOLVABLE,
                Reason.COMPUTE_DOMAIN,
                f"NVLink domain has room for fewer nodes than ComputeDomain {cd} asks for",
                f"ComputeDomain {cd} asks for {needs} nodes (numNodes) in one NVLink domain; "
                + (f"NVLink domain {here} has room on {has}" if here else f"node {state.name} is in no NVLink domain"),
            )
        out.append(o)
    return out


def steer(req: PodRequest, state: NodeState, serves: frozenset[str], occupied: frozenset[str]) -> float:
    """The offset a pod of no ComputeDomain gets on a node: FIRST on a node serving a channel, LAST on a
    whole free node of an NVLink domain a ComputeDomain occupies, else 0. Only for pods that need fewer GPUs
    than the node has: a whole-node pod strands nothing."""
    total = len(state.topology.gpus) if state.topology is not None else 0
    if req.compute_domain is not None or not 0 < req.gpus < total:
        return 0.0
    if serves:
        return FIRST
    if not state.in_use and nvlink_domain(state) in occupied:
        return LAST
    return 0.0


def with_compute_domains(
    req: PodRequest,
    states: Sequence[NodeState],
    outcomes: Sequence[Outcome],
    serving: Serving,
    served: Mapping[str, str | None],
    needs: int = 0,
) -> list[Outcome] | None:
    """The outcomes (parallel to `states`) with the ComputeDomain rules applied: refusals for a pod of a
    ComputeDomain, score offsets for a pod of none. `served`: the NVLink domain of each node in `serving`
    (full ones are rarely among the candidates); `needs`: the pod's ComputeDomain's numNodes (0: not said).
    None when no ComputeDomain is involved."""
    cd = req.compute_domain
    if cd is None and not serving:
        return None
    domain = {s.name: nvlink_domain(s) for s in states}
    none: frozenset[str] = frozenset()
    out: list[Outcome] = []
    if cd is not None:
        pinned = pinned_domain(cd, serving, served)
        for state, o in zip(states, outcomes, strict=True):
            why = refusal(cd, state.name, domain[state.name], serving.get(state.name, none), pinned) if o.fits else None
            out.append(o if why is None else Outcome(Code.UNRESOLVABLE, Reason.COMPUTE_DOMAIN, why[0], why[1]))
        return room_for(cd, needs, states, out) if pinned is None and needs > 1 else out
    occupied = frozenset(d for d in served.values() if d is not None)
    moved: dict[tuple[int, float], Outcome] = {}  # equal outcomes stay one object (the filter's kinds)
    for state, o in zip(states, outcomes, strict=True):
        shift = steer(req, state, serving.get(state.name, none), occupied) if o.fits else 0.0
        if not shift:
            out.append(o)
            continue
        key = (id(o), shift)
        if key not in moved:
            moved[key] = dataclasses.replace(o, score=o.score + shift)
        out.append(moved[key])
    return out
