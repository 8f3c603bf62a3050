"""The ledger's pods by UID, and beside them the pods that name each controller object (a Job, a JobSet, a
PodGroup): a controller's event infers again only the pods that read it, not every pod of its namespace.

A pod's inference reads the facts of exactly the objects its record names (`gputopo.model.joblabels`: a
Job's pods read the Job by `batch.kubernetes.io/job-name`, a JobSet's read its Jobs by
`jobset.sigs.k8s.io/jobset-name`, a PodGroup member its PodGroup by `spec.schedulingGroup.podGroupName`),
so the pods indexed under an object are all the pods whose inference it can change. The index is kept on
every write of the table, so it holds no more than the pods themselves.

So are each group's members (the active pods of the ledger's scheduler that name the group), as a
`GroupTally`: what a member's filter reads of the others before a plan (how many, their ranks) and a
version that moves only when members come, go or are renamed (not when one is bound), so that a filter
costs the same in a group of 4,096 as in one of 8, not a view of every member per call.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TypeVar, overload

from gputopo.extender.state.records import PodRecord
from gputopo.extender.state.reservations import GroupKey
from gputopo.model import SCHEDULER_NAME
from gputopo.model.gates import GROUP_GATE
from gputopo.model.joblabels import JOB_NAME, JOBSET_NAME

ControllerRef = tuple[str, str, str]  # (namespace, "job" | "jobset" | "podgroup", name)

_T = TypeVar("_T")
_VERSIONS = itertools.count(1)  # one sequence for every table: a group's version never comes back


def controller_refs(rec: PodRecord) -> list[ControllerRef]:
    """The controller objects whose facts `rec`'s inference reads (as `_record_again` rebuilds it)."""
    keys = dict(rec.job_keys)
    refs: list[ControllerRef] = []
    for kind, key in (("job", JOB_NAME), ("jobset", JOBSET_NAME)):
        name = keys.get(key)
        if name is not None:
            refs.append((rec.namespace, kind, name))
    if rec.pod_group:
        refs.append((rec.namespace, "podgroup", rec.pod_group))
    return refs


def _count(counter: Counter[str], key: str, step: int) -> None:
    counter[key] += step
    if counter[key] <= 0:
        del counter[key]


class GroupTally:
    """One group's members: their UIDs, `version` (moves when members come, go or are renamed; a global
    sequence, so it never comes back), and counts kept as they change: pods by name, rank labels, and the
    names that claim each rank (a request's stage)."""

    def __init__(self) -> None:
        self.uids: set[str] = set()
        self.version = 0
        # Moves on every write that changes a member's record (bound, its request or selector edited) as
        # well as with `version`: a plan's failure is reused only while it stands (gputopo.extender.verbs.gangs).
        self.written = 0
        self.names: Counter[str] = Counter()
        self.labels: Counter[str] = Counter()  # the controllers' rank labels the members were inferred from
        self.ranks: dict[int, Counter[str]] = {}
        self.clashing: set[int] = set()  # ranks that more than one name claims

    def count(self, rec: PodRecord, step: int) -> None:
        """Count `rec` in (step 1) or out (-1)."""
        _count(self.names, rec.name, step)
        if rec.inferred is not None and rec.inferred.rank_label:
            _count(self.labels, rec.inferred.rank_label, step)
        stage = rec.request.stage if rec.request is not None else None
        if stage is not None:
            names = self.ranks.setdefault(stage, Counter())
            _count(names, rec.name, step)
            if len(names) > 1:
                self.clashing.add(stage)
            else:
                self.clashing.discard(stage)
                if not names:
                    del self.ranks[stage]

    def present(self, name: str) -> int:
        """How many members the group has once pod `name` is counted (by name: one pod, one member)."""
        return len(self.names) + (name not in self.names)

    def clash(self, name: str, stage: int | None) -> tuple[int, list[str]] | None:
        """The lowest rank more than one member claims and its claimants, pod `name` counted at `stage`
        whatever its record says (the asking pod is planned afresh); None when no rank is claimed twice."""
        for rank in sorted(self.clashing | ({stage} if stage is not None else set())):
            names = {n for n in self.ranks.get(rank, ()) if n != name} | ({name} if rank == stage else set())
            if len(names) > 1:
                return rank, sorted(names)
        return None


def _serve(channels: dict[str, Counter[str]], rec: PodRecord, step: int) -> None:
    """Count a bound active pod of a ComputeDomain in (1) or out (-1) of its node's channel."""
    cd = rec.request.compute_domain if rec.request is not None else None
    if cd is None or not rec.node_name or not rec.active:
        return
    counts = channels.setdefault(rec.node_name, Counter())
    _count(counts, cd, step)
    if not counts:
        del channels[rec.node_name]


_NO_MEMBERS = GroupTally()  # what a group without members reads (never written)


