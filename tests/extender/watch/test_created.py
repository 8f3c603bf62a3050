"""A gated pod's record keeps its creationTimestamp (`PodRecord.created`, the time gputopo's group gate was added,
from which the lift's bound runs): read only while the gate holds the pod (an unreadable one is a bad object), and
kept by the ledger when the record is built again without the object (re-inference)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.records import BadObject
from gputopo.extender.watch.parsers import pod_record
from gputopo.model.gates import GROUP_GATE
from tests.extender.harness import T0, pod_obj, rfc3339

TIERS = ("spine", "leaf")


def gated(created: Any, *, gate: bool = True) -> dict[str, Any]:
    ann = {"gputopo.io/nvlink": "required", "gputopo.io/group": "g", "gputopo.io/group-size": "2"}
    pod = pod_obj("m-0", 8, ann)
    if gate:
        pod["spec"]["schedulingGates"] = [{"name": GROUP_GATE}]
    pod["metadata"]["creationTimestamp"] = created
    return pod


@pytest.mark.parametrize(
    ("pod", "created"),
    [
        pytest.param(gated(rfc3339(T0)), T0, id="a-gated-pods-creation-is-kept"),
        pytest.param(gated("2027-01-15T08:00:00Z"), T0, id="zulu-without-fractions"),
        pytest.param(gated(rfc3339(T0), gate=False), None, id="an-ungated-pods-is-not-read"),
    ],
)
def test_a_gated_pods_creation_time(pod: dict[str, Any], created: float | None) -> None:
    rec = pod_record(pod, TIERS)
    assert rec is not None and rec.created == created


@pytest.mark.parametrize("created", [pytest.param("not a time", id="not-a-time"), pytest.param(12, id="a-number")])
def test_an_unreadable_creation_time_is_a_bad_object_named(created: Any) -> None:
    # The one Pod reader (gputopo.model.pod) refuses it: the API server never writes one.
    with pytest.raises(BadObject, match="creationTimestamp"):
        pod_record(gated(created), TIERS)


def test_a_record_built_again_keeps_its_creation_time() -> None:
    ledger = Ledger()
    rec = pod_record(gated(rfc3339(T0 - 60)), TIERS)
    assert rec is not None
    ledger.put_pod(rec.uid, rec)
    ledger.put_pod(rec.uid, dataclasses.replace(rec, created=None))  # as re-inference builds it
    assert ledger.pods[rec.uid].created == T0 - 60
    assert dataclasses.replace(rec, created=None) == rec  # the same record: re-inference writes nothing for it
