"""Re-inference per controller object: a Job, JobSet or PodGroup event infers again only the pods that name
it, leaving the records a whole-namespace re-inference would; only pods under gputopo's scheduler are group
members; a PodGroup's malformed minCount reaches its pods as a reason naming the field and the value."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.extender.settings import Settings
from gputopo.extender.state.podindex import PodTable
from gputopo.extender.watch.cache import ClusterCache
from gputopo.model import PLACEMENT_ANNOTATION, SCHEDULER_NAME
from gputopo.model import jobs as J
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, make_env, pod_obj, two_leaves

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
SPACES = ["a", "b"]

# ------------------------------------------------------------------ the index is the full re-inference


def _pod_labels(kind: str, owner: int, rank: int, replicas: int) -> dict[str, str]:
    if kind == "job":
        return {J.JOB_NAME: f"j{owner}", J.JOB_COMPLETION_INDEX: str(rank)}
    if kind == "jobset":
        return {
            J.JOBSET_NAME: f"s{owner}",
            J.JOB_NAME: f"j{rank % 2}",
            J.JOBSET_JOB_GLOBAL_INDEX: str(rank % 2),
            J.JOBSET_GLOBAL_REPLICAS: str(replicas),
            J.JOB_COMPLETION_INDEX: str(rank // 2),
        }
    return {}


pod_events = st.builds(
    lambda uid, ns, kind, owner, rank, replicas, sched, pg, ann, deleted: (
        "pods",
        "DELETED" if deleted else "MODIFIED",
        {
            "metadata": {
                "name": f"p{uid}",
                "namespace": ns,
                "uid": f"u{uid}",
                "labels": _pod_labels(kind, owner, rank, replicas),
                "annotations": {"gputopo.io/nvlink": "preferred"} if ann else {},
            },
            "spec": {
                "schedulerName": sched,
                "containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                **({"schedulingGroup": {"podGroupName": pg}} if pg else {}),
            },
            "status": {"phase": "Pending"},
        },
    ),
    st.integers(0, 7),
    st.sampled_from(SPACES),
    st.sampled_from(["job", "jobset", "none"]),
    st.integers(0, 1),
    st.integers(0, 3),
    st.integers(1, 2),
    st.sampled_from([SCHEDULER_NAME, SCHEDULER_NAME, "default-scheduler"]),
    st.sampled_from(["", "", "pg0", "pg1"]),
    st.booleans(),
    st.booleans(),
)

job_events = st.builds(
    lambda name, ns, n, indexed, jobset, gidx, replicas, how: (
        "jobs",
        how,
        {
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": (
                    {
                        J.JOBSET_NAME: jobset,
                        J.JOBSET_JOB_GLOBAL_INDEX: str(gidx),
                        J.JOBSET_GLOBAL_REPLICAS: str(replicas),
                    }
                    if jobset
                    else {}
                ),
            },
            "spec": {"completions": n, "parallelism": n, **({"completionMode": "Indexed"} if indexed else {})},
        },
    ),
    st.sampled_from(["j0", "j1"]),
    st.sampled_from(SPACES),
    st.integers(1, 3),
    st.booleans(),
    st.sampled_from([None, "s0", "s1"]),
    st.integers(0, 1),
    st.integers(1, 2),
    st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
)

podgroup_events = st.builds(
    lambda name, ns, count, how: (
        "podgroups",
        how,
        {
            "metadata": {"name": name, "namespace": ns},
            "spec": {"schedulingPolicy": {"basic": {}} if count is None else {"gang": {"minCount": count}}},
        },
    ),
    st.sampled_from(["pg0", "pg1"]),
    st.sampled_from(SPACES),
    st.sampled_from([None, 1, 2, 3, 0, "2"]),
    st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(pod_events, job_events, podgroup_events), max_size=30))
def test_reinferring_the_pods_that_name_an_object_leaves_the_records_of_a_whole_namespace(
    events: list[tuple[str, str, JSON]],
) -> None:
    _same_records(events)


def test_a_job_leaving_its_jobset_infers_the_jobsets_pods_again() -> None:
    """The JobSet's pods name another Job: only the JobSet the moved Job was in reaches them."""
    pod = _pod_event_obj("s0-pod", _pod_labels("jobset", 0, 0, 1) | {J.JOB_NAME: "other"})
    in_s0 = {J.JOBSET_NAME: "s0", J.JOBSET_JOB_GLOBAL_INDEX: "0", J.JOBSET_GLOBAL_REPLICAS: "1"}
    job = _job("j0", 1)
    moved = {**job, "metadata": {**job["metadata"], "labels": {**in_s0, J.JOBSET_NAME: "s1"}}}
    job["metadata"]["labels"] = in_s0
    _same_records([("pods", "ADDED", pod), ("jobs", "ADDED", job), ("jobs", "MODIFIED", moved)])


