"""kube-scheduler's leader election Lease as the extender reads it (gputopo.extender.watch.parsers.leader_lease,
gputopo.extender.state.leadership): anyone who may write Leases in the release namespace may write it. Bounds:
a field that is not what kube-scheduler writes reads as no holder, never renewed or no duration, so an
unreadable Lease leads no one (0 gate lifts written) and the agents' Leases beside it are read as ever; a
Lease of that name in another namespace, or of another name, is not the leader's; a renewTime ahead of the
clock leads no longer than a renewal seen now."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from gputopo.extender.settings import Settings
from gputopo.extender.state.leadership import Leadership
from gputopo.extender.watch.parsers import leader_lease
from gputopo.model.gates import GROUP_GATE
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, T0, FakeClock, make_env, pod_obj, rfc3339, two_leaves

LEASE = "gputopo-scheduler"
ME = socket.gethostname()


def lease(**spec: Any) -> JSON:
    base: dict[str, Any] = {"holderIdentity": f"{ME}_1", "renewTime": rfc3339(T0), "leaseDurationSeconds": 15}
    base.update(spec)
    return {"metadata": {"name": LEASE, "namespace": NS}, "spec": {k: v for k, v in base.items() if v is not ...}}


@pytest.mark.parametrize(
    ("obj", "leads"),
    [
        pytest.param(lease(), True, id="well-formed-ours"),
        pytest.param(lease(holderIdentity=ME), True, id="holder-our-hostname-alone"),
        pytest.param(lease(holderIdentity=f"{ME}x_1"), False, id="holder-a-hostname-that-extends-ours"),
        pytest.param(lease(holderIdentity=f"{ME[:-1]}_1"), False, id="holder-a-prefix-of-our-hostname"),
        pytest.param(lease(holderIdentity=f"other_{ME}_1"), False, id="holder-our-hostname-inside-another"),
        pytest.param(lease(holderIdentity=""), False, id="holder-empty"),
        pytest.param(lease(holderIdentity=7), False, id="holder-not-a-string"),
        pytest.param(lease(holderIdentity=f"{ME}_" + "x" * 5000), False, id="holder-past-its-bound"),
        pytest.param(lease(leaseDurationSeconds="15"), False, id="duration-a-string"),
        pytest.param(lease(leaseDurationSeconds=-5), False, id="duration-negative"),
        pytest.param(lease(leaseDurationSeconds=0), False, id="duration-zero"),
        pytest.param(lease(leaseDurationSeconds=True), False, id="duration-a-bool"),
        pytest.param(lease(leaseDurationSeconds=10**400), True, id="duration-past-a-float-capped"),
        pytest.param(lease(renewTime="soon"), False, id="renew-time-garbage"),
        pytest.param(lease(renewTime=...), False, id="never-renewed"),
        pytest.param({"metadata": {"name": LEASE, "namespace": NS}, "spec": []}, False, id="spec-not-a-map"),
    ],
)
def test_a_leader_lease_is_read_leniently_and_an_unreadable_one_leads_no_one(obj: JSON, leads: bool) -> None:
    hold = leader_lease(obj, LEASE, NS)
    assert hold is not None
    lead = Leadership(LEASE, ME, lambda: T0 + 0.5)
    lead.put(hold)
    assert lead.leading() is leads


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param({"metadata": {"name": LEASE, "namespace": "elsewhere"}, "spec": {}}, id="another-namespace"),
        pytest.param({"metadata": {"name": "gputopo-schedulerx", "namespace": NS}, "spec": {}}, id="another-name"),
    ],
)
def test_a_lease_of_that_name_elsewhere_is_not_the_leaders(obj: JSON) -> None:
    assert leader_lease(obj, LEASE, NS) is None


def test_a_hostile_leader_lease_through_the_watch_lifts_nothing_and_breaks_no_agent_lease() -> None:
    settings = Settings(namespace=NS, group_gate=True, leader_lease=LEASE)
    with make_env(FakeSource(NS), FakeClock(), settings) as env:
        env.add_nodes(*two_leaves())
        env.source.put("leases", lease(holderIdentity=["x"], leaseDurationSeconds={"a": 1}))
        ann = {"gputopo.io/nvlink": "required", "gputopo.io/group": "g", "gputopo.io/group-size": "1"}
        pod = pod_obj("m-0", 8, ann)
        pod["spec"]["schedulingGates"] = [{"name": GROUP_GATE}]
        env.add_pods(pod)
        assert not env.cache.leadership.leading()
        assert env.listeners.lifter is not None and env.listeners.lifter.sweep() == []
        assert env.source.patches == []
        assert len(env.ledger.states(["gpu-1"])) == 1 and env.ledger.states(["gpu-1"])[0].problem is None


@pytest.mark.parametrize(
    "renew",
    [
        pytest.param(T0, id="renewed-now"),
        pytest.param(T0 + 3600, id="an-hour-ahead"),
        pytest.param(T0 + 10**9, id="decades-ahead"),
        pytest.param(253402300799.0, id="the-last-second-of-year-9999"),
    ],
)
def test_a_renewal_ahead_of_our_clock_holds_no_longer_than_one_seen_now(renew: float) -> None:
    # A renewTime ahead of the extender's clock (a skewed or hostile writer) counts from when this replica saw
    # it, as client-go's own election counts it: a kube-scheduler that stopped renewing leads no longer than
    # `leaseDurationSeconds` after its last renewal was seen, and the same Lease delivered again (a relist)
    # extends nothing.
    clock = FakeClock()
    lead = Leadership(LEASE, ME, clock)
    hold = leader_lease(lease(renewTime=rfc3339(renew)), LEASE, NS)
    lead.put(hold)
    assert lead.leading()
    clock.advance(10)
    lead.put(hold)  # relisted, unchanged
    clock.advance(6)
    assert not lead.leading()
