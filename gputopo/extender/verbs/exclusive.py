"""A JobSet member's filter under JobSet's exclusive placement (docs/annotations.md, "JobSet exclusive
placement"): the whole JobSet planned once every Job's leader exists, the followers not created yet held
as slots of the group's reservation, each matched to its pod by rank when the pod comes.

JobSet's pod webhook refuses a Job's followers (completion index > 0) until the Job's leader is scheduled,
so the ordinary group path (plan once every member exists) would wait for ever. Here a follower not
created yet is a slot named 'job#index' (`ExclusiveJobs.slot`) asking what its Job's leader asks; the
reservation holds its GPUs as it holds any member's, until the reservation timeout. When the follower's
pod comes (its nodeSelector its leader's domain) the slot is renamed to the pod, on the same node and
GPUs; once every slot is a pod's, the group desk's fast path finds them as for any group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from gputopo.engine.gang.exclusive import ExclusiveJob, plan_exclusive
from gputopo.engine.gang.plan import GroupFailure, Member, Placed
from gputopo.engine.gang.replan import GroupWaiting, MemberView, Slot
from gputopo.extender.settings import DEFAULT_MAX_HELD_GPUS_PER_NAMESPACE
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.records import PodRecord
from gputopo.extender.state.reservations import GroupKey, Reservation
from gputopo.extender.watch.quotas import QuotaRoom
from gputopo.extender.wire import PodInfo
from gputopo.model import AnnotationError, ControllerFacts, PodRequest, infer_group
from gputopo.model.jobs import JOB_CONTROLLER_UID, JOBSET_EXCLUSIVE, ExclusiveJobs

log = logging.getLogger("gputopo.extender.groups")

PLAN_ATTEMPTS = 3  # as the group desk: a planned GPU taken between planning and reserving plans again
Views = dict[int, MemberView]  # the members that exist, by rank in the JobSet


class ExclusiveDesk:
    """The filter of a JobSet member under exclusive placement, over the ledger; `facts` gives a
    namespace's controller objects (the JobSet's Jobs), `view` a member record as planning sees it."""

    def __init__(
        self, ledger: Ledger, facts: Callable[[str], ControllerFacts], view: Callable[[PodRecord], MemberView]
    ) -> None:
        self.ledger = ledger
        self.facts = facts
        self.view = view
        # GPUs one namespace may hold for pods not created yet where no ResourceQuota bounds its GPUs
        # (--max-held-gpus-per-namespace): no quota counts a pod that does not exist, so a hold is bounded
        # by what the namespace's quotas have room for when the pods come, and by this without one.
        self.max_promised = DEFAULT_MAX_HELD_GPUS_PER_NAMESPACE
        self.quota: Callable[[str], QuotaRoom | None] = lambda namespace: None  # the cache's Quotas.room
        # Why the JobSet (namespace, name, UID) a Job's ownerReference names will create no pods (the cache's
        # JobSets.why_not_owner; None: it will, or JobSets are not watched).
        self.owner: Callable[[str, str, str], str | None] = lambda namespace, name, uid: None

    def slot_for(
        self, info: PodInfo, req: PodRequest, names: Sequence[str], records: Sequence[PodRecord]
    ) -> Slot | GroupWaiting | GroupFailure | None:
        """The member's slot, or why it has none; None when the pod is no member of a JobSet under
        exclusive placement (the ordinary group path decides). The caller holds the group's lock."""
        try:
            inferred = infer_group(info.labels, info.annotations, self.facts(info.namespace), pod_group=info.pod_group)
        except AnnotationError:
            return None  # the ordinary path tells the pod which label is at fault
        ex = inferred.exclusive if inferred is not None and inferred.group == req.group else None
        if ex is None or req.group is None or req.stage is None or req.group_size is None:
            return None
        key = (info.namespace, req.group)
        views = _views(req, info, ex.key, records, self.view)
        if isinstance(views, GroupFailure):
            return views
        unheld = self._unheld(info, req.group, req.stage, ex, records)
        if unheld is not None:
            if key in self.ledger.reservations:
                self.ledger.release(key)  # what it held for will not come
            return GroupFailure(
                req.group,
                f"group {req.group}: JobSet exclusive placement holds GPUs only for pods a running Job of the "
                f"JobSet will create: {unheld}",
            )
        held = self._held(key, info.name, req.stage, ex, views, req.group_size)
        if held is not None:
            return held
        offsets = _offsets(ex)
        present = sum(1 for off in offsets if off in views)
        if present < len(offsets):
            return GroupWaiting(
                req.group,
                f"group {req.group}: JobSet exclusive placement ({ex.key}): the leaders of {present}/{len(offsets)} "
                "Jobs exist, waiting",
            )
        return self._plan(key, info.name, ex, views, names)

    def _over_bound(self, key: GroupKey, slots: dict[str, Slot]) -> GroupFailure | None:
        """The failure when holding `slots`' followers not created yet would take the namespace's GPUs
        held for pods not created yet past its bound (None: within it): the room its tightest ResourceQuota
        on GPUs has left, else `max_promised`."""
        promised = sum(len(s.gpus) for name, s in slots.items() if "#" in name and not s.pinned)
        if not promised:
            return None
        ledger = self.ledger
        with ledger.lock:
            held = ledger.book.held_by_namespace(promised=True).get(key[0], 0)
            mine = ledger.reservations.get(key)
            if mine is not None:  # replaced by this plan's reservation
                held -= sum(len(s.gpus) for name, s in mine.slots.items() if "#" in name and not s.pinned)
        quota = self.quota(key[0])
        bound = self.max_promised if quota is None else quota.free
        if held + promised <= bound:
            return None
        why = "--max-held-gpus-per-namespace" if quota is None else quota.words()
        return GroupFailure(
            key[1],
            f"group {key[1]}: JobSet exclusive placement would hold {promised} GPUs for pods not created yet; "
            f"namespace {key[0]} holds {held} for such pods already and may hold at most {bound} ({why})",
        )

    def _unheld(
        self, info: PodInfo, group: str, rank: int, ex: ExclusiveJobs, records: Sequence[PodRecord]
    ) -> str | None:
        """Why the followers not created yet may not be held (None: they may): each Job must exist, be
        controlled by the JobSet (which exists, with the UID the Job's ownerReference names, where JobSets
        are watched), not be suspended nor finished, and its leader must be its own pod (its
        controller-uid label the Job's UID), not one made by hand with the JobSet's labels."""
        jobset = group.split("/", 1)[1]
        facts = self.facts(info.namespace)
        offsets = _offsets(ex)
        leaders = set(offsets)
        uids = {rank: (info.name, info.labels.get(JOB_CONTROLLER_UID, ""))} if rank in leaders else {}
        for rec in records:
            stage = rec.request.stage if rec.request is not None else None
            if stage in leaders and rec.name != info.name:
                uids[stage] = (rec.name, dict(rec.job_keys).get(JOB_CONTROLLER_UID, ""))
        for (job, _), off in zip(ex.jobs, offsets, strict=True):
            shape = facts.jobs.get(job)
            if shape is None:
                return f"Job {job} does not exist"
            why = shape.creates(jobset) or self.owner(info.namespace, jobset, shape.owner_jobset_uid)
            if why is not None:
                return why
            pod, uid = uids.get(off, ("", shape.uid))
            if uid != shape.uid:
                return (
                    f"pod {pod} carries Job {job}'s labels but the Job did not create it "
                    f"({JOB_CONTROLLER_UID} is not the Job's UID)"
                )
        return None

    def _held(self, key: GroupKey, me: str, rank: int, ex: ExclusiveJobs, views: Views, size: int) -> Slot | None:
        """The member's slot when the reservation stands for these members (each existing pod's rank held
        under its name, or under its slot's name while it did not exist) and its node is still good; a slot
        held for a pod that exists now takes the pod's name. Releases a reservation that does not stand."""
        ledger = self.ledger
        res = ledger.reservations.get(key)
        if res is None:
            return None
        by_rank = {s.stage: s for s in res.slots.values()}
        renames: dict[str, str] = {}
        for r, v in views.items():
            s = by_rank.get(r)
            if s is None or (s.member != v.name and s.member != ex.slot(r)):
                break
            if s.member != v.name:
                renames[s.member] = v.name
        else:
            mine = by_rank[rank]
            if len(res.slots) == size and (mine.pinned or not ledger.resolve(mine.node, ledger.clock()).problem):
                if renames:
                    with ledger.lock:
                        renamed = ledger.book.rename(key, renames)
                    res = renamed if renamed is not None else res
                return res.slots.get(me)
        ledger.release(key, replan=True)  # a member replaced, a node gone: plan again
        return None

    def _plan(
        self, key: GroupKey, me: str, ex: ExclusiveJobs, views: Views, names: Sequence[str]
    ) -> Slot | GroupFailure:
        """Plan every Job in a domain of its own, the followers not created yet as held slots, and reserve."""
        group = key[1]
        ledger = self.ledger
        jobs = _jobs(group, me, ex, views)
        if isinstance(jobs, GroupFailure):
            return jobs
        pinned = sorted({v.node for *_, bound in jobs for _, v in bound if v.node})
        # The asking pod's Job goes where kube-scheduler let the pod go; the other Jobs anywhere the label is
        # (a follower is offered its own Job's domain only, and the other Jobs keep theirs).
        mine = frozenset(names)
        offered = [*names, *(n for n, e in list(ledger.nodes.items()) if ex.key in e.labels and n not in mine)]
        for _ in range(PLAN_ATTEMPTS):
            now = ledger.clock()
            known = {s.name: s for s in ledger.states(pinned, now)} if pinned else {}
            asked = [
                ExclusiveJob(
                    job,
                    off,
                    tuple(todo),
                    tuple(Placed(i, known.get(v.node or ""), _gpus(v)) for i, v in bound),
                    mine if any(m.name == me for m in todo) else None,
                )
                for job, off, todo, bound in jobs
            ]
            planned = plan_exclusive(group, asked, ex.key, ledger.states(offered, now), ledger.tiers, ledger.weights)
            if isinstance(planned, GroupFailure):
                return planned
            slots = {
                a.member: Slot(a.member, a.node.name, frozenset(a.outcome.gpus), a.stage, False, a)
                for a in planned.assignments
            }
            for _job, off, _todo, bound in jobs:
                for i, v in bound:
                    slots[v.name] = Slot(v.name, v.node or "", v.gpus, off + i, True)
            over = self._over_bound(key, slots)
            if over is not None:
                return over
            if ledger.reserve(Reservation(key, now, slots, planned)):
                log.info(
                    "JobSet planned for exclusive placement and reserved",
                    extra={
                        "group": f"{key[0]}/{group}",
                        "plan": {s.member: s.node for s in slots.values()},
                        "held": sorted(n for n in slots if "#" in n),
                    },
                )
                return slots[me]
        return GroupFailure(group, f"group {group}: the planned GPUs kept changing while planning; retrying")


