"""The controller objects inference reads (batch/v1 Jobs, scheduling.k8s.io PodGroups), kept per namespace
as `ControllerFacts`, and the pods inferred again when they change: a waiting member becomes a member
with a size, a Job that changed changes its members, a controller deleted frees its group's reservation.

The maps are replaced whole per namespace, never mutated, so the pod informer's thread reads a namespace's
facts without a lock while the Job and PodGroup informers change others; the ledger locks its own state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.podindex import ControllerRef
from gputopo.extender.state.records import (
    AskReader,
    ChannelReader,
    ClaimReader,
    PodRecord,
    no_asks,
    no_channels,
    no_claims,
)
from gputopo.extender.watch.handlers import Bad, KindHandler, each_readable
from gputopo.extender.watch.parsers import job_shape, podgroup_of, record_of
from gputopo.kube import JOBS, JSON, PODGROUPS
from gputopo.model import ControllerFacts, JobShape
from gputopo.model.jobs import PodGroupShape

JobEntry = tuple[JobShape, str | None]  # a Job's shape and the JobSet it belongs to


class Controllers:
    """Jobs and PodGroups by namespace and name, the facts inference reads from them, and re-inference."""

    def __init__(self, ledger: Ledger, bad: Bad) -> None:
        self.ledger = ledger
        self._bad = bad
        # batch/v1 Jobs (with the JobSet each belongs to): the sizes that pod labels do not carry.
        self._jobs: dict[str, dict[str, JobEntry]] = {}
        # scheduling.k8s.io PodGroups: native gangs (size, required tier).
        self._podgroups: dict[str, dict[str, PodGroupShape]] = {}
        self._facts: dict[str, ControllerFacts] = {}
        # One object's event infers again only the pods that name it (the ledger's index); False: every
        # labelled pod of its namespace, the reference the index is checked and measured against.
        self.by_object = True
        self.channels: ChannelReader = no_channels  # the cache's templates: a record read again keeps its CD
        self.asks: AskReader = no_asks  # and what its hand-written claim template asks
        self.claims: ClaimReader = no_claims  # and the pre-made claims it names

    def handlers(self) -> dict[str, KindHandler]:
        return {
            JOBS.name: KindHandler(self.replace_jobs, self.apply_job),
            PODGROUPS.name: KindHandler(self.replace_podgroups, self.apply_podgroup),
        }

    def facts(self, namespace: str) -> ControllerFacts:
        """The controller objects of `namespace` that inference reads (sizes of Jobs, JobSets, PodGroups)."""
        found = self._facts.get(namespace)
        if found is None:
            found = self._facts[namespace] = dataclasses.replace(
                _facts_of(self._jobs.get(namespace, {})), podgroups=self._podgroups.get(namespace, {})
            )
        return found

    def facts_for(self, obj: JSON) -> ControllerFacts:
        """The facts of an object's namespace ("default" when it names none)."""
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        namespace = meta.get("namespace") if isinstance(meta, dict) else None
        return self.facts(namespace if isinstance(namespace, str) and namespace else "default")

    # ------------------------------------------------------------------ Jobs

    def _put_jobs(self, namespace: str, jobs: dict[str, JobEntry]) -> None:
        if jobs:
            self._jobs[namespace] = jobs
        else:
            self._jobs.pop(namespace, None)
        self._facts.pop(namespace, None)

    def replace_jobs(self, items: list[JSON]) -> None:
        by_ns: dict[str, dict[str, JobEntry]] = {}
        for _, (namespace, shape, jobset) in each_readable(JOBS.name, items, job_shape, self._bad):
            by_ns.setdefault(namespace, {})[shape.name] = (shape, jobset)
        touched = {ns for ns in set(self._jobs) | set(by_ns) if self._jobs.get(ns) != by_ns.get(ns)}
        for namespace in touched:
            self._put_jobs(namespace, by_ns.get(namespace, {}))
        self._reinfer(touched)

    def apply_job(self, event_type: str, obj: JSON) -> None:
        namespace, shape, jobset = job_shape(obj)
        jobs = dict(self._jobs.get(namespace, {}))
        before = jobs.get(shape.name)
        # Ranks across a JobSet's Jobs depend on every Job: its pods (by the JobSet it was and is in) read it.
        refs = [(namespace, "job", shape.name)] + [
            (namespace, "jobset", js) for js in {jobset, before[1] if before else None} if js is not None
        ]
        if event_type == "DELETED":
            jobs.pop(shape.name, None)
        elif jobs.get(shape.name) == (shape, jobset):
            # A status update (the Job controller's counts, many per big Job): nothing inference reads
            # changed, so no pod of the namespace is inferred again.
            return
        else:
            jobs[shape.name] = (shape, jobset)
        self._put_jobs(namespace, jobs)
        if event_type == "DELETED" or shape.suspended or shape.finished:
            # The controller is gone, suspended or done: its group's reservation holds GPUs for pods that
            # will not come.
            self.ledger.release((namespace, f"job/{shape.name}"))
            if jobset is not None:
                self.ledger.release((namespace, f"jobset/{jobset}"))
        self._reinfer_naming(namespace, refs)

    # ------------------------------------------------------------------ PodGroups

    def _put_podgroups(self, namespace: str, groups: dict[str, PodGroupShape]) -> None:
        if groups:
            self._podgroups[namespace] = groups
        else:
            self._podgroups.pop(namespace, None)
        self._facts.pop(namespace, None)

    def replace_podgroups(self, items: list[JSON]) -> None:
        by_ns: dict[str, dict[str, PodGroupShape]] = {}
        read = functools.partial(podgroup_of, tiers=self.ledger.tiers)
        for _, (namespace, pg) in each_readable(PODGROUPS.name, items, read, self._bad):
            by_ns.setdefault(namespace, {})[pg.name] = pg
        changed = {ns for ns in set(self._podgroups) | set(by_ns) if self._podgroups.get(ns) != by_ns.get(ns)}
        for namespace in changed:
            gone = set(self._podgroups.get(namespace, {})) - set(by_ns.get(namespace, {}))
            self._put_podgroups(namespace, by_ns.get(namespace, {}))
            for name in gone:
                self.ledger.release((namespace, f"podgroup/{name}"))
        self._reinfer(changed)

    def apply_podgroup(self, event_type: str, obj: JSON) -> None:
        namespace, shape = podgroup_of(obj, self.ledger.tiers)
        groups = dict(self._podgroups.get(namespace, {}))
        if event_type == "DELETED":
            groups.pop(shape.name, None)
        elif groups.get(shape.name) == shape:
            return  # a status update (kube-scheduler's conditions): nothing inference reads changed
        else:
            groups[shape.name] = shape
        self._put_podgroups(namespace, groups)
        if event_type == "DELETED":
            # Its pods will not be scheduled as this gang any more: free what the plan held for them.
            self.ledger.release((namespace, f"podgroup/{shape.name}"))
        self._reinfer_naming(namespace, [(namespace, "podgroup", shape.name)])

    # ------------------------------------------------------------------ re-inference

    def _reinfer(self, namespaces: Iterable[str]) -> None:
        """Infer again the groups of pods whose controller's labels were read before their Job was: a
        waiting member becomes a member with a size, a Job that changed changes its members."""
        spaces = set(namespaces)
        if not spaces:
            return
        with self.ledger.lock:
            stale = [r for r in self.ledger.pods.values() if (r.job_keys or r.pod_group) and r.namespace in spaces]
        self.read_again(stale)

    def _reinfer_naming(self, namespace: str, refs: list[ControllerRef]) -> None:
        """Infer again the pods that name one of `refs` (one object's event): no other pod reads it."""
        if not self.by_object:
            self._reinfer([namespace])
            return
        with self.ledger.lock:
            stale = self.ledger.pods.naming(refs)
        self.read_again(stale)

    def read_again(self, stale: list[PodRecord]) -> None:
        """Record each pod again (its controller's facts or its claim templates changed)."""
        for rec in stale:
            fresh = self._record_again(rec)
            if fresh != rec:
                self.ledger.put_pod(rec.uid, fresh)

    def _record_again(self, rec: PodRecord) -> PodRecord | None:
        info = rec.info_again()
        facts = self.facts(rec.namespace)
        again = record_of(
            info,
            self.ledger.tier_names,
            facts,
            scheduler=self.ledger.scheduler_name,
            channels=self.channels,
            asks=self.asks,
            claims=self.claims,
        )
        return again if again is None or rec.placement is None else dataclasses.replace(again, placement=rec.placement)


def _facts_of(jobs: dict[str, JobEntry]) -> ControllerFacts:
    """One namespace's Jobs as inference reads them: by name, and each JobSet's by global index."""
    jobsets: dict[str, dict[int, JobShape]] = {}
    for shape, jobset in jobs.values():
        if jobset is not None and shape.global_index is not None:
            jobsets.setdefault(jobset, {})[shape.global_index] = shape
    return ControllerFacts(jobs={n: sh for n, (sh, _) in jobs.items()}, jobsets=jobsets)
