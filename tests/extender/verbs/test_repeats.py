"""A filter's repeated node names decoded once and one reason for every node encoded once
(gputopo.extender.verbs.repeats) answer exactly what decoding and encoding in full answers: the same args
for every body, the same bytes for every failure map, and through the door the same answer bytes as an
extender without them, over tables and random sequences of bodies, node and member changes. A changed
node list, pod, sentence or member never gets an earlier answer."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.extender.settings import Settings
from gputopo.extender.verbs.repeats import MIN_NAMES, ReasonMaps, RepeatedNames, SameReason
from gputopo.extender.wire import ExtenderArgs, fast_extender_args
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, make_env, node_obj

NAMES = [f"gpu-{i:03d}" for i in range(MIN_NAMES + 6)]
POD = gputopo_pod("p", 8)


def body(pod: JSON = POD, names: list[str] = NAMES) -> bytes:
    """A filter body as kube-scheduler writes it (Go's field order, no spaces)."""
    return orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names})


def same(a: ExtenderArgs | None, b: ExtenderArgs | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.pod, a.node_names, a.nodes) == (b.pod, b.node_names, b.nodes)


def decoded(memo: RepeatedNames, raw: bytes) -> ExtenderArgs | None:
    """What the door decodes: the memory's args, else the fast decoder's."""
    return memo.decode(raw) or fast_extender_args(raw)


OTHER = gputopo_pod("q", 4, group="g", group_size="2")
RENAMED = [*NAMES[:-1], "gpu-zzz"]


@pytest.mark.parametrize(
    ("bodies", "kept"),
    [
        ([body(), body(), body()], 1),
        ([body(), body(OTHER), body(POD)], 1),
        ([body(), body(names=RENAMED), body()], 2),
        ([body(), body(names=NAMES[::-1]), body(names=NAMES[:-1])], 3),
        ([body(), body(names=[*NAMES, NAMES[0]])], 2),  # a name twice: kept as sent
        ([body(names=NAMES[:3]), body(names=NAMES[:3])], 0),  # short lists are decoded, not kept
        ([json.dumps({"Pod": POD, "Nodes": None, "NodeNames": NAMES}).encode()], 0),  # spaces: not Go's layout
        ([json.dumps({"pod": POD, "nodenames": NAMES}).encode()], 0),  # other casing: the models' part
        ([body(), body()[:-1] + b" }"], 1),
        ([body(), b'{"Pod":' + orjson.dumps(POD) + b',"NodeNames":["x"]' + body()[body().rfind(b',"NodeNames"') :]], 1),
        ([body(), b'{"Pod":{"a":"x' + body()[body().rfind(b',"NodeNames"') :]], 1),  # the head ends in a string
        ([body(), b"[1" + body()[body().rfind(b',"NodeNames"') :]], 1),
        ([body(), body({**POD, "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 1.5}}}]}})], 1),
    ],
    ids=[
        "the same body again",
        "another pod, the same names",
        "one name changed",
        "reordered, then one left out",
        "a repeated name",
        "a short list",
        "spaces between tokens",
        "lower-case keys",
        "a space before the last brace",
        "the head names NodeNames too",
        "a head that is no object",
        "a head that is an array",
        "a GPU count that is a float",
    ],
)
def test_a_repeated_names_tail_decodes_as_the_whole_body_does(bodies: list[bytes], kept: int) -> None:
    memo = RepeatedNames()
    for raw in bodies:
        assert same(decoded(memo, raw), fast_extender_args(raw))
        got = memo.decode(raw)
        assert got is None or same(got, fast_extender_args(raw))  # never an answer the whole body lacks
    assert len(memo) == kept


def test_names_handed_out_are_a_copy_of_the_kept_ones() -> None:
    memo = RepeatedNames()
    first = memo.decode(body())
    assert first is not None and first.node_names is not None
    first.node_names.clear()  # a caller that changes its list changes no later answer
    again = memo.decode(body())
    assert again is not None and again.node_names == NAMES


def test_names_are_spelled_once_at_their_first_repeat_and_then_compare_by_identity() -> None:
    spelled: list[int] = []
    canonical = {n: "".join(n) for n in NAMES}

    def spell(names: list[str]) -> list[str]:
        spelled.append(len(names))
        return [canonical.get(n, n) for n in names]

    memo = RepeatedNames(spell)
    first = memo.decode(body(POD))
    assert spelled == []  # a list seen once (a lone pod's) is never spelled
    answers = [memo.decode(body(p)) for p in (OTHER, POD)]
    assert spelled == [len(NAMES)]
    assert first is not None and first.node_names == NAMES
    assert all(a is not None and a.node_names is not None for a in answers)
    assert all(x is canonical[x] for a in answers if a and a.node_names for x in a.node_names)


pods = st.sampled_from([POD, OTHER, gputopo_pod("r", 2)])
lists = st.sampled_from([NAMES, NAMES[::-1], NAMES[:-1], RENAMED, NAMES[:5], [*NAMES, "gpu-000"]])
layouts = st.sampled_from(["go", "spaces", "lower", "head-names", "broken-head", "trailing-space"])


def _laid_out(pod: JSON, names: list[str], layout: str) -> bytes:
    raw = body(pod, names)
    tail = raw[raw.rfind(b',"NodeNames"') :]
    return {
        "go": raw,
        "spaces": json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}).encode(),
        "lower": json.dumps({"pod": pod, "nodenames": names}).encode(),
        "head-names": b'{"Pod":' + orjson.dumps(pod) + b',"NodeNames":[]' + tail,
        "broken-head": b'{"Pod":{"x":' + tail,
        "trailing-space": raw + b" ",
    }[layout]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(pods, lists, layouts), min_size=1, max_size=20))
