"""A group's hold on its members' GPUs runs from the plan and again from each member's bind: a big gang
that keeps binding keeps its hold however long binding all of it takes, and one that stops binding
loses it after the timeout."""

from __future__ import annotations

import pytest

from tests.extender.harness import JSON, Env, node_obj, pod_obj

NODES = ["gpu-1", "gpu-2", "gpu-3"]
GROUP = {"gputopo.io/group": "train", "gputopo.io/group-size": "3"}


def members() -> list[JSON]:
    return [pod_obj(f"train-{i}", 8, {**GROUP, "gputopo.io/stage": str(i)}) for i in range(3)]


def outsider_passes(env: Env) -> list[str]:
    return list(env.filter(pod_obj("other", 8, {"gputopo.io/nvlink": "required"}), NODES)["NodeNames"])


@pytest.mark.parametrize(
    ("bind_after", "then", "held"),
    [
        pytest.param(100, 100, True, id="a bind at 100 s keeps the hold at 200 s"),
        pytest.param(100, 121, False, id="no bind for 121 s after the last: released"),
        pytest.param(None, 121, False, id="no bind at all for 121 s: released"),
    ],
)
def test_each_members_bind_renews_the_groups_hold(env: Env, bind_after: float | None, then: float, held: bool) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    pods = members()
    env.add_pods(*pods)
    (first,) = env.filter(pods[0], NODES)["NodeNames"]
    assert outsider_passes(env) == []  # every GPU is planned for the group
    if bind_after is not None:
        env.clock.advance(bind_after)
        env.renew_leases()
        assert env.bind(pods[0], first) == ""
        env.resync()
    env.clock.advance(then)
    env.renew_leases()
    assert (outsider_passes(env) == []) is held
