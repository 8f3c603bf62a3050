"""The hot path's shortcuts give exactly what the plain way gives: the orjson request decoder, the
pre-encoded prioritize answer, the ledger's C-level kind lookups (across Lease deadlines), the
filter's split of outcomes and bind's runner-up."""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.network.domains import domain_free, narrow_first
from gputopo.engine.state.reasons import Code, Reason
from gputopo.engine.state.snapshot import NodeState
from gputopo.extender.state import nodestates
from gputopo.extender.verbs.door import _priorities
from gputopo.extender.wire import MAX_JSON_DEPTH, ExtenderArgs, fast_extender_args, pod_info
from gputopo.model import parse_pod_request
from tests.extender.harness import Env, gputopo_pod, node_obj, pod_obj

POD = gputopo_pod("p", 4)


@pytest.mark.parametrize(
    "body",
    [
        {"Pod": POD, "Nodes": None, "NodeNames": ["a", "b", "a"]},
        {"Pod": POD, "NodeNames": []},
        {
            "Pod": {**POD, "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 2}}}]}},
            "NodeNames": ["x"],
        },
    ],
    ids=["go-cased", "no Nodes key", "numeric quantity"],
)
def test_the_fast_decoder_reads_what_the_models_read(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    fast, slow = fast_extender_args(raw), ExtenderArgs.model_validate_json(raw)
    assert fast is not None
    assert (fast.pod, fast.node_names, fast.nodes) == (slow.pod, slow.node_names, slow.nodes)
    assert pod_info(fast.pod) == pod_info(slow.pod)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps({"pod": POD, "nodenames": ["a"]}).encode(),  # other casing: the models fold it
        json.dumps({"Pod": POD, "Nodes": {"items": []}}).encode(),  # Node objects
        json.dumps({"Pod": POD, "NodeNames": ["a", 1]}).encode(),  # a name that is not a string
        json.dumps({"Pod": POD, "NodeNames": "a"}).encode(),
        json.dumps({"Pod": None, "NodeNames": ["a"]}).encode(),
        json.dumps({"Pod": POD, "NodeNames": ["a"], "Extra": 1}).encode(),
        json.dumps({"Pod": {**POD, "x": _nested(MAX_JSON_DEPTH)}, "NodeNames": []}).encode(),
        b'{"Pod": {"metadata": {"name": "p"}, "x": NaN}, "NodeNames": []}',
        b'{"Pod": {"metadata": {"name": "p"}, "x": 1e400}, "NodeNames": []}',
        # past 64 bits orjson reads a float where pydantic-core reads an int: the models decide
        json.dumps({"Pod": gputopo_pod("p", 4), "NodeNames": []}).replace('"4"', "99999999999999999999999").encode(),
        b'{"Pod": {"metadata": {"name": "\\ud800"}}, "NodeNames": []}',
        b"[]",
        b"not json",
    ],
)
def test_anything_else_goes_to_the_models(raw: bytes) -> None:
    assert fast_extender_args(raw) is None


def test_prioritize_answers_are_the_bytes_orjson_would_write_relative_to_the_lowest_score() -> None:
    rng = random.Random(5)
    names = [f"n-{i}" for i in range(300)] + ['quote"d', "back\\slash", "é-ü", "tab\t", "n-1"]
    for low in (0, 1, 4):
        scores = [rng.randint(low, 10) for _ in names]
        lowest = min(scores)
        assert _priorities(names, scores) == orjson.dumps(
            [{"Host": n, "Score": s - lowest} for n, s in zip(names, scores, strict=True) if s > lowest]
        )
    assert _priorities(["a", "b"], [0, 11]) == b'[{"Host":"b","Score":11}]'  # never expected: encoded plainly
    assert _priorities(["a", "b"], [-1, 3]) == b'[{"Host":"b","Score":4}]'
    assert _priorities(["a", "b"], [7, 7]) == b"[]"  # no preference: nothing to add to any node
    assert _priorities([], []) == b"[]"