def test_random_sequences_of_bodies_decode_as_each_body_whole(steps: list[tuple[JSON, list[str], str]]) -> None:
    memo = RepeatedNames()
    for pod, names, layout in steps:
        raw = _laid_out(pod, names, layout)
        assert same(decoded(memo, raw), fast_extender_args(raw))
    assert len(memo) <= 4


# ---------------------------------------------------------------------- one reason for every node


@pytest.mark.parametrize(
    ("calls", "made"),
    [
        ([(NAMES, "a")] * 3, 1),
        ([(NAMES, "a"), (NAMES, "b"), (NAMES, "a")], 2),
        ([(NAMES, "a"), (RENAMED, "a"), (NAMES[::-1], "a"), (NAMES, "a")], 3),
        ([(NAMES, "a"), ([*NAMES, NAMES[0]], "a")], 2),
        ([(NAMES[:3], "a"), (NAMES[:3], "a")], 2),  # short: made each time, not kept
        ([([], "a")], 1),
    ],
    ids=["the same", "another sentence", "other names or order", "a repeated name", "a short list", "no nodes"],
)
def test_a_reason_map_is_the_map_and_the_bytes_of_building_it_afresh(
    calls: list[tuple[list[str], str]], made: int
) -> None:
    maps = ReasonMaps()
    seen: list[SameReason] = []
    for names, text in calls:
        got = maps.map(names, text)
        plain = dict.fromkeys(names, text)
        assert got == plain and list(got.items()) == list(plain.items())
        assert orjson.dumps({"FailedNodes": got.fragment, "x": 1}) == orjson.dumps({"FailedNodes": plain, "x": 1})
        if all(got is not s for s in seen):
            seen.append(got)
    assert len(seen) == made


def test_a_reason_map_cannot_be_changed() -> None:
    got: Any = ReasonMaps().map(NAMES, "a")
    with pytest.raises(TypeError):
        got["gpu-000"] = "b"
    assert not hasattr(got, "pop") and not hasattr(got, "update")


# ---------------------------------------------------------------------- through the door

