"""gputopo's scheduling gate for gang members (gputopo.model.gates, gputopo/extender/verbs/groupgates.py): the webhook
gates a group member at its creation, the extender lifts the gate of every member once the group is whole, and a
gate never outlives its reason (no group, another holder, a group that cannot be placed, the bound)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.extender.verbs.groupgates import GATED_REASON, LIFTED_REASON, GateLifter
from gputopo.extender.webhook.mutation import admit_pod
from gputopo.kube import KubeError
from gputopo.model import SCHEDULER_NAME
from gputopo.model import jobs as J
from gputopo.model.gates import (
    GROUP_GATE,
    KUEUE_ADMISSION_GATE,
    KUEUE_TOPOLOGY_GATE,
    MAX_GATES_READ,
    GatedMember,
    LiftReason,
    admission_gate,
    gate_names,
    lift,
    remove_gate_patch,
)
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, make_env, pod_obj, two_leaves

RELEASE = 900.0


# ------------------------------------------------------------------ the decision at admission (pure)


@pytest.mark.parametrize(
    ("kw", "why_not"),
    [
        pytest.param({}, None, id="a-group-member-under-gputopo-is-gated"),
        pytest.param(
            {"scheduler": "default-scheduler"}, "scheduled by default-scheduler", id="another-scheduler-not-gated"
        ),
        pytest.param({"scheduler": ""}, "scheduled by the default scheduler", id="no-scheduler-not-gated"),
        pytest.param({"group": None}, "no group member", id="a-lone-pod-not-gated"),
        pytest.param({"gates": (GROUP_GATE,)}, "gated already", id="gated-already-never-twice"),
        pytest.param({"gates": (KUEUE_ADMISSION_GATE,)}, "held by kueue", id="kueue-admission-holds-it-not-gated"),
        pytest.param({"gates": ("x/y", KUEUE_TOPOLOGY_GATE)}, "held by kueue", id="kueue-topology-holds-it-not-gated"),
        pytest.param({"gates": ("example.com/other",)}, None, id="an-unrelated-gate-is-no-holder-gated"),
        pytest.param(
            {"gates": tuple(f"g{i}" for i in range(MAX_GATES_READ))}, "or more scheduling gates", id="too-many-to-read"
        ),
        pytest.param({"pod_group": "pg"}, "held by its PodGroup pg", id="native-podgroup-holds-it-not-gated"),
        pytest.param({"exclusive": True}, "exclusive placement", id="jobset-exclusive-leaders-never-gated"),
    ],
)
def test_admission_gate(kw: dict[str, Any], why_not: str | None) -> None:
    args: dict[str, Any] = {"scheduler": SCHEDULER_NAME, "ours": SCHEDULER_NAME, "group": "jobset/train", "gates": ()}
    got = admission_gate(**{**args, **kw})
    if why_not is None:
        assert got is None
    else:
        assert got is not None and why_not.lower() in got.lower()


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        pytest.param({}, (), id="no-gates"),
        pytest.param({"schedulingGates": None}, (), id="null-gates"),
        pytest.param({"schedulingGates": "gputopo.io/group-complete"}, (), id="a-string-is-no-list"),
        pytest.param(
            {"schedulingGates": [{"name": 5}, "x", None, {"name": "a"}]}, ("a",), id="malformed-entries-skipped"
        ),
        pytest.param(
            {"schedulingGates": [{"name": f"g{i}"} for i in range(10 * MAX_GATES_READ)]},
            tuple(f"g{i}" for i in range(MAX_GATES_READ)),
            id="oversized-list-read-to-the-bound",
        ),
        pytest.param([], (), id="a-spec-that-is-no-object"),
    ],
)
def test_gate_names_reads_hostile_specs_without_failing(spec: Any, names: tuple[str, ...]) -> None:
    assert gate_names(spec) == names


@pytest.mark.parametrize(
    ("gates", "index"),
    [
        pytest.param((GROUP_GATE,), 0, id="alone"),
        pytest.param(("a", "b", GROUP_GATE), 2, id="after-the-authors-own"),
        pytest.param((KUEUE_ADMISSION_GATE, GROUP_GATE, "c"), 1, id="between-others"),
    ],
)
def test_the_lift_removes_only_gputopos_gate_behind_a_test(gates: tuple[str, ...], index: int) -> None:
    assert remove_gate_patch(gates) == [
        {"op": "test", "path": f"/spec/schedulingGates/{index}/name", "value": GROUP_GATE},
        {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
    ]


# ------------------------------------------------------------------ the decision to lift (pure)


def member(**kw: Any) -> GatedMember:
    base: dict[str, Any] = {
        "uid": "u",
        "namespace": "ns",
        "name": "p",
        "group": "jobset/train",
        "size": 4,
        "present": 2,
        "since": 1000.0,
    }
    return GatedMember(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "waited", "reason"),
    [
        pytest.param({}, 0.0, None, id="incomplete-group-waits"),
        pytest.param({}, RELEASE - 1, None, id="incomplete-group-waits-until-the-bound"),
        pytest.param({"present": 4}, 0.0, LiftReason.COMPLETE, id="whole-group-lifted"),
        pytest.param({"present": 5}, 0.0, LiftReason.COMPLETE, id="more-than-whole-lifted"),
        pytest.param({}, RELEASE, LiftReason.TIMEOUT, id="incomplete-group-released-at-the-bound"),
        pytest.param({"size": None}, 0.0, None, id="unknown-size-waits"),
        pytest.param({"size": None}, RELEASE, LiftReason.TIMEOUT, id="unknown-size-released-at-the-bound"),
        pytest.param({"group": None}, 0.0, LiftReason.NO_GROUP, id="no-group-lifted-at-once"),
        pytest.param({"held_by": KUEUE_ADMISSION_GATE}, 0.0, LiftReason.HELD_ELSEWHERE, id="kueue-holds-lifted"),
        pytest.param({"exclusive": True}, 0.0, LiftReason.HELD_ELSEWHERE, id="jobset-exclusive-lifted"),
        pytest.param({"problem": "bad label"}, 0.0, LiftReason.CANNOT_PLACE, id="cannot-place-lifted-at-once"),
    ],
)
def test_lift(kw: dict[str, Any], waited: float, reason: LiftReason | None) -> None:
    m = member(**kw)
    got = lift(m, m.since + waited, RELEASE)
    assert (got.reason if got is not None else None) == reason
    if got is not None and reason is not LiftReason.COMPLETE:
        assert GROUP_GATE in got.message  # every other lift is told on the pod


def test_a_release_names_the_group_and_its_count() -> None:
    got = lift(member(present=3), 1000.0 + RELEASE, RELEASE)
    assert got is not None and "group jobset/train has 3 of 4 members" in got.message


# ------------------------------------------------------------------ the webhook


def review(pod: JSON) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "ns",
            "object": pod,
        },
    }


def patch_of(answer: dict[str, Any]) -> list[dict[str, Any]]:
    raw = answer["response"].get("patch")
    return json.loads(base64.b64decode(raw)) if raw else []


def jobset_pod(scheduler: str = SCHEDULER_NAME, **spec: Any) -> JSON:
    pod = pod_obj("train-0", 8)
    pod["metadata"]["labels"] = {
        J.JOBSET_NAME: "train",
        J.JOBSET_REPLICATED_JOB: "w",
        J.JOBSET_JOB_INDEX: "0",
        J.JOB_COMPLETION_INDEX: "0",
    }
    pod["spec"]["schedulerName"] = scheduler
    pod["spec"].update(spec)
    return pod


def annotated_pod(**spec: Any) -> JSON:
    pod = gputopo_pod("a-0", group="g", group_size="2")
    del pod["spec"]["schedulerName"]
    pod["spec"].update(spec)
    return pod


ADD_LIST = {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GROUP_GATE}]}
APPEND = {"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": GROUP_GATE}}
SET_SCHEDULER = {"op": "add", "path": "/spec/schedulerName", "value": SCHEDULER_NAME}


@pytest.mark.parametrize(
    ("pod", "gate", "ops"),
    [
        pytest.param(jobset_pod(), True, [ADD_LIST], id="jobset-member-gated"),
        pytest.param(jobset_pod(), False, [], id="jobset-member-unchanged-without-the-setting"),
        pytest.param(annotated_pod(), True, [SET_SCHEDULER, ADD_LIST], id="annotated-member-opted-in-and-gated"),
        pytest.param(
            jobset_pod(schedulingGates=[{"name": "example.com/mine"}]), True, [APPEND], id="appended-to-authors-gates"
        ),
        pytest.param(jobset_pod("default-scheduler"), True, [], id="another-schedulers-member-not-gated"),
        pytest.param(jobset_pod("volcano"), True, [], id="a-foreign-scheduler-member-not-gated"),
        pytest.param(jobset_pod(schedulingGates=[{"name": GROUP_GATE}]), True, [], id="forged-gate-never-doubled"),
        pytest.param(
            jobset_pod(schedulingGates=[{"name": KUEUE_ADMISSION_GATE}]), True, [], id="kueue-gated-not-gated-again"
        ),
        pytest.param(
            jobset_pod(schedulingGroup={"podGroupName": "pg"}), True, [], id="native-podgroup-member-not-gated"
        ),
        pytest.param(jobset_pod(schedulingGates="nonsense"), True, [ADD_LIST], id="malformed-gates-read-as-none"),
        pytest.param(pod_obj("lone", 8), True, [], id="a-lone-gpu-pod-not-gated"),
    ],
)
def test_webhook_gates_group_members_only(pod: JSON, gate: bool, ops: list[dict[str, Any]]) -> None:
    answer = admit_pod(review(pod), SCHEDULER_NAME, group_gate=gate).answer
    assert answer["response"]["allowed"] is True
    assert patch_of(answer) == ops


def test_webhook_leaves_jobset_exclusive_leaders_ungated() -> None:
    pod = jobset_pod()
    pod["metadata"]["annotations"][J.JOBSET_EXCLUSIVE] = "example.com/rack"
    assert patch_of(admit_pod(review(pod), SCHEDULER_NAME, group_gate=True).answer) == []


# ------------------------------------------------------------------ lifting, against the fake API server


@pytest.fixture
def gated_env() -> Iterator[Env]:
    from gputopo.extender.settings import Settings

    settings = Settings(namespace=NS, group_gate=True, group_gate_release_seconds=RELEASE)
    with make_env(FakeSource(NS), FakeClock(), settings) as e:
        e.add_nodes(*two_leaves())
        yield e


def lifter(env: Env) -> GateLifter:
    assert env.listeners.lifter is not None
    return env.listeners.lifter


def member_pod(
    name: str,
    group: str = "g",
    size: int = 4,
    *,
    stage: int | None = None,
    ns: str = "default",
    extra: dict[str, str] | None = None,
) -> JSON:
    ann = {"gputopo.io/nvlink": "required", "gputopo.io/group": group, "gputopo.io/group-size": str(size)}
    ann.update(extra or {})
    if stage is not None:
        ann["gputopo.io/stage"] = str(stage)
    pod = pod_obj(name, 8, ann, namespace=ns)
    pod["spec"]["schedulingGates"] = [{"name": GROUP_GATE}]
    return pod


def sweep(env: Env) -> list[str]:
    """One sweep, then the watch: the refs whose gate was lifted, in the order written."""
    done = lifter(env).sweep()
    env.extender.flush_events()
    env.resync()
    return [lf.member.ref for lf in done]


def gates_of(env: Env, name: str, ns: str = "default") -> list[str]:
    obj = env.source.get("pods", ns, name)
    assert obj is not None
    return [g["name"] for g in obj["spec"].get("schedulingGates") or []]


def events(env: Env, reason: str) -> dict[str, str]:
    return {e["involvedObject"]["name"]: e["message"] for e in env.source.events if e["reason"] == reason}


def test_members_wait_until_whole_then_all_are_lifted_in_rank_order(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(*(member_pod(f"m-{i}", stage=i) for i in (3, 1, 0)))
    assert sweep(env) == [] and events(env, GATED_REASON) == {}  # a gang that comes at once is told nothing
    env.clock.advance(5)
    assert sweep(env) == []
    told = events(env, GATED_REASON)
    assert sorted(told) == ["m-0", "m-1", "m-3"]
    assert "group g is whole: 3 of 4 members exist" in told["m-0"]
    assert sweep(env) == [] and len(env.source.events) == 3  # told once, not every sweep
    env.add_pods(member_pod("m-2", stage=2))
    assert sweep(env) == [f"default/m-{i}" for i in range(4)]
    assert [p[1] for p in env.source.patches] == [f"m-{i}" for i in range(4)]  # one write per pod
    assert all(gates_of(env, f"m-{i}") == [] for i in range(4))
    assert events(env, LIFTED_REASON) == {}  # a whole group's lift needs no word
    lifted = env.metrics.registry.get_sample_value("gputopo_extender_group_gates_lifted_total", {"reason": "complete"})
    assert lifted == 4
    assert sweep(env) == [] and len(env.source.patches) == 4


def test_the_lifted_members_are_then_placed(gated_env: Env) -> None:
    env = gated_env
    pods = [member_pod(f"m-{i}", size=2, stage=i) for i in range(2)]
    env.add_pods(*pods)
    assert len(sweep(env)) == 2
    for p in pods:
        p["spec"].pop("schedulingGates")
        assert len(env.passed(p, [f"gpu-{i}" for i in range(1, 5)])) == 1


def test_a_group_that_never_completes_is_told_and_released_after_the_bound(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(member_pod("m-0"), member_pod("m-1"))
    assert sweep(env) == []
    env.clock.advance(RELEASE - 1)
    assert sweep(env) == []
    env.clock.advance(1)
    assert sweep(env) == ["default/m-0", "default/m-1"]
    told = events(env, LIFTED_REASON)
    assert sorted(told) == ["m-0", "m-1"] and "has 2 of 4 members" in told["m-0"]
    assert all(e["type"] == "Warning" for e in env.source.events if e["reason"] == LIFTED_REASON)


# ------------------------------------------------------------------ adversarial


def test_a_forged_group_size_holds_nothing_past_the_bound(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(member_pod("big", size=4096))
    assert sweep(env) == []
    env.clock.advance(RELEASE)
    assert sweep(env) == ["default/big"]


def test_a_malformed_group_size_is_lifted_at_once_with_the_reason(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(member_pod("bad", extra={"gputopo.io/group-size": "many"}))
    assert sweep(env) == ["default/bad"]
    assert "cannot be placed" in events(env, LIFTED_REASON)["bad"]


def test_a_gate_a_tenant_wrote_on_a_lone_pod_is_lifted_at_once(gated_env: Env) -> None:
    env = gated_env
    pod = pod_obj("lone", 8, {"gputopo.io/nvlink": "required"})
    pod["spec"]["schedulingGates"] = [{"name": "example.com/mine"}, {"name": GROUP_GATE}]
    env.add_pods(pod)
    assert sweep(env) == ["default/lone"]
    assert gates_of(env, "lone") == ["example.com/mine"]  # the author's own gate stays
    assert "no member of a group" in events(env, LIFTED_REASON)["lone"]


@pytest.mark.parametrize(
    "annotated",
    [pytest.param(False, id="a-plain-pod"), pytest.param(True, id="one-with-gputopo-annotations-the-ledger-keeps")],
)
def test_a_gate_on_another_schedulers_pod_is_not_touched(gated_env: Env, annotated: bool) -> None:
    env = gated_env
    pod = member_pod("theirs")
    pod["spec"]["schedulerName"] = "default-scheduler"
    if not annotated:
        pod["metadata"]["annotations"] = {}
    env.add_pods(pod)
    assert sweep(env) == [] and env.source.patches == []
    env.clock.advance(RELEASE)
    assert sweep(env) == [] and gates_of(env, "theirs") == [GROUP_GATE]


def test_a_tenant_who_removes_the_gate_early_costs_no_write(gated_env: Env) -> None:
    env = gated_env
    pods = [member_pod(f"m-{i}", size=2) for i in range(2)]
    env.add_pods(pods[0])
    assert sweep(env) == []
    pods[0]["spec"]["schedulingGates"] = []
    env.add_pods(pods[0], pods[1])
    assert sweep(env) == ["default/m-1"]
    assert [p[1] for p in env.source.patches] == ["m-1"]


def test_a_pod_also_held_by_kueue_keeps_kueues_gate_and_loses_ours(gated_env: Env) -> None:
    env = gated_env
    pod = member_pod("k")
    pod["spec"]["schedulingGates"] = [{"name": KUEUE_ADMISSION_GATE}, {"name": GROUP_GATE}]
    env.add_pods(pod)
    assert sweep(env) == ["default/k"]
    assert gates_of(env, "k") == [KUEUE_ADMISSION_GATE]


def test_another_namespaces_members_never_complete_a_group(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(
        member_pod("mine", size=2), member_pod("x-0", size=2, ns="other"), member_pod("x-1", size=2, ns="other")
    )
    assert sweep(env) == ["other/x-0", "other/x-1"]
    assert gates_of(env, "mine") == [GROUP_GATE]


def test_a_pod_whose_gates_changed_meanwhile_is_read_again(gated_env: Env) -> None:
    env = gated_env
    pod = member_pod("m", size=1)
    env.add_pods(pod)
    stored = env.source.get("pods", "default", "m")
    assert stored is not None
    stored["spec"]["schedulingGates"] = [{"name": "example.com/first"}, {"name": GROUP_GATE}]
    env.source.put("pods", stored)  # the watch has not brought it: the ledger still reads the old gates
    assert lifter(env).sweep() == []  # the test op fails (422); nothing else was removed
    assert gates_of(env, "m") == ["example.com/first", GROUP_GATE]
    env.resync()
    assert sweep(env) == ["default/m"] and gates_of(env, "m") == ["example.com/first"]


def test_an_api_outage_is_retried_on_the_next_sweep(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(member_pod("m", size=1))
    original = env.source.patch_pod

    def down(*_: object) -> None:
        raise KubeError(503, "unavailable", "ServiceUnavailable")

    env.source.patch_pod = down  # type: ignore[method-assign,assignment]
    assert sweep(env) == []
    env.source.patch_pod = original  # type: ignore[method-assign]
    assert sweep(env) == ["default/m"]


def test_a_flood_of_gated_pods_is_lifted_at_the_bounded_pace_whole_groups_first(gated_env: Env) -> None:
    env = gated_env
    gl = lifter(env)
    gl.max_writes = 10
    flood = []
    for i in range(30):
        p = pod_obj(f"flood-{i}", 8, {"gputopo.io/nvlink": "required"})
        p["spec"]["schedulingGates"] = [{"name": GROUP_GATE}]
        flood.append(p)
    env.add_pods(*flood, *(member_pod(f"m-{i}", size=2, stage=i) for i in range(2)))
    first = sweep(env)
    assert len(first) == 10 and first[:2] == ["default/m-0", "default/m-1"]
    assert [len(sweep(env)) for _ in range(4)] == [10, 10, 2, 0]


# ------------------------------------------------------------------ property: any arrival order, any interference

Op = tuple[str, int, int]  # (what, pod index, argument)

OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 7), st.integers(0, 1)),  # argument: the pod's own gate before ours
    st.tuples(st.just("tenant-lifts"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("delete"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("advance"), st.just(0), st.sampled_from([1, 60, int(RELEASE)])),
    st.tuples(st.just("sweep"), st.just(0), st.just(0)),
)


def _group_of(i: int) -> tuple[str, int]:
    """Pods 0-3 make group a of 4, pods 4-7 group b of 5 (which can never be whole)."""
    return ("a", 4) if i < 4 else ("b", 5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, max_size=25))
def test_gates_are_lifted_once_only_ours_and_never_outlive_their_reason(ops: list[Op]) -> None:
    from gputopo.extender.settings import Settings

    settings = Settings(namespace=NS, group_gate=True, group_gate_release_seconds=RELEASE)
    with make_env(FakeSource(NS), FakeClock(), settings) as env:
        own: dict[str, list[str]] = {}  # pod -> the gates its author wrote
        for what, i, arg in ops:
            name = f"p-{i}"
            stored = env.source.get("pods", "default", name)
            if what == "add" and stored is None:
                group, size = _group_of(i)
                pod = member_pod(name, group, size, stage=i % 4)
                own[name] = ["example.com/mine"] if arg else []
                pod["spec"]["schedulingGates"] = [{"name": g} for g in own[name]] + [{"name": GROUP_GATE}]
                env.add_pods(pod)
            elif what == "tenant-lifts" and stored is not None:
                stored["spec"]["schedulingGates"] = [{"name": g} for g in own[name]]
                env.add_pods(stored)
            elif what == "delete" and stored is not None:
                env.source.delete("pods", "default", name)
                env.resync()
            elif what == "advance":
                env.clock.advance(arg)
            elif what == "sweep":
                for lf in lifter(env).sweep():
                    if lf.reason is LiftReason.COMPLETE:
                        group, size = _group_of(int(lf.member.name[2:]))
                        assert group == "a" and lf.member.present >= size
                env.resync()
        patched = [p[1] for p in env.source.patches]
        assert len(patched) == len(set(patched)), "one write per pod"
        # The bound runs from when the lifter first saw the pod (it sweeps every second): past it, a sweep
        # leaves no pod gated by gputopo, and the authors' own gates all stay.
        sweep(env)
        env.clock.advance(RELEASE)
        sweep(env)
        for name, gates in own.items():
            if env.source.get("pods", "default", name) is not None:
                assert gates_of(env, name) == gates
