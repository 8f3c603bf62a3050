"""The simulator against the real kube-scheduler (the chart's configuration) and gputopo-extender.

Simulated nodes with the agent's annotations and Leases (`gputopo.localcluster.replay`); pods carry CPU
and memory requests, so kube-scheduler's own LeastAllocated and BalancedAllocation scores take part.
Each pod's real placement is judged against what the engine decides in the state the real placements
left (`gputopo.sim.fidelity.Follower`): the engine's node, or one it scores equal.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gputopo.clusterfile import JobSpec
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.localcluster import ControlPlane, KubeClient
from gputopo.localcluster.replay import MixLimits, MixRun, Replay
from gputopo.localcluster.stack import Stack, StackTiming
from gputopo.model import LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

ROUNDS = 20


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    # The replayed nodes' Leases are renewed once, when created: staleness must outlast the module.
    s = Stack(control_plane, kube, timing=StackTiming(stale_after_seconds=3600))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def replay(kube: KubeClient, stack: Stack) -> Replay:
    return Replay(kube, stack)


def _node(name: str, fixture: str, *, leaf: str = "", in_use: tuple[int, ...] = ()) -> NodeState:
    labels = {LABEL_NETWORK_SPINE: "spine-a", LABEL_NETWORK_LEAF: leaf} if leaf else {}
    return node_state(name, build_system(fixture, name), labels=labels, in_use=frozenset(in_use))


def _differences(run: MixRun) -> list[str]:
    return [
        f"{v.pod}: real {v.real.node if v.real else 'unplaced'}, engine {v.engine_node}: {v.note}"
        for v in run.verdicts
        if not v.agrees
    ]


def test_fidelity_tp4_goes_to_fragmented_dgx1v_node(replay: Replay, test_id: str) -> None:
    """The issue's case, on a fresh pair of nodes each round: GPU 1 of one DGX-1V held by a bound pod
    (with its CPU and memory, so LeastAllocated favours the other node), the other empty. The engine
    keeps the empty node whole: the TP-4 pod goes to the fragmented node's quad 4-7, every time."""
    tp4 = JobSpec(name="tp4", gpus_per_pod=4, annotations={"gputopo.io/nvlink": "required"})
    got = []
    for r in range(ROUNDS):
        frag, empty = f"frag-{r}-{test_id[-6:]}", f"empty-{r}-{test_id[-6:]}"
        run = replay.run_mix(
            f"tp4-{r}", [_node(frag, "dgx-1v", in_use=(1,)), _node(empty, "dgx-1v")], [tp4], MixLimits(deadline_s=60)
        )
        (v,) = run.verdicts
        assert not run.notes, run.notes
        got.append((v.real.node if v.real else None, v.real.gpus if v.real else ()))
        assert v.engine_node == frag
    want = [(f"frag-{r}-{test_id[-6:]}", (4, 5, 6, 7)) for r in range(ROUNDS)]
    on_frag = sum(g == w for g, w in zip(got, want, strict=True))
    assert got == want, f"{on_frag}/{ROUNDS} rounds on the fragmented node's quad 4-7: {got}"


def test_fidelity_mix_of_20_pods_matches_simulator(replay: Replay, test_id: str) -> None:
    """TP-1/2/4/8 pods, a plain pod and a two-stage group, one by one over six nodes of four kinds
    (the last ones do not fit): every real placement is the engine's or one it scores equal."""
    s = test_id[-6:]
    nodes = [
        _node(f"h100-a-{s}", "dgx-h100", leaf="leaf-1"),
        _node(f"h100-b-{s}", "dgx-h100", leaf="leaf-1"),
        _node(f"h100-c-{s}", "dgx-h100", leaf="leaf-2", in_use=(0, 1)),
        _node(f"v100-a-{s}", "dgx-1v", leaf="leaf-2", in_use=(1,)),
        _node(f"v100-b-{s}", "dgx-1v", leaf="leaf-2"),
        _node(f"pcie-{s}", "a100-pcie-bridged"),
    ]
    req = {"gputopo.io/nvlink": "required"}
    jobs = [
        JobSpec(name="tp8-first", gpus_per_pod=8, annotations=req),
        JobSpec(
            name="pp",
            pods=2,
            gpus_per_pod=8,
            annotations={"gputopo.io/network": "infiniband", "gputopo.io/preferred-tier": "leaf"},
        ),
        *[JobSpec(name=f"tp4-{i}", gpus_per_pod=4, annotations=req) for i in range(4)],
        *[JobSpec(name=f"tp2-{i}", gpus_per_pod=2, annotations=req) for i in range(5)],
        *[JobSpec(name=f"tp1-{i}", gpus_per_pod=1, annotations={"gputopo.io/nvlink": "ignore"}) for i in range(5)],
        JobSpec(name="plain", gpus_per_pod=1),
        JobSpec(name="tp8-late", gpus_per_pod=8, annotations=req),
        JobSpec(name="tp4-late", gpus_per_pod=4, annotations=req),
    ]
    assert sum(j.pods for j in jobs) == 20
    run = replay.run_mix("mix20", nodes, jobs, MixLimits(deadline_s=240))
    assert run.complete and not run.notes, run.notes
    assert len(run.verdicts) == 20
    differ = _differences(run)
    assert not differ, f"{len(differ)}/20 pods differ: {differ}"
    assert any(v.real is None for v in run.verdicts), "the mix is meant to run out of room"
