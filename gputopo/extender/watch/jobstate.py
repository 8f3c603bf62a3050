"""Whether a batch/v1 Job will still create pods: its UID, spec.suspend, a Complete or Failed condition,
and the JobSet (name and UID) its controller ownerReference names (what a hold for its pods not created yet
reads)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

LISTED = 64  # ownerReferences and conditions read per Job: any list may be a tenant's flood
MAX_UID = 128  # longer than any UID the API server makes (36 characters): kept no longer than that


class JobState(TypedDict):
    uid: str
    suspended: bool
    finished: bool
    owner_jobset: str | None
    owner_jobset_uid: str


def job_state(obj: Mapping[str, Any]) -> JobState | None:
    """The Job's state as `JobShape` keeps it; None when its metadata.uid is not a string."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec")
    uid = meta.get("uid") or "" if isinstance(meta, Mapping) else ""
    if not isinstance(uid, str):
        return None
    owner, owner_uid = _controller_of(meta.get("ownerReferences") if isinstance(meta, Mapping) else None, "JobSet")
    return JobState(
        uid=uid,
        suspended=isinstance(spec, Mapping) and spec.get("suspend") is True,
        finished=_finished(obj.get("status")),
        owner_jobset=owner,
        owner_jobset_uid=owner_uid,
    )


def _finished(status: Any) -> bool:
    """A Job's status says Complete or Failed (a condition of status True): it creates no more pods."""
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in conditions[:LISTED]
    )


def _controller_of(refs: Any, kind: str) -> tuple[str | None, str]:
    """The name and UID of the controller ownerReference of `kind` (None and "" when there is none, or it
    is unreadable; "" for an unreadable UID, which no object has)."""
    if not isinstance(refs, list):
        return None, ""
    for ref in refs[:LISTED]:
        if isinstance(ref, Mapping) and ref.get("controller") is True and ref.get("kind") == kind:
            name, uid = ref.get("name"), ref.get("uid")
            if not isinstance(name, str):
                return None, ""
            return name, uid if isinstance(uid, str) and len(uid) <= MAX_UID else ""
    return None, ""
