"""Which JobSets exist (the JobSets informer, `jobset.x-k8s.io/v1alpha2`): a Job's JobSet ownerReference holds
GPUs for the Job's pods not created yet only while a JobSet of that name and that UID exists in the Job's
namespace (docs/annotations.md, "JobSet exclusive placement").

An ownerReference is written by whoever creates the Job: one naming a JobSet that does not exist, or one of
the same name made after (another UID), names no controller that will create pods. Where the API server
does not serve JobSets (no JobSet controller installed) the Job's ownerReference is read alone, as when
nothing watches JobSets; until JobSets are listed once, nothing is held (the answer is not known yet).

A JobSet deleted, or replaced by one of the same name and another UID, frees the group reservation of its
name at once; its members' next filter says why nothing is held.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputopo.extender.state.ledger import Ledger
from gputopo.extender.watch.handlers import Bad, KindHandler, each_readable
from gputopo.kube import JOBSETS, JSON

MAX_UID = 128  # longer than any UID the API server makes (36 characters)
MAX_NAME = 253  # a DNS-1123 subdomain

JobSetKey = tuple[str, str, str]  # (namespace, name, uid)


def jobset_identity(obj: Any) -> JobSetKey:
    """A JobSet's (namespace, name, UID); ValueError naming the field that is missing or unreadable."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ValueError("metadata is missing or not an object")
    out = []
    for field, most in (("namespace", MAX_NAME), ("name", MAX_NAME), ("uid", MAX_UID)):
        value = meta.get(field)
        if not isinstance(value, str) or not value or len(value) > most:
            raise ValueError(f"metadata.{field} is missing, not a string or longer than {most} characters")
        out.append(value)
    return out[0], out[1], out[2]


class JobSets:
    """The JobSets by namespace and name (their UIDs), and whether the API server serves them (module doc).

    Each namespace's map is replaced whole, never mutated, so filters read it without a lock."""

    def __init__(self, ledger: Ledger, bad: Bad) -> None:
        self.ledger = ledger
        self._bad = bad
        self._uids: dict[str, dict[str, str]] = {}
        self.listed = False
        self.served = True

    def handlers(self) -> dict[str, KindHandler]:
        return {JOBSETS.name: KindHandler(self.replace, self.apply, self._not_served)}

    def _not_served(self) -> None:
        self.served = False

    def replace(self, items: list[JSON]) -> None:
        by_ns: dict[str, dict[str, str]] = {}
        for _, (namespace, name, uid) in each_readable(JOBSETS.name, items, jobset_identity, self._bad):
            by_ns.setdefault(namespace, {})[name] = uid
        before, self._uids = self._uids, by_ns
        self.listed = self.served = True
        for namespace, names in before.items():
            now = by_ns.get(namespace, {})
            for name, uid in names.items():
                if now.get(name) != uid:
                    self.ledger.release((namespace, f"jobset/{name}"))

    def apply(self, event_type: str, obj: JSON) -> None:
        namespace, name, uid = jobset_identity(obj)
        names = dict(self._uids.get(namespace, {}))
        was = names.get(name)
        if event_type == "DELETED":
            names.pop(name, None)
        else:
            names[name] = uid
        if names:
            self._uids[namespace] = names
        else:
            self._uids.pop(namespace, None)
        if was is not None and names.get(name) != was:
            # Gone, or another JobSet of the name: its Jobs' pods not created yet will not come for this hold.
            self.ledger.release((namespace, f"jobset/{name}"))

    def why_not_owner(self, namespace: str, jobset: str, uid: str) -> str | None:
        """Why the JobSet `jobset` of `uid` (a Job's controller ownerReference) will not create pods a hold
        would wait for; None when it exists with that UID, or JobSets are not served here."""
        if not self.served:
            return None  # no JobSet API: the Job's ownerReference is all there is to read
        if not self.listed:
            return "JobSets are not read yet"
        found = self._uids.get(namespace, {}).get(jobset)
        if found is None:
            return f"JobSet {jobset} does not exist"
        if found != uid:
            return f"JobSet {jobset} is not the one the Jobs' ownerReferences name (its UID differs)"
        return None
