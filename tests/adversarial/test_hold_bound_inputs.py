"""What bounds a hold for pods not created yet, written by others: ResourceQuotas (garbage quantities, wrong
types, scoped or foreign quotas, thousands in one namespace). Bounds: a quota that cannot be read leaves its
namespace no room (never the chart's bound); quotas kept per namespace <= 1,024, the namespace past it
holding nothing and every other namespace's room unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.quotas import MAX_PER_NAMESPACE, Quotas, quota_room
from tests.extender.verbs.test_hold_bounds import quota

KEY = "requests.nvidia.com/gpu"
Bad = list[tuple[str, Any, Exception]]


def _quotas(bad: Bad | None = None) -> Quotas:
    seen: Bad = [] if bad is None else bad
    return Quotas(lambda kind, obj, e: seen.append((kind, obj, e)))


@pytest.mark.parametrize(
    ("hard", "used", "problem"),
    [
        pytest.param("1e400", "0", "spec.hard[requests.nvidia.com/gpu] is unreadable: out of range", id="1e400"),
        pytest.param("-3", "0", "spec.hard[requests.nvidia.com/gpu] is negative", id="negative-hard"),
        pytest.param("٤", "0", "spec.hard[requests.nvidia.com/gpu] is unreadable: not a Kubernetes", id="arabic-4"),
        pytest.param("4" * 10_000, "0", "is unreadable: not a Kubernetes quantity: longer than 64", id="10k-chars"),
        pytest.param("NaN", "0", "is unreadable: not a Kubernetes quantity", id="nan"),
        pytest.param("inf", "0", "is unreadable: not a Kubernetes quantity", id="inf"),
        pytest.param(["8"], "0", "spec.hard[requests.nvidia.com/gpu] is not a Kubernetes quantity", id="a-list"),
        pytest.param(True, "0", "spec.hard[requests.nvidia.com/gpu] is not a Kubernetes quantity", id="a-bool"),
        pytest.param(8.5, "0", "spec.hard[requests.nvidia.com/gpu] is not a Kubernetes quantity", id="a-float"),
        pytest.param("64", "1e400", "status.used[requests.nvidia.com/gpu] is unreadable: out", id="used-1e400"),
        pytest.param("64", "-3", "status.used[requests.nvidia.com/gpu] is negative", id="used-negative"),
        pytest.param("64", {"n": 1}, "status.used[requests.nvidia.com/gpu] is not a Kubernetes", id="used-map"),
    ],
)
def test_a_quota_amount_that_cannot_be_read_leaves_its_namespace_no_room(hard: Any, used: Any, problem: str) -> None:
    namespace, name, room = quota_room(quota("gpus", hard, used))
    assert (namespace, name) == ("default", "gpus")
    assert room is not None and room.free == 0
    assert problem in room.problem
    assert len(room.words()) < 200  # the refused pod is told briefly, never the 10k characters
    q = _quotas()
    q.replace([quota("gpus", hard, used), quota("gpus", "64", namespace="team-b")])
    found = q.room("default")
    assert found is not None and found.free == 0
    other = q.room("team-b")
    assert other is not None and other.free == 64


@pytest.mark.parametrize(
    ("hard", "used", "free"),
    [
        pytest.param("1.5", "0", 1, id="a-fraction-of-hard-rounds-down"),
        pytest.param("8", "0.5", 7, id="a-fraction-of-used-rounds-up"),
        pytest.param("1k", "0", 1000, id="a-suffix-is-a-quantity"),
        pytest.param(16, 4, 12, id="integers-as-the-json-may-carry"),
    ],
)
def test_quota_amounts_are_read_toward_less_room(hard: Any, used: Any, free: int) -> None:
    _, _, room = quota_room(quota("gpus", hard, used))
    assert room is not None and not room.problem and room.free == free


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param({"metadata": []}, id="metadata-a-list"),
        pytest.param({"metadata": {"name": "q"}}, id="no-namespace"),
        pytest.param({"metadata": {"name": "q" * 300, "namespace": "default"}}, id="a-300-character-name"),
        pytest.param({"metadata": {"name": 7, "namespace": "default"}}, id="a-name-not-a-string"),
        pytest.param({"metadata": {"name": "q", "namespace": "default"}, "spec": []}, id="spec-a-list"),
        pytest.param({"metadata": {"name": "q", "namespace": "default"}, "spec": {"hard": "8"}}, id="hard-a-string"),
        pytest.param(
            {"metadata": {"name": "q", "namespace": "default"}, "spec": {"hard": {KEY: "8"}}, "status": 3},
            id="status-a-number",
        ),
        pytest.param("a quota", id="not-an-object"),
    ],
)
def test_an_unreadable_quota_is_counted_and_keeps_nothing(obj: Any) -> None:
    with pytest.raises(ValueError):
        quota_room(obj)
    cache = ClusterCache()
    counted: list[tuple[str, str]] = []
    cache.on_bad_object = lambda kind, reason: counted.append((kind, reason))
    cache.replace("resourcequotas", [obj, quota("gpus", "8")])
    cache.apply("resourcequotas", "ADDED", obj)  # contained to the object, as every kind's
    assert [kind for kind, _ in counted] == ["resourcequotas", "resourcequotas"]
    room = cache.quotas.room("default")
    assert room is not None and room.name == "gpus" and room.free == 8


def test_thousands_of_quotas_in_one_namespace_leave_it_no_room_and_others_theirs() -> None:
    q = _quotas()
    flood = [quota(f"q-{i}", "1000", namespace="flood") for i in range(MAX_PER_NAMESPACE + 500)]
    no_gpus = [quota(f"cpu-{i}", None, namespace="flood") for i in range(2000)]  # not read: kept nowhere
    q.replace([*flood, *no_gpus, quota("gpus", "64", namespace="team-a")])
    assert len(q._rooms["flood"]) == MAX_PER_NAMESPACE
    room = q.room("flood")
    assert room is not None and room.free == 0 and "more than 1024 ResourceQuotas on GPUs" in room.problem
    for i in range(MAX_PER_NAMESPACE + 500, MAX_PER_NAMESPACE + 1000):  # more by watch events
        q.apply("ADDED", quota(f"q-{i}", "1000", namespace="flood"))
    q.apply("ADDED", quota("gpus", "32", namespace="team-b"))
    assert len(q._rooms["flood"]) == MAX_PER_NAMESPACE
    assert sum(len(r) for r in q._rooms.values()) == MAX_PER_NAMESPACE + 2
    a, b = q.room("team-a"), q.room("team-b")
    assert a is not None and a.free == 64 and b is not None and b.free == 32
    assert q.room("team-c") is None  # no quota: the chart's bound


def test_a_namespace_filled_by_watch_events_holds_nothing_past_its_share() -> None:
    q = _quotas()
    q.replace([])
    for i in range(MAX_PER_NAMESPACE):
        q.apply("ADDED", quota(f"q-{i}", "1000"))
    room = q.room("default")
    assert room is not None and room.free == 1000
    q.apply("ADDED", quota("tight", "0"))  # not kept: its room unknown, so none
    room = q.room("default")
    assert room is not None and room.free == 0


def test_a_quota_of_another_namespace_or_resource_never_bounds_this_one() -> None:
    q = _quotas()
    q.replace(
        [
            quota("gpus", "0", namespace="team-b"),
            quota("amd", "0", resource="requests.amd.com/gpu"),
            quota("plain", "0", resource="nvidia.com/gpu"),  # refused by Kubernetes for an extended resource
            quota("scoped", "0", scopes=["Terminating"]),
        ]
    )
    assert q.room("default") is None