@given(st.lists(st.integers(0, 10), max_size=40))
def test_relative_scores_rank_every_pair_of_nodes_as_the_absolute_ones_do(scores: list[int]) -> None:
    # kube-scheduler adds a listed node's score to its total and nothing for an unlisted one: every
    # difference between two nodes, and so its choice, must be what the absolute scores give.
    names = [f"n{i}" for i in range(len(scores))]
    sent = {h["Host"]: h["Score"] for h in orjson.loads(_priorities(names, scores))}
    added = [sent.get(n, 0) for n in names]
    assert all(0 <= a <= 10 for a in added)
    assert [a - b for a in added for b in added] == [a - b for a in scores for b in scores]


def _cluster(env: Env) -> list[str]:
    rng = random.Random(11)
    nodes = []
    for i in range(40):
        fixture = ("dgx-h100", "hgx-h200", "l40s-4", "dgx-a100")[i % 4]
        gpus = 4 if fixture == "l40s-4" else 8
        in_use = sorted(rng.sample(range(gpus), rng.randint(0, gpus))) if i % 3 else None
        nodes.append(node_obj(f"n{i:02d}", fixture, in_use=in_use, leaf=f"leaf-{i % 5}", spine=f"spine-{i % 2}"))
    env.add_nodes(*nodes)
    return [f"n{i:02d}" for i in range(40)]


def _plain_outcomes(env: Env, names: list[str], gpus: int) -> list[Any]:
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, gpus, env.ledger.tier_names)
    return [o for _, o in env.ledger.evaluate_states(names, req)]


def test_kind_lookups_follow_lease_deadlines(env: Env) -> None:
    names = [*_cluster(env), "not-a-node"]
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, 4, env.ledger.tier_names)
    assert env.ledger.evaluate(names, req) == _plain_outcomes(env, names, 4)
    env.clock.advance(121)  # every Lease deadline passed: every node is stale
    stale = env.ledger.evaluate(names, req)
    assert stale == _plain_outcomes(env, names, 4)
    assert {o.reason for o in stale[:-1]} == {Reason.TOPOLOGY_STALE}
    env.renew_leases()  # fresh again
    assert env.ledger.evaluate(names, req) == _plain_outcomes(env, names, 4)
    assert Reason.TOPOLOGY_STALE not in {o.reason for o in env.ledger.evaluate(names, req)}


def test_filter_splits_outcomes_as_a_node_by_node_loop_would(env: Env) -> None:
    names = [*_cluster(env), "not-a-node", "n01"]
    for gpus in (1, 4, 8, 16):  # 16: no node fits, so every reason is sent
        answer = env.extender.filter(pod_info(gputopo_pod(f"p{gpus}", gpus)), names)
        passed, failed, unresolvable = [], {}, {}
        for name, o in zip(names, _plain_outcomes(env, names, gpus), strict=True):
            if o.code is Code.SUCCESS:
                passed.append(name)
            elif o.code is Code.UNRESOLVABLE or o.reason is Reason.NO_FREE_CLIQUE:
                unresolvable[name] = o.message
            else:
                failed[name] = o.message
        if passed:  # reasons only when no node passed: kube-scheduler reads them only then
            failed, unresolvable = {}, {}
        assert answer.passed == passed
        assert list(answer.failed.items()) == list(failed.items())
        assert list(answer.unresolvable.items()) == list(unresolvable.items())


def _by_score_then_fill(env: Env, verdicts: list[tuple[NodeState, Any]], node: str) -> tuple[str, Any] | None:
    """The reference runner-up: the highest score, then best fit above the node over every known node."""
    free, narrow = domain_free(env.ledger.states(), env.ledger.tiers), narrow_first(env.ledger.tiers)
    feasible = [(-o.score, free.tie_key(st, narrow), o) for st, o in verdicts if o.fits and st.name != node]
    best = min(feasible, key=lambda t: (t[0], t[1]), default=None)
    return (str(best[1][-1]), best[2]) if best is not None else None