Job = tuple[str, int, list[Member], list[tuple[int, MemberView]]]  # name, leader's rank, to plan, bound


def _jobs(group: str, me: str, ex: ExclusiveJobs, views: Views) -> list[Job] | GroupFailure:
    """Each Job's members to plan (the pods not bound, and a slot asking what the leader asks for each
    pod not created yet) and its members bound already, by completion index."""
    jobs: list[Job] = []
    for (job, count), off in zip(ex.jobs, _offsets(ex), strict=True):
        leader = views[off].request
        if leader is None:
            return GroupFailure(group, f"group {group}: member {views[off].name}: {views[off].problem}")
        todo: list[Member] = []
        bound: list[tuple[int, MemberView]] = []
        for i in range(count):
            v = views.get(off + i)
            if v is not None and v.node and v.name != me:
                bound.append((i, v))
                continue
            asks = v.request if v is not None and v.request is not None else leader
            name = v.name if v is not None else ex.slot(off + i)
            todo.append(Member(name, asks.model_copy(update={"stage": off + i})))
        jobs.append((job, off, todo, bound))
    return jobs


def _gpus(v: MemberView) -> tuple[int, ...]:
    return tuple(sorted(v.gpus))


def _offsets(ex: ExclusiveJobs) -> list[int]:
    """Each Job's leader's rank in the JobSet."""
    out, off = [], 0
    for _, count in ex.jobs:
        out.append(off)
        off += count
    return out