def _same_records(events: list[tuple[str, str, JSON]]) -> None:
    indexed, whole = ClusterCache(), ClusterCache()
    whole.controllers.by_object = False
    for kind, how, obj in events:
        for cache in (indexed, whole):
            cache.apply(kind, how, obj)
        assert dict(indexed.ledger.pods) == dict(whole.ledger.pods)
        # The index is exactly what the records name: nothing stale, nothing missing.
        assert indexed.ledger.pods.by_controller == PodTable(indexed.ledger.pods).by_controller


def test_an_unrelated_jobs_event_infers_no_pod_again(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ClusterCache()
    for i in range(4):
        cache.apply("pods", "ADDED", _pod_event_obj(f"big-{i}", {J.JOB_NAME: "big", J.JOB_COMPLETION_INDEX: str(i)}))
    cache.apply("pods", "ADDED", _pod_event_obj("small-0", {J.JOB_NAME: "small", J.JOB_COMPLETION_INDEX: "0"}))
    seen: list[str] = []
    original = cache.controllers._record_again

    def counting(rec: Any) -> Any:
        seen.append(rec.name)
        return original(rec)

    monkeypatch.setattr(cache.controllers, "_record_again", counting)
    cache.apply("jobs", "ADDED", _job("other", 2))
    assert seen == []
    cache.apply("jobs", "ADDED", _job("small", 1))
    assert seen == ["small-0"]
    assert {r.group_size for r in cache.ledger.pods.values() if r.name.startswith("small")} == {"1"}


def _pod_event_obj(name: str, labels: dict[str, str], scheduler: str = SCHEDULER_NAME) -> JSON:
    pod = pod_obj(name, 1)
    pod["metadata"]["labels"] = labels
    pod["spec"]["schedulerName"] = scheduler
    return pod


def _job(name: str, n: int) -> JSON:
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"completions": n, "parallelism": n, "completionMode": "Indexed"},
    }


# ------------------------------------------------------------------ only gputopo's pods are members


def _annotated(name: str, stage: int, scheduler: str = SCHEDULER_NAME) -> JSON:
    pod = gputopo_pod(name, 8, group="llama", group_size="2", stage=str(stage))
    pod["spec"]["schedulerName"] = scheduler
    return pod


def _indexed(name: str, rank: int, scheduler: str = SCHEDULER_NAME) -> JSON:
    pod = _pod_event_obj(name, {J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: str(rank)}, scheduler)
    pod["metadata"]["annotations"] = {"gputopo.io/nvlink": "preferred"}  # tracked, and inferred, under any scheduler
    return pod


@pytest.mark.parametrize(
    ("first", "copy", "key", "waiting"),
    [
        pytest.param(
            _annotated("llama-0", 0),
            _annotated("copy-1", 1, "default-scheduler"),
            "llama",
            "group llama: 1/2 pods exist, waiting",
            id="annotations copied, the other rank: not counted",
        ),
        pytest.param(
            _annotated("llama-0", 0),
            _annotated("copy-0", 0, "volcano"),
            "llama",
            "group llama: 1/2 pods exist, waiting",
            id="annotations copied, the same rank: no clash",
        ),
        pytest.param(
            _indexed("train-0", 0),
            _indexed("copy-1", 1, "default-scheduler"),
            "job/train",
            "group job/train: 1/2 pods exist, waiting",
            id="a Job's labels copied: not counted",
        ),
    ],
)
def test_a_pod_under_another_scheduler_is_no_member(env: Env, first: JSON, copy: JSON, key: str, waiting: str) -> None:
    env.add_nodes(*two_leaves())
    env.source.put("jobs", _job("train", 2))
    env.add_pods(first, copy)
    assert [r.name for r in env.ledger.group_members(("default", key))] == [first["metadata"]["name"]]
    out = env.filter(first, NODES)
    assert out["NodeNames"] == [] and set(out["FailedNodes"].values()) == {waiting}