class PodTable(dict[str, PodRecord]):
    """Pods by UID, with `by_controller`: the UIDs of the pods that name each controller object, and `groups`:
    each group's members (`GroupTally`). Kept through item assignment, `del` and `pop`, the ledger's only writes."""

    def __init__(self, records: Mapping[str, PodRecord] | None = None, scheduler_name: str = SCHEDULER_NAME) -> None:
        super().__init__()
        self.scheduler_name = scheduler_name  # only its pods are group members
        self.by_controller: dict[ControllerRef, set[str]] = {}
        self.groups: dict[GroupKey, GroupTally] = {}  # only groups with members
        # node -> the ComputeDomains whose IMEX channel its bound active pods claim (gputopo.engine.gang.imex)
        self.channels: dict[str, Counter[str]] = {}
        self.gated: set[str] = set()  # the pods that carry gputopo's gate (gputopo.extender.verbs.groupgates lifts it)
        for uid, rec in (records or {}).items():
            self[uid] = rec

    def group_of(self, rec: PodRecord) -> GroupKey | None:
        """The group `rec` is a member of: an active pod of this scheduler that names one (another scheduler's
        pod is no member)."""
        if rec.group and rec.active and rec.scheduler_name == self.scheduler_name:
            return (rec.namespace, rec.group)
        return None

    def keep_versions(self, before: PodTable) -> None:
        """Give each group whose members are the same records as in `before` (a relist that changed
        nothing of it) its versions there: what was checked or planned against them stays valid."""
        for key, tally in self.groups.items():
            old = before.groups.get(key)
            if old is not None and old.uids == tally.uids and all(before.get(u) == self[u] for u in tally.uids):
                tally.version, tally.written = old.version, old.written

    def members(self, key: GroupKey) -> list[PodRecord]:
        return [self[u] for u in self.tally(key).uids]

    def tally(self, key: GroupKey) -> GroupTally:
        """The group's members as counted (read it under the ledger's lock); version 0 while it has none."""
        return self.groups.get(key, _NO_MEMBERS)

    def __setitem__(self, uid: str, rec: PodRecord) -> None:
        old = self.get(uid)
        if old is not None:
            self._unindex(uid, old, rec)
        super().__setitem__(uid, rec)
        _serve(self.channels, rec, 1)
        if GROUP_GATE in rec.gates:
            self.gated.add(uid)
        else:
            self.gated.discard(uid)
        for ref in controller_refs(rec):
            self.by_controller.setdefault(ref, set()).add(uid)
        key = self.group_of(rec)
        if key is not None:
            tally = self.groups.get(key) or self.groups.setdefault(key, GroupTally())
            tally.count(rec, 1)
            if old is None or not self._same_member(old, rec):
                tally.uids.add(uid)
                tally.version = next(_VERSIONS)
            if old != rec:
                tally.written = next(_VERSIONS)

    def __delitem__(self, uid: str) -> None:
        rec = self[uid]
        super().__delitem__(uid)
        self.gated.discard(uid)
        self._unindex(uid, rec, None)

    @overload
    def pop(self, uid: str, /) -> PodRecord: ...
    @overload
    def pop(self, uid: str, default: PodRecord, /) -> PodRecord: ...
    @overload
    def pop(self, uid: str, default: _T, /) -> PodRecord | _T: ...

    def pop(self, uid: str, *default: object) -> object:
        if uid not in self:
            if default:
                return default[0]
            raise KeyError(uid)
        rec = self[uid]
        del self[uid]
        return rec

    def naming(self, refs: Iterable[ControllerRef]) -> list[PodRecord]:
        """The pods that name any of `refs`, each once."""
        uids: set[str] = set()
        for ref in refs:
            uids |= self.by_controller.get(ref, set())
        return [self[u] for u in sorted(uids)]

    def _same_member(self, old: PodRecord, new: PodRecord) -> bool:
        """One member before and after a write (bound, say): its group's version stays."""
        return old.name == new.name and self.group_of(old) == self.group_of(new)

    def serving(self) -> dict[str, frozenset[str]]:
        """Which ComputeDomains' channels each node serves now (read it under the ledger's lock)."""
        return {node: frozenset(cds) for node, cds in self.channels.items()}

    def _unindex(self, uid: str, rec: PodRecord, new: PodRecord | None) -> None:
        _serve(self.channels, rec, -1)
        for ref in controller_refs(rec):
            uids = self.by_controller.get(ref)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self.by_controller[ref]
        key = self.group_of(rec)
        if key is None:
            return
        tally = self.groups[key]
        tally.count(rec, -1)
        if new is not None and self._same_member(rec, new):
            return  # counted in again at once
        tally.uids.discard(uid)
        tally.version = tally.written = next(_VERSIONS)
        if not tally.uids:
            del self.groups[key]