def _views(
    req: PodRequest, info: PodInfo, key: str, records: Sequence[PodRecord], view: Callable[[PodRecord], MemberView]
) -> Views | GroupFailure:
    """The members that exist by rank (the asking pod planned afresh), or why they cannot be planned."""
    group = req.group
    assert group is not None and req.stage is not None
    views: Views = {req.stage: MemberView(info.name, req)}
    for rec in records:
        if rec.name == info.name:
            continue
        if rec.request is None:
            return GroupFailure(group, f"group {group}: member {rec.name}: {rec.problem or 'its request is invalid'}")
        inferred = rec.inferred
        if inferred is None or inferred.group != group or inferred.exclusive is None:
            return GroupFailure(
                group,
                f"group {group}: pod {rec.name} is not under JobSet exclusive placement ({JOBSET_EXCLUSIVE}) as "
                f"{info.name} is; gputopo plans it for a JobSet all of whose Jobs use it",
            )
        if inferred.exclusive.key != key:
            return GroupFailure(
                group,
                f"group {group}: pods {rec.name} and {info.name} name different {JOBSET_EXCLUSIVE} labels "
                f"({inferred.exclusive.key}, {key}); gputopo plans one label for the whole JobSet",
            )
        rank = rec.request.stage
        if rank is None or rank in views:
            other = views[rank].name if rank is not None else "?"
            clash = f"rank {rank} ({inferred.rank_label}) is claimed by more than one pod: {other}, {rec.name}"
            return GroupFailure(group, f"group {group}: {clash}")
        views[rank] = view(rec)
    return views
