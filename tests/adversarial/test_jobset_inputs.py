"""Who owns a hold for pods not created yet, written by others: JobSets (unreadable identities, 10,000-character
UIDs), a Job's ownerReference with an oversized or mistyped UID, another namespace's JobSet of the same name.
Bounds: an unreadable JobSet is counted and owns nothing; a JobSet of another namespace or UID owns no hold."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.state.ledger import Ledger
from gputopo.extender.watch.jobsets import JobSets, jobset_identity
from gputopo.extender.watch.jobstate import job_state

Bad = list[tuple[str, Any, Exception]]


@pytest.mark.parametrize(
    "meta",
    [
        pytest.param({"name": "js", "namespace": "default", "uid": "u" * 10_000}, id="a-10k-character-uid"),
        pytest.param({"name": "js", "namespace": "default", "uid": 7}, id="a-uid-not-a-string"),
        pytest.param({"name": "js", "namespace": "default", "uid": ""}, id="an-empty-uid"),
        pytest.param({"name": ["js"], "namespace": "default", "uid": "u"}, id="a-name-not-a-string"),
        pytest.param({"name": "js", "uid": "u"}, id="no-namespace"),
    ],
)
def test_an_unreadable_jobset_owns_nothing(meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        jobset_identity({"metadata": meta})
    bad: Bad = []
    jobsets = JobSets(Ledger(), lambda kind, obj, e: bad.append((kind, obj, e)))
    jobsets.replace([{"metadata": meta}])
    assert len(bad) == 1
    uid = meta.get("uid")
    assert jobsets.why_not_owner("default", "js", uid if isinstance(uid, str) else "") == "JobSet js does not exist"


@pytest.mark.parametrize(
    ("ref_uid", "kept"),
    [
        pytest.param("u" * 10_000, "", id="a-10k-character-ownerreference-uid-is-no-uid"),
        pytest.param(["uid-js"], "", id="an-ownerreference-uid-not-a-string-is-no-uid"),
        pytest.param("uid-js", "uid-js", id="the-control"),
    ],
)
def test_a_jobs_ownerreference_uid_is_kept_only_when_readable(ref_uid: Any, kept: str) -> None:
    ref = {"kind": "JobSet", "name": "js", "uid": ref_uid, "controller": True}
    state = job_state({"metadata": {"uid": "uid-job", "ownerReferences": [ref]}})
    assert state is not None and state["owner_jobset_uid"] == kept
    jobsets = JobSets(Ledger(), lambda *a: None)
    jobsets.replace([{"metadata": {"name": "js", "namespace": "default", "uid": "uid-js"}}])
    assert (jobsets.why_not_owner("default", "js", kept) is None) == (kept == "uid-js")


def test_another_namespaces_jobset_of_the_name_owns_nothing_here() -> None:
    jobsets = JobSets(Ledger(), lambda *a: None)
    flood = [{"metadata": {"name": f"js-{i}", "namespace": "team-b", "uid": f"u-{i}"}} for i in range(5000)]
    jobsets.replace([*flood, {"metadata": {"name": "js", "namespace": "team-b", "uid": "uid-js"}}])
    assert jobsets.why_not_owner("default", "js", "uid-js") == "JobSet js does not exist"
    assert jobsets.why_not_owner("team-b", "js", "uid-js") is None
