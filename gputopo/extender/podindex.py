"""The ledger's pods by UID, and beside them the pods that name each controller object (a Job, a JobSet, a
PodGroup): a controller's event infers again only the pods that read it, not every pod of its namespace.

A pod's inference reads the facts of exactly the objects its record names (`gputopo.model.controllers`: a
Job's pods read the Job by `batch.kubernetes.io/job-name`, a JobSet's read its Jobs by
`jobset.sigs.k8s.io/jobset-name`, a PodGroup member its PodGroup by `spec.schedulingGroup.podGroupName`),
so the pods indexed under an object are all the pods whose inference it can change. The index is kept on
every write of the table, so it holds no more than the pods themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar, overload

from gputopo.extender.objects import PodRecord
from gputopo.model.controllers import JOB_NAME, JOBSET_NAME

ControllerRef = tuple[str, str, str]  # (namespace, "job" | "jobset" | "podgroup", name)

_T = TypeVar("_T")


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


class PodTable(dict[str, PodRecord]):
    """Pods by UID, with `by_controller`: the UIDs of the pods that name each controller object. Kept
    through item assignment, `del` and `pop`, the ledger's only writes."""

    def __init__(self, records: Mapping[str, PodRecord] | None = None) -> None:
        super().__init__()
        self.by_controller: dict[ControllerRef, set[str]] = {}
        for uid, rec in (records or {}).items():
            self[uid] = rec

    def __setitem__(self, uid: str, rec: PodRecord) -> None:
        old = self.get(uid)
        if old is not None:
            self._unindex(uid, old)
        super().__setitem__(uid, rec)
        for ref in controller_refs(rec):
            self.by_controller.setdefault(ref, set()).add(uid)

    def __delitem__(self, uid: str) -> None:
        rec = self[uid]
        super().__delitem__(uid)
        self._unindex(uid, rec)

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

    def _unindex(self, uid: str, rec: PodRecord) -> None:
        for ref in controller_refs(rec):
            uids = self.by_controller.get(ref)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self.by_controller[ref]
