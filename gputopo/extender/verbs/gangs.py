"""A group member's filter: its slot in the group's reservation, planning one when none holds.

The members come from the ledger, the plan from the engine (`gputopo.engine.gang.replan`, pure), and the
reservation goes back to the ledger, which refuses it if a planned GPU was taken meanwhile (planning
runs without the ledger's lock). Planning is serialised per group by a fixed table of locks.

A native PodGroup's member that no plan fits may be in kube-scheduler's gang preemption dry run
(`_preemption_dry_run`): then it is planned, without a reservation, as if the pods of lower priority
were gone, so that kube-scheduler finds victims (docs/extender.md, "Preemption"). That plan answers
the group's later members of the same dry run, whose requests name only the nodes left to them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gputopo.engine.gang.assigned import HOSTNAME, Candidates, Selector, selects
from gputopo.engine.gang.imex import Serving, group_candidates, nvlink_domain
from gputopo.engine.gang.plan import GroupFailure
from gputopo.engine.gang.replan import GroupWaiting, MemberView, Replan, Slot, counted, replan
from gputopo.engine.state.snapshot import NodeState, taking
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.locks import StripedLocks
from gputopo.extender.state.podindex import GroupTally
from gputopo.extender.state.records import PodRecord
from gputopo.extender.state.reservations import Reservation
from gputopo.extender.verbs.exclusive import ExclusiveDesk
from gputopo.extender.wire import PodInfo
from gputopo.model import NO_FACTS, ControllerFacts, PodRequest, Spread
from gputopo.model.jobs import JOBSET_EXCLUSIVE
from gputopo.model.pod import KUEUE_TOPOLOGY_GATE

log = logging.getLogger("gputopo.extender.groups")

PLAN_ATTEMPTS = 3
# How long a dry run's plan answers the group's later members: kube-scheduler's dry run asks the
# members one after another, each on the nodes left after the earlier ones were assumed, so only the
# first member's request names every node the plan needs. A cycle takes well under this.
DRY_RUN_PLAN_SECONDS = 10.0
DRY_RUN_PLANS_KEPT = 1024  # groups at once; the oldest plan goes first


# What a group's plan reads of the asking pod beyond the members' records: its nodeSelector (its candidates
# obey it; members with it go where it may), its spread rule and the group's size.
Asker = tuple[Selector, Spread, int]
FAILURES_KEPT = 512  # groups whose failed plan is kept at once (a list of node names each); the oldest goes first


@dataclass(frozen=True)
class _Failed:
    """A group's failed plan and what it read: the asking pod, the members' records (`written`), the
    candidates (`names`) and the selected nodes beyond them, the ledger's generation and the labels'."""

    failure: GroupFailure
    asker: Asker
    written: int
    names: list[str]  # the candidates as they were named (the node cache's strings: no copy of each name)
    selected: list[str]
    generation: int
    labels: int


class FailedPlans:
    """Each group's last failed plan, told to the group's members while nothing it read has changed: a
    retry round of an unplaceable gang (every member filtered again) costs one plan, not one a member.
    Stale as soon as a member comes, goes or is written (bound, its request or selector changed), the
    asking pod's candidates differ, a node it planned over changes kind (GPUs taken or freed, a hold
    made or expired, health, a Lease gone stale), or any node's labels change."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._kept: dict[tuple[str, str], _Failed] = {}
        self._lock = threading.Lock()

    def keep(self, key: tuple[str, str], failed: _Failed) -> None:
        with self._lock:
            self._kept.pop(key, None)
            while len(self._kept) >= FAILURES_KEPT:
                del self._kept[next(iter(self._kept))]
            self._kept[key] = failed

    def reused(self, key: tuple[str, str], asker: Asker, written: int, names: Sequence[str]) -> GroupFailure | None:
        """The group's failure when it still stands for this asking pod and its candidates, else None."""
        f = self._kept.get(key)
        if f is None or f.asker != asker or f.written != written or len(names) != len(f.names):
            return None
        ledger = self.ledger
        # kube-scheduler lists the nodes in one order: compared as lists first (no hashing of thousands)
        if ledger.node_states.labels.generation != f.labels or not (f.names == names or set(f.names) == set(names)):
            return None
        ledger.expire(ledger.clock())  # a hold due to expire frees GPUs: a change of the nodes it held
        if not ledger.unchanged_since(f.generation, itertools.chain(f.names, f.selected)):
            with self._lock:
                if self._kept.get(key) is f:
                    del self._kept[key]
            return None
        return f.failure

    def __len__(self) -> int:
        return len(self._kept)


