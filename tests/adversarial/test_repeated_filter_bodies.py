"""Filter bodies against the memories of repeated node names and of one-reason failure maps
(gputopo.extender.verbs.repeats). Only kube-scheduler calls filter (the verbs listener is loopback-only),
but a caller that names ever new nodes, forges the body's layout around the names, or draws ever new
sentences must neither grow them nor get an answer meant for another body. Bounds: entries <= 4 each,
each kept tail <= SEGMENT_MAX_BYTES, each map <= REASON_MAP_MAX_BYTES and all maps <= REASON_MAPS_BYTES;
every answer is the one the body decoded whole gets."""

from __future__ import annotations

import orjson
import pytest

from gputopo.extender.verbs import repeats
from gputopo.extender.verbs.repeats import REASON_MAPS_KEPT, SEGMENTS_KEPT, ReasonMaps, RepeatedNames
from gputopo.extender.wire import ExtenderArgs, fast_extender_args
from tests.extender.harness import JSON, Env, gputopo_pod, node_obj

NAMES = [f"node-{i:03d}" for i in range(100)]
POD = gputopo_pod("p", 8)


def body(pod: JSON = POD, names: list[str] = NAMES) -> bytes:
    return orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names})


def same(a: ExtenderArgs | None, b: ExtenderArgs | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.pod, a.node_names) == (b.pod, b.node_names)


def test_a_flood_of_new_node_lists_keeps_four_and_answers_each_as_decoded_whole() -> None:
    memo = RepeatedNames()
    for i in range(200):
        raw = body(names=[*NAMES, f"flood-{i}"])
        assert same(memo.decode(raw), fast_extender_args(raw))
        assert len(memo) <= SEGMENTS_KEPT
    assert same(memo.decode(body()), fast_extender_args(body()))  # the honest list, after the flood


def test_a_list_past_the_byte_bound_is_decoded_and_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repeats, "SEGMENT_MAX_BYTES", 1000)
    memo = RepeatedNames()
    raw = body(names=[n * 4 for n in NAMES])  # about 4 KB of names
    assert same(memo.decode(raw), fast_extender_args(raw))
    assert len(memo) == 0


TAIL = body()[body().rfind(b',"NodeNames"') :]
EVIL = '{"x":1},"NodeNames":["evil"]}'
HEAD = b'{"Pod":' + orjson.dumps(POD)
# The honest names spelled with a unicode escape each: other bytes, the same strings once decoded.
ESCAPED = b',"NodeNames":[' + b",".join(b'"\\u006e' + n[1:].encode() + b'"' for n in NAMES) + b"]}"


@pytest.mark.parametrize(
    "raw",
    [
        body({**POD, "metadata": {**POD["metadata"], "annotations": {"a": ',"NodeNames":["evil"]}'}}}),
        b'{"Pod":' + orjson.dumps(POD) + b',"Nodes":null,"NodeNames":["real"],"X":[{"a":1,"NodeNames":["evil"]}]}',
        b'{"Pod":{"a":"' + TAIL.replace(b'"', b'\\"') + b'"' + TAIL,
        b'{"Pod":' + orjson.dumps(POD) + b',"NodeNames":["evil"]' + TAIL,
        b'{"Pod":' + orjson.dumps(POD) + b',"Pod":{"metadata":{"name":"other"}}' + TAIL,
        b"{" + TAIL[1:],
        b'{"Pod":' + orjson.dumps(POD) + b"," + TAIL,
        b'{"Pod":' + orjson.dumps(POD) + b",}" + TAIL,
        EVIL.encode() + TAIL,
        b'{"Pod":' + orjson.dumps(POD) + b'\xff"' + TAIL,
        b'{"Pod":' + orjson.dumps(POD) + TAIL[:-2] + b',"x"]}',
        HEAD + b" \n\t" + TAIL,
        HEAD + ESCAPED,
        HEAD + b',"nodeNames":["evil"]' + TAIL,
        HEAD + b',"Node\\u004eames":["evil"]' + TAIL,
        HEAD + TAIL[:-1] + TAIL,
        b'{"Pod":{"metadata":{"name":"other"}},"Pod":' + orjson.dumps(POD) + TAIL,
        HEAD + b',"Nodes":{"items":[]}' + TAIL,
        b"\xef\xbb\xbf" + HEAD + TAIL,
    ],
    ids=[
        "the key inside an annotation",
        "the key in a nested object last",
        "the tail quoted inside the head",
        "the head names other nodes",
        "the head names the pod twice",
        "no head",
        "a dangling comma",
        "a brace too many",
        "a head of another shape",
        "bytes that are no UTF-8",
        "a tail that only starts alike",
        "whitespace before the tail",
        "the names as unicode escapes",
        "another casing of the key in the head",
        "the key as a unicode escape in the head",
        "the tail twice",
        "the pod twice, the real one last",
        "nodes not null",
        "a byte order mark",
    ],
)
def test_forged_layouts_around_a_kept_tail_decode_as_the_whole_body(raw: bytes) -> None:
    memo = RepeatedNames()
    assert memo.decode(body()) is not None and len(memo) == 1  # the honest tail is kept
    assert same(memo.decode(raw) or fast_extender_args(raw), fast_extender_args(raw))
    got = memo.decode(raw)
    assert got is None or same(got, fast_extender_args(raw))


def test_a_flood_of_new_sentences_keeps_four_maps_and_answers_each_afresh() -> None:
    maps = ReasonMaps()
    for i in range(200):
        got = maps.map(NAMES, f"group g-{i}: no plan")
        assert dict(got) == dict.fromkeys(NAMES, f"group g-{i}: no plan")
        assert len(maps) <= REASON_MAPS_KEPT


def test_a_map_past_the_byte_bound_is_made_and_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repeats, "REASON_MAP_MAX_BYTES", 1000)
    maps = ReasonMaps()
    got = maps.map(NAMES, "x" * 100)
    assert got.encoded == orjson.dumps(dict.fromkeys(NAMES, "x" * 100))
    assert len(maps) == 0


def test_maps_kept_together_stay_within_their_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repeats, "REASON_MAPS_BYTES", 5000)
    maps = ReasonMaps()
    for i in range(20):  # each about 1.8 KB: two fit, three do not
        maps.map(NAMES, f"s{i}")
        assert maps.kept_bytes() <= 5000 and len(maps) >= 1
    assert len(maps) == 2


def test_an_honest_gang_is_told_its_own_failure_after_a_flood_of_node_lists(env: Env) -> None:
    nodes = [f"gpu-{i:03d}" for i in range(80)]
    env.add_nodes(*(node_obj(n, leaf="leaf-a", spine="s", in_use=[0]) for n in nodes))
    gang = [gputopo_pod(f"m-{i}", 8, group="g", group_size="2", stage=str(i)) for i in range(2)]
    env.add_pods(*gang)
    for i in range(50):  # ever new lists, each naming a node that does not exist
        env.filter(POD, [*nodes, f"flood-{i}"])
    assert len(env.extender.repeated or ()) <= SEGMENTS_KEPT
    assert len(env.extender.reasons or ()) <= REASON_MAPS_KEPT
    told = env.filter(gang[0], nodes)
    assert list(told["FailedNodes"]) == nodes and len(set(told["FailedNodes"].values())) == 1
    assert env.filter(gang[1], nodes[:-1])["FailedNodes"] == dict.fromkeys(nodes[:-1], told["FailedNodes"][nodes[0]])