@pytest.mark.parametrize(
    ("configured", "members"),
    [
        pytest.param(None, ["llama-0"], id="the default name: gputopo-scheduler's pods"),
        pytest.param("gputopo-preempt", ["renamed-1"], id="the chart's scheduler.schedulerName: that profile's pods"),
    ],
)
def test_members_are_the_pods_of_the_configured_scheduler(configured: str | None, members: list[str]) -> None:
    settings = Settings(namespace=NS) if configured is None else Settings(namespace=NS, scheduler_name=configured)
    with make_env(FakeSource(NS), FakeClock(), settings) as env:
        env.add_nodes(*two_leaves())
        env.add_pods(_annotated("llama-0", 0), _annotated("renamed-1", 1, "gputopo-preempt"))
        assert [r.name for r in env.ledger.group_members(("default", "llama"))] == members


@pytest.mark.parametrize("name", ["Gputopo", "-x", "a_b", "x" * 254, ""])
def test_a_scheduler_name_that_is_no_dns_subdomain_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="scheduler_name"):
        Settings(scheduler_name=name)


def test_a_placed_pod_under_another_scheduler_pins_no_slot_of_the_plan(env: Env) -> None:
    env.add_nodes(*two_leaves())
    copy = _annotated("copy-1", 1, "default-scheduler")
    copy["spec"]["nodeName"] = "gpu-1"
    placed = {"node": "gpu-1", "gpus": list(range(8)), "score": 9, "reason": "r", "stage": 1}
    copy["metadata"]["annotations"][PLACEMENT_ANNOTATION] = json.dumps(placed)
    a, b = _annotated("llama-0", 0), _annotated("llama-1", 1)
    env.add_pods(copy, a, b)
    nodes = {env.filter(p, NODES)["NodeNames"][0] for p in (a, b)}
    assert len(nodes) == 2 and "gpu-1" not in nodes  # planned for the two members, around the copy's GPUs


# ------------------------------------------------------------------ a malformed minCount is a reason


@pytest.mark.parametrize(
    ("gang", "said"),
    [
        ({"minCount": -1}, 'spec.schedulingPolicy.gang.minCount="-1": must be between 1 and'),
        ({"minCount": 0}, 'spec.schedulingPolicy.gang.minCount="0": must be between 1 and'),
        ({"minCount": 2**40}, f'spec.schedulingPolicy.gang.minCount="{2**40}": must be between 1 and'),
        ({"minCount": "2"}, 'spec.schedulingPolicy.gang.minCount="2": must be an integer, not a str'),
        ({"minCount": 2.0}, 'spec.schedulingPolicy.gang.minCount="2.0": must be an integer, not a float'),
        ({"minCount": True}, 'spec.schedulingPolicy.gang.minCount="True": must be an integer, not a bool'),
        ({}, 'spec.schedulingPolicy.gang.minCount="(missing)": a gang policy needs it'),
    ],
)
def test_a_malformed_min_count_is_told_to_the_podgroups_pods(env: Env, gang: JSON, said: str) -> None:
    env.add_nodes(*two_leaves())
    pg = {"metadata": {"name": "train", "namespace": "default"}, "spec": {"schedulingPolicy": {"gang": gang}}}
    env.source.put("podgroups", pg)
    pod = pod_obj("train-0", 2)
    pod["spec"]["schedulingGroup"] = {"podGroupName": "train"}
    env.add_pods(pod)
    out = env.filter(pod, NODES)
    reasons = set(out["FailedNodes"].values()) | set(out["FailedAndUnresolvableNodes"].values())
    assert out["NodeNames"] == [] and len(reasons) == 1
    (reason,) = reasons
    assert reason.startswith(f"invalid PodGroup train: {said}") and "not known yet" not in reason


@pytest.mark.parametrize(
    ("value", "size"),
    [(1, 1), (J.MAX_GROUP_SIZE, J.MAX_GROUP_SIZE), (J.MAX_GROUP_SIZE + 1, None), (None, None), ("x", None)],
)
def test_gang_min_count_accepts_only_a_usable_size(value: object, size: int | None) -> None:
    got = J.gang_min_count("pg", value)
    assert (got if isinstance(got, int) else None) == size
    if size is None:
        assert isinstance(got, J.PodGroupError) and "spec.schedulingPolicy.gang.minCount" in str(got)