def member_view(rec: PodRecord) -> MemberView:
    node = rec.placed_node or rec.node_name or None
    placed = rec.placement if rec.placed_node else None
    return MemberView(
        rec.name,
        rec.request,
        node=node,
        gpus=frozenset(placed.gpus) if placed is not None else frozenset(),
        stage=placed.stage if placed is not None else None,
        problem=rec.problem,
        selector=rec.node_selector,
        gated=KUEUE_TOPOLOGY_GATE if rec.topology_gated else "",
    )


def _rank_clash(group: str, tally: GroupTally, name: str, stage: int | None) -> GroupFailure | None:
    """Two members of an inferred group with one rank (the asking pod `name` at its request's `stage`): a
    controller's labels are never guessed at, so every member is told which label repeats (plan_group
    would only say the stage does). Read from the group's counts, not a view of every member."""
    labels = sorted(tally.labels)
    clash = tally.clash(name, stage) if labels else None
    if clash is None:
        return None
    rank, names = clash
    return GroupFailure(
        group,
        f"group {group}: rank {rank} ({' / '.join(labels)}) is claimed by more than one pod: {', '.join(names[:4])}",
    )


class GroupDesk:
    def __init__(
        self,
        ledger: Ledger,
        facts: Callable[[str], ControllerFacts] = lambda _: NO_FACTS,
        serving: Callable[[], Serving] = dict,
    ) -> None:
        self.ledger = ledger
        self.serving = serving  # which ComputeDomains' IMEX channels each node serves (the extender's)
        self.locks = StripedLocks()
        self.exclusive = ExclusiveDesk(ledger, facts, member_view)  # JobSet exclusive placement
        self.failures = FailedPlans(ledger)
        # False: every filter plans again (`reuse`), selectors matched node by node (`indexed`): the
        # references the reuse and the label index are tested and measured against.
        self.reuse = True
        self.indexed = True
        # group -> (made at, its members, the slots): the latest preemption dry run's plan
        self._dry_runs: dict[tuple[str, str], tuple[float, frozenset[str], dict[str, Slot]]] = {}
        self._dry_runs_lock = threading.Lock()

    def slot_for(self, info: PodInfo, req: PodRequest, names: Sequence[str]) -> Slot | GroupWaiting | GroupFailure:
        assert req.group is not None and req.group_size is not None
        ledger = self.ledger
        key = (info.namespace, req.group)
        size = req.group_size
        asked = req
        if req.group_size_at_least:  # a PodGroup's minCount: every member present, once there are that many
            with ledger.lock:
                tally = ledger.pods.tally(key)
                size = max(size, len(tally.uids) + (info.name not in tally.names))
            req = req.model_copy(update={"group_size": size})
        with self.locks(key):
            held = self._held(key, info.name, size, names)
        if held is not None:
            return held
        if JOBSET_EXCLUSIVE in info.annotations:  # a JobSet's followers come after their leaders are placed
            with self.locks(key):
                found = self.exclusive.slot_for(info, req, names, ledger.group_members(key))
            if found is not None:
                return found
        # Ranks that clash, or members still missing (or too many), are told from the group's counts: each
        # member's first filters, while its gang still arrives, cost the same in a gang of 4,096 as of 8.
        with ledger.lock:  # the counts and the members read together
            tally = ledger.pods.tally(key)
            early = _rank_clash(key[1], tally, info.name, req.stage) or counted(key[1], tally.present(info.name), size)
            written = tally.written
            asker = self._asker(info, asked, size) if early is None else None
            reused = None
            if asker is not None and self.reuse and key not in ledger.reservations:
                reused = self.failures.reused(key, asker, written, names)
            records = ledger.group_members(key) if early is None and (reused is None or info.pod_group) else []
        if early is not None:
            return early
        if reused is not None:
            if not info.pod_group:
                return reused
            members = {r.name: member_view(r) for r in records}
            members[info.name] = MemberView(info.name, req)
            return self._preemption_dry_run(key, info, req, members, names) or reused
        members = {r.name: member_view(r) for r in records}
        members[info.name] = MemberView(info.name, req)  # the asking pod is always planned afresh
        with self.locks(key):
            res = ledger.reservations.get(key)
            if res is not None and res.members != frozenset(members):
                ledger.release(key, replan=True)  # the group changed (a member replaced): plan again
                res = None
            if res is not None:
                slot = res.slots.get(info.name)
                if slot is None or (not slot.pinned and ledger.resolve(slot.node, ledger.clock()).problem):
                    ledger.release(key, replan=True)  # the planned node went stale or away
                    res = None
            if res is None:
                planned = self._plan(key, info, req, members, names, asker, written)
                if isinstance(planned, GroupFailure) and info.pod_group:
                    return self._preemption_dry_run(key, info, req, members, names) or planned
                if not isinstance(planned, Reservation):
                    return planned
                res = planned
            return res.slots[info.name]

    def _preemption_dry_run(
        self,
        key: tuple[str, str],
        info: PodInfo,
        req: PodRequest,
        members: dict[str, MemberView],
        names: Sequence[str],
    ) -> Slot | None:
        """The member's slot as kube-scheduler's gang preemption sees the cluster, or None.

        On Kubernetes 1.37 a PodGroup that does not fit runs PodGroupPostFilter DefaultPreemption: it
        removes every pod of lower priority from its snapshot, runs the pod group cycle again (calling
        filter, never the preempt verb), then gives back the victims its own filters do not need and
        evicts the rest. Filter is not told which call is that dry run. A node on which kube-scheduler's
        own count (the node's GPUs less the GPUs of the pods bound there) cannot fit the member is sent
        to filter only when pods were removed from it, so such a node marks the dry run. Then the group
        is planned (not reserved) as if the lower-priority pods outside the group were gone, and the
        member passes its planned node only: kube-scheduler's victims lie on the planned nodes."""
        ledger = self.ledger
        wanted = set(names)
        with ledger.lock:
            bound: dict[str, list[PodRecord]] = {}
            for rec in ledger.pods.values():
                if rec.active and rec.node_name in wanted:
                    bound.setdefault(rec.node_name, []).append(rec)
            freed = {
                n: frozenset().union(
                    *(
                        ledger.pod_gpus(n, r.uid) or frozenset()
                        for r in pods
                        if r.priority < info.priority and (r.namespace, r.group) != key
                    )
                )
                for n, pods in bound.items()
            }
        dry_run = False
        states: list[NodeState] = []
        for st in ledger.states(names):
            if st.problem is None and st.shape is not None:
                counted = sum(r.gpus for r in bound.get(st.name, ()))
                dry_run = dry_run or st.shape.n - counted < req.gpus
            gone = freed.get(st.name, frozenset())
            states.append(taking(st, st.in_use - gone) if gone & st.in_use else st)
        if not dry_run:
            return None
        now = ledger.clock()
        who = frozenset(members)
        with self._dry_runs_lock:
            made = self._dry_runs.get(key)
        if made is not None and now - made[0] <= DRY_RUN_PLAN_SECONDS and made[1] == who:
            slot = made[2].get(info.name)
            if slot is not None and slot.node in wanted:
                return slot
        assert req.group_size is not None
        out = replan(key[1], req.group_size, info.name, members, Candidates(states), ledger.tiers, ledger.weights)
        if not isinstance(out, Replan):
            return None
        with self._dry_runs_lock:
            self._dry_runs.pop(key, None)
            while len(self._dry_runs) >= DRY_RUN_PLANS_KEPT:
                del self._dry_runs[next(iter(self._dry_runs))]
            self._dry_runs[key] = (now, who, dict(out.slots))
        log.info(
            "group planned for kube-scheduler's preemption dry run (not reserved)",
            extra={"group": f"{key[0]}/{key[1]}", "plan": {s.member: s.node for s in out.slots.values()}},
        )
        return out.slots[info.name]

    def _held(self, key: tuple[str, str], name: str, size: int, nodes: Sequence[str]) -> Slot | None:
        """The asking member's slot when the group's reservation stands for exactly its members (and the
        asking pod) and its node is still good: what `slot_for` would return, without a view of every
        member. The members are compared with the slots once per version of the group's members (not per
        filter: that made a group's filters cost O(members^2)). The rank check ran when this plan was made.
        `nodes`: the filter's candidates, read once for a plan made before any (`Reservation.unchecked`)."""
        ledger = self.ledger
        res = ledger.reservations.get(key)
        if res is None or len(res.slots) != size:
            return None
        slot = res.slots.get(name)
        if slot is None:
            return None
        if res.unchecked and not slot.pinned:  # a plan made before kube-scheduler named any node (the gate's lift)
            res.unchecked = False
            if slot.node not in nodes:  # its own filters refuse the node (a taint, a cordon, CPU): plan over theirs
                ledger.release(key, replan=True)
                return None
        version = ledger.pods.tally(key).version  # read before the members: a change meanwhile moves it
        if res.members_checked != version or not version:
            names = {r.name for r in ledger.group_members(key)}
            if names == res.slots.keys():
                res.members_checked = version
            elif names | {name} != res.slots.keys():  # the asking pod is not in the ledger yet
                return None
        if not slot.pinned and ledger.resolve(slot.node, ledger.clock()).problem:
            return None
        return slot

    def _plan(
        self,
        key: tuple[str, str],
        info: PodInfo,
        req: PodRequest,
        members: dict[str, MemberView],
        names: Sequence[str],
        asker: Asker | None = None,
        written: int = 0,
    ) -> Reservation | GroupWaiting | GroupFailure:
        """Plan and reserve; a failure read from what `FailedPlans` can tell unchanged is kept for the
        group's next filters (`asker`: what the plan read of the asking pod, None: keep nothing)."""
        group = key[1]
        assert req.group_size is not None
        if info.node_selector:  # its candidates obey it already; other members' selectors name other nodes
            members = {**members, info.name: dataclasses.replace(members[info.name], selector=info.node_selector)}
        for _ in range(PLAN_ATTEMPTS):
            now = self.ledger.clock()
            generation = self.ledger.generation  # read before the nodes: a change meanwhile makes it stale
            labels = self.ledger.node_states.labels.generation
            states = self.ledger.states(names, now)
            picked: dict[Selector, frozenset[str]] = {}  # each selector's nodes, looked up once per plan
            selected = self._selected(members, names, info.node_selector, picked)
            extra = self.ledger.states(selected, now)
            left_out = ""
            if req.compute_domain is not None:
                states, extra, left_out = self._channels(req.compute_domain, states, extra, now)
            out = replan(
                group,
                req.group_size,
                info.name,
                members,
                Candidates(states, extra, self._picked(picked) if self.indexed else None),
                self.ledger.tiers,
                self.ledger.weights,
            )
            if isinstance(out, GroupFailure) and left_out:
                return GroupFailure(out.group, f"{out.message}; {left_out}")
            if isinstance(out, GroupFailure) and asker is not None:
                self.failures.keep(key, _Failed(out, asker, written, self.spelled(names), selected, generation, labels))
            if not isinstance(out, Replan):
                return out
            res = Reservation(key, now, dict(out.slots), out.plan)
            if self.ledger.reserve(res):
                log.info(
                    "group planned and reserved",
                    extra={
                        "group": f"{key[0]}/{key[1]}",
                        "plan": {s.member: s.node for s in res.slots.values()},
                        "pinned": sorted(s.member for s in res.slots.values() if s.pinned),
                    },
                )
                return res
        return GroupFailure(group, f"group {group}: the planned GPUs kept changing while planning; retrying")

    def spelled(self, names: Sequence[str]) -> list[str]:
        """`names` as the node cache spells them (its strings, shared), for keeping."""
        nodes = self.ledger.nodes
        return [e.name if (e := nodes.get(n)) is not None else n for n in names]

    def _asker(self, info: PodInfo, req: PodRequest, size: int) -> Asker | None:
        """What a plan reads of the asking pod beyond the members' records, when its record is what its
        filter carries (so the group's members read the same whoever asks); None: a plan made for it is
        kept for no one (it is not in the ledger yet, or its record differs, or its ComputeDomain's
        channels move with other pods)."""
        rec = self.ledger.pods.get(info.uid) if info.uid else None
        if (
            rec is None
            or req.compute_domain is not None
            or rec.name != info.name
            or rec.node_name
            or rec.topology_gated
            or rec.node_selector != info.node_selector
            or rec.request != req
        ):
            return None
        return (info.node_selector, req.spread, size)

    def _select(self, selector: Selector) -> frozenset[str]:
        """The nodes `selector` selects, from the node cache's label index."""
        with self.ledger.lock:
            return self.ledger.node_states.labels.select(selector)

    def _picked(self, picked: dict[Selector, frozenset[str]]) -> Callable[[Selector], frozenset[str]]:
        """`_select` answered from `picked` (what this plan's `_selected` looked up) where it holds the selector."""
        return lambda selector: found if (found := picked.get(selector)) is not None else self._select(selector)

    def _channels(
        self, cd: str, states: list[NodeState], extra: list[NodeState], now: float
    ) -> tuple[list[NodeState], list[NodeState], str]:
        """The nodes a gang of ComputeDomain `cd` may be planned on (gputopo.engine.gang.imex.group_candidates), among
        the candidates and the selected extra nodes, and what was left out."""
        serving = self.serving()
        served = {s.name: nvlink_domain(s) for s in self.ledger.states(serving, now)}
        kept, said = group_candidates(cd, states, serving, served)
        return kept, group_candidates(cd, extra, serving, served)[0], said

    def _selected(
        self,
        members: dict[str, MemberView],
        names: Sequence[str],
        mine: Selector,
        picked: dict[Selector, frozenset[str]],
    ) -> list[str]:
        """The nodes outside `names` that members' nodeSelectors select (Kueue TAS writes each member's
        domain there): a member held to other nodes than the asking pod's is planned there. Members with
        the asking pod's selector (`mine`) go where it may. Each distinct selector is looked up in the
        label index (`indexed`; its nodes kept in `picked`), else matched against every node's labels."""
        selectors = {m.selector for m in members.values() if m.selector and m.selector != mine}
        if not selectors:
            return []
        out: set[str] = set()
        if self.indexed:
            with self.ledger.lock:  # once for every selector, not once each
                labels = self.ledger.node_states.labels
                for sel in selectors:
                    picked[sel] = found = labels.select(sel)
                    out.update(found)
            return sorted(out.difference(names))
        nodes = self.ledger.nodes
        scan: list[Selector] = []
        for sel in selectors:
            host = dict(sel).get(HOSTNAME)
            entry = nodes.get(host) if host is not None else None
            if entry is not None and selects(sel, entry.name, entry.labels):
                out.add(entry.name)
            else:
                scan.append(sel)
        if scan:
            for name, entry in list(nodes.items()):
                if any(selects(sel, name, entry.labels) for sel in scan):
                    out.add(name)
        return sorted(out.difference(names))