def _runner_up_by_walking_every_node(env: Env, node: str, req: Any) -> tuple[str, Any] | None:
    return _by_score_then_fill(env, env.ledger.evaluate_states(list(env.ledger.nodes), req), node)


def test_runner_up_follows_binds_dropped_nodes_and_lease_deadlines(env: Env) -> None:
    """The runner-up reads nodes by kind: after every change the kinds must still match the nodes."""
    names = _cluster(env)
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, 2, env.ledger.tier_names)

    def check() -> None:
        for node in (names[0], names[7], "elsewhere"):
            got = env.ledger.runner_up(node, req)
            assert (None if got is None else (got[0].name, got[1])) == _runner_up_by_walking_every_node(env, node, req)

    check()
    bound = 0
    for i, node in enumerate(names[:12]):  # binds change a node's kind, one node at a time
        pod = gputopo_pod(f"b{i}", 2, nvlink="required")
        env.add_pods(pod)
        if env.bind(pod, node) == "":
            bound += 1
            check()
    assert bound >= 3
    env.ledger.drop_nodes(names[20:30])
    check()
    env.clock.advance(121)  # every Lease deadline passed: no node is feasible
    assert env.ledger.runner_up(names[0], req) is None
    env.renew_leases()
    check()


def test_runner_up_is_the_best_other_node_by_score_then_best_fit_then_name(env: Env) -> None:
    names = _cluster(env)
    env.add_pods(pod_obj("busy", 2, {"gputopo.io/nvlink": "required"}))
    for gpus in (1, 2, 4, 8):
        req = parse_pod_request({"gputopo.io/nvlink": "required"}, gpus, env.ledger.tier_names)
        verdicts = env.ledger.evaluate_states(names, req)
        for node in [*names[:6], "elsewhere"]:
            want = _by_score_then_fill(env, verdicts, node)
            got = env.ledger.runner_up(node, req)
            assert (None if got is None else (got[0].name, got[1])) == want


def _take_gpus(env: Env, name: str) -> None:
    env.add_nodes(node_obj(name, "dgx-h100", in_use=[0, 1]))


def _drop(env: Env, name: str) -> None:
    env.ledger.drop_nodes([name])


def _pass_every_deadline(env: Env, _name: str) -> None:
    env.clock.advance(121)  # every Lease deadline passed: every node's kind changed to stale


def _many_changes_elsewhere(env: Env, _name: str) -> None:
    for i in range(6):  # more than the (shrunk) log keeps
        env.add_nodes(node_obj(f"x{i}", "dgx-h100", in_use=[i]))


@pytest.mark.parametrize(
    ("change", "on", "unchanged"),
    [
        (None, "n01", True),
        (_take_gpus, "n01", False),
        (_take_gpus, "n02", True),  # another node
        (_drop, "n01", False),
        (_pass_every_deadline, "n01", False),
        (_many_changes_elsewhere, "n01", False),  # too many changes since to tell
    ],
    ids=["nothing", "gpus-taken", "other-node", "dropped", "deadline-passed", "log-overflowed"],
)
def test_unchanged_since_sees_every_change_of_a_named_node(
    env: Env, monkeypatch: pytest.MonkeyPatch, change: Any, on: str, unchanged: bool
) -> None:
    env.add_nodes(node_obj("n01", "dgx-h100"), node_obj("n02", "dgx-h100"))
    monkeypatch.setattr(nodestates, "MOVES_KEPT", 4)
    states = env.ledger.node_states
    states._moves = collections.deque(states._moves, maxlen=4)
    generation = env.ledger.generation
    if change is not None:
        change(env, on)
    assert env.ledger.unchanged_since(generation, {"n01"}) is unchanged
