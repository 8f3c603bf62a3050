"""Whether this replica's kube-scheduler leads (gputopo.extender.state.leadership): it holds kube-scheduler's
leader election Lease (its holderIdentity starts with this pod's hostname) and renewed it within its duration;
without an election every replica leads. Read through the cache's Lease watch beside the agents' Leases."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gputopo.extender.settings import Settings
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, make_env, rfc3339, two_leaves

LEASE = "gputopo-scheduler"
ME = socket.gethostname()


""" + open("/tmp/h5/leadership_block.py").read().rstrip() + """


def leader_lease(holder: str, renew: float) -> JSON:
    return {
        "metadata": {"name": LEASE, "namespace": NS},
        "spec": {"holderIdentity": holder, "renewTime": rfc3339(renew), "leaseDurationSeconds": 15},
    }


@pytest.fixture
def replica_env() -> Iterator[Env]:
    with make_env(FakeSource(NS), FakeClock(), Settings(namespace=NS, leader_lease=LEASE)) as e:
        e.add_nodes(*two_leaves())
        yield e


def test_the_watch_follows_the_lease_from_standby_to_leader_and_back(replica_env: Env) -> None:
    env = replica_env
    lead = env.cache.leadership
    assert not lead.leading()  # not listed yet
    env.source.put("leases", leader_lease("other-replica_5f1e", env.clock.now))
    env.resync()
    assert not lead.leading()
    env.source.put("leases", leader_lease(f"{ME}_9c2d", env.clock.now))
    env.resync()
    assert lead.leading()
    env.clock.advance(16)
    assert not lead.leading()  # not renewed within its duration
    env.renew_leases()
    env.source.put("leases", leader_lease(f"{ME}_9c2d", env.clock.now))
    env.resync()
    assert lead.leading()
    env.source.delete("leases", NS, LEASE)
    env.resync()
    assert not lead.leading()
    assert all(s.problem is None for s in env.ledger.states(["gpu-1", "gpu-2"]))  # the agents' Leases read as ever