GANG = 4
NODES = [f"gpu-{i:03d}" for i in range(MIN_NAMES + 8)]


def member(i: int, size: int = GANG, tag: str = "") -> JSON:
    return gputopo_pod(f"big-{i}{tag}", 8, group="big", group_size=str(size), stage=str(i))


Op = tuple[str, int, int]
ops = st.lists(
    st.tuples(
        st.sampled_from(["filter", "filter", "filter", "lone", "gpus", "replace", "drop-pod", "drop-node", "leaf"]),
        st.integers(0, GANG - 1),
        st.integers(0, 5),
    ),
    min_size=1,
    max_size=20,
)


def _names(k: int) -> list[str]:
    """The candidates kube-scheduler might send: all, reordered, fewer, or one it does not know."""
    return [NODES, NODES[::-1], NODES[1:], [*NODES, "gpu-new"], NODES, NODES[: MIN_NAMES + 1]][k]


def _step(env: Env, op: Op, pods: dict[int, JSON]) -> bytes | None:
    kind, i, k = op
    if kind == "filter":
        return env.call("filter", {"Pod": pods[i], "Nodes": None, "NodeNames": _names(k)}).body
    if kind == "lone":
        pod = gputopo_pod("lone", 1 + k)
        return env.call("filter", {"Pod": pod, "Nodes": None, "NodeNames": _names(k)}).body
    if kind == "gpus":
        env.source.put("nodes", node_obj(NODES[k], leaf="leaf-a", spine="s", in_use=list(range(i + 1))))
    elif kind == "replace":
        env.source.delete("pods", "default", pods[i]["metadata"]["name"])
        pods[i] = member(i, tag=f"-{k}")
        env.source.put("pods", pods[i])
    elif kind == "drop-pod":
        env.source.delete("pods", "default", pods[i]["metadata"]["name"])
    elif kind == "drop-node":
        env.source.delete("nodes", "", NODES[k])
    elif kind == "leaf":
        env.source.put("nodes", node_obj(NODES[k], leaf=f"leaf-{i % 2}", spine="s", in_use=[0]))
    env.resync()
    return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_the_door_answers_the_bytes_it_answers_without_the_repeats(steps: list[Op]) -> None:
    """Random filters of an unplaceable gang's members and of a lone pod, with nodes' GPUs, labels and
    members changing between them: the extender with the repeats answers every filter with exactly the
    bytes of one that decodes and encodes every filter in full."""
    conf = Settings(namespace=NS, stale_after_seconds=1e9, reservation_timeout_seconds=1e9)
    answers: list[list[bytes | None]] = []
    for repeats in (True, False):
        with make_env(FakeSource(NS), FakeClock(), conf) as env:
            if not repeats:
                env.extender.repeated = env.extender.reasons = None
            free = GANG - 1  # the gang never fits
            env.add_nodes(
                *(node_obj(n, leaf="leaf-a", spine="s", in_use=None if j < free else [0]) for j, n in enumerate(NODES))
            )
            pods = {i: member(i) for i in range(GANG)}
            env.add_pods(*pods.values())
            answers.append([_step(env, op, pods) for op in steps])
    assert answers[0] == answers[1]


def test_a_retry_round_is_told_the_kept_failure_on_the_nodes_each_member_names(env: Env) -> None:
    env.add_nodes(*(node_obj(n, leaf="leaf-a", spine="s", in_use=None if j < 2 else [0]) for j, n in enumerate(NODES)))
    pods = [member(i, size=3) for i in range(3)]
    env.add_pods(*pods)
    first = env.filter(pods[0], NODES)
    assert set(first["FailedNodes"]) == set(NODES) and len(set(first["FailedNodes"].values())) == 1
    assert env.filter(pods[1], NODES) == first
    fewer = env.filter(pods[2], NODES[1:])
    assert list(fewer["FailedNodes"]) == NODES[1:]  # a changed node list is never told the earlier map
    assert len(env.extender.reasons or ()) == 2
