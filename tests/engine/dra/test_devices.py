"""GPUs as DRA devices (gputopo.engine.dra.devices) and the DRA objects the extender reads (gputopo.model.dra)."""

from __future__ import annotations

import contextlib
from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.dra import devices as dra
from gputopo.engine.state.cliques import bits, mask_of, maximal_cliques, popcount
from gputopo.model.dra import (
    DRIVER,
    ClaimInfo,
    DraObjectError,
    SliceInfo,
    device_index,
    device_name,
    in_use_by_node,
    parse_claim,
    parse_slice,
)
from gputopo.model.inuse import GpusInUse
from gputopo.model.topology import Health
from gputopo.systems import build_system


def _is_clique(adj: tuple[int, ...], mask: int) -> bool:
    return all(adj[a] >> b & 1 for a, b in combinations(bits(mask), 2))


def _brute_maximal(adj: tuple[int, ...], n: int) -> set[int]:
    cliques = [m for m in range(1, 1 << n) if _is_clique(adj, m)]
    return {m for m in cliques if not any(o != m and o & m == m for o in cliques)}


@st.composite
def graphs(draw: st.DrawFn) -> tuple[int, tuple[int, ...]]:
    n = draw(st.integers(1, 8))
    adj = [0] * n
    for a, b in combinations(range(n), 2):
        if draw(st.booleans()):
            adj[a] |= 1 << b
            adj[b] |= 1 << a
    return n, tuple(adj)


@given(graphs())
@settings(max_examples=300, deadline=None)
def test_maximal_cliques_are_exactly_the_brute_force_ones(g: tuple[int, tuple[int, ...]]) -> None:
    n, adj = g
    found = maximal_cliques(adj, (1 << n) - 1)
    assert len(found) == len(set(found))
    assert set(found) == _brute_maximal(adj, n)


@given(graphs())
@settings(max_examples=300, deadline=None)
def test_partitions_are_disjoint_cliques_that_cover_every_maximal_clique(g: tuple[int, tuple[int, ...]]) -> None:
    n, adj = g
    cliques = maximal_cliques(adj, (1 << n) - 1)
    parts, left = dra.partition_cover(n, cliques, limit=64)
    assert not left
    for part in parts:
        for gpu, block in enumerate(part):
            assert block >> gpu & 1 and _is_clique(adj, block)
            assert all(part[other] == block for other in bits(block))  # a block is one value for all its GPUs
    blocks = {b for part in parts for b in part}
    assert all(c in blocks for c in cliques if popcount(c) >= 2)


@pytest.mark.parametrize(
    ("system", "cliques", "partitions"),
    [
        (
            "dgx-1v",
            ["0-3", "4-7", "0,4", "1,5", "2,6", "3,7"],
            [["0-3"] * 4 + ["4-7"] * 4, ["0,4", "1,5", "2,6", "3,7"] * 2],
        ),
        ("dgx-h100", ["0-7"], [["0-7"] * 8]),
        ("a100-pcie-bridged", ["0-1", "2-3", "4-5", "6-7"], [["0-1", "0-1", "2-3", "2-3", "4-5", "4-5", "6-7", "6-7"]]),
        ("l40s-4", ["0", "1", "2", "3"], [["0", "1", "2", "3"]]),
    ],
)
def test_named_systems_encode_as_expected(system: str, cliques: list[str], partitions: list[list[str]]) -> None:
    enc = dra.encoding(build_system(system))
    assert [dra.block_id(c) for c in enc.cliques] == cliques
    got = [[dra.block_id(b) for b in part] for part in enc.partitions]
    if system == "dgx-1v":
        # the cross-quad pairs, per GPU: 0->0,4  1->1,5 ... 4->0,4
        partitions[1] = ["0,4", "1,5", "2,6", "3,7", "0,4", "1,5", "2,6", "3,7"]
    assert got == partitions
    assert not enc.left_out


def test_every_device_carries_every_partition_attribute_and_the_list_only_when_asked() -> None:
    topo = build_system("dgx-1v")
    scalar = dra.devices(topo, list_attributes=False)
    listed = dra.devices(topo, list_attributes=True)
    assert [d.name for d in scalar] == [f"gpu-{i}" for i in range(8)]
    for d in scalar:
        assert all(dra.partition_attribute(p) in d.attributes for p in range(dra.PARTITIONS))
        assert dra.ATTR_CLIQUES not in d.attributes
    assert listed[0].attributes[dra.ATTR_CLIQUES] == ("0-3", "0,4")
    assert listed[5].attributes[dra.ATTR_CLIQUES] == ("4-7", "1,5")
    # unused partitions repeat partition 0
    assert scalar[0].attributes["nvlinkPartition2"] == scalar[0].attributes["nvlinkPartition0"] == "0-3"


def test_a_failed_gpu_is_in_no_clique() -> None:
    topo = build_system("dgx-h100")
    gpus = list(topo.gpus)
    gpus[3] = gpus[3].model_copy(update={"health": Health.FAILED})
    topo = topo.model_copy(update={"gpus": tuple(gpus)})
    enc = dra.encoding(topo)
    assert [dra.block_id(c) for c in enc.cliques] == ["0-2,4-7"]
    devs = dra.devices(topo, list_attributes=True)
    assert devs[3].failed and devs[3].attributes[dra.ATTR_CLIQUE_SIZE] == 0
    assert devs[3].attributes[dra.ATTR_CLIQUES] == ("3",)  # its own, matching nobody else's


@pytest.mark.parametrize(
    ("mask", "text"),
    [
        (mask_of([0, 1, 2, 3]), "0-3"),
        (mask_of([0, 4]), "0,4"),
        (mask_of([7]), "7"),
        (mask_of([0, 1, 3, 5, 6, 7]), "0-1,3,5-7"),
    ],
)
def test_block_ids_are_index_ranges(mask: int, text: str) -> None:
    assert dra.block_id(mask) == text


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("gpu-0", 0),
        ("gpu-15", 15),
        ("gpu-01", None),
        ("gpu-", None),
        ("nic-0", None),
        ("gpu-x", None),
        ("gpu-99999", None),
    ],
)
def test_device_names_map_back_to_indices_and_nothing_else(name: str, index: int | None) -> None:
    assert device_index(name) == index
    if index is not None:
        assert device_name(index) == name


def _slice(node: str, devices: list[str], driver: str = DRIVER) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": d} for d in devices],
        },
    }


def _claim(uid: str, results: list[tuple[str, str, str]], pods: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "namespace": "ns", "name": f"c-{uid}"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpus", "driver": d, "pool": p, "device": v} for d, p, v in results]
                }
            },
            "reservedFor": [{"resource": "pods", "name": f"p-{u}", "uid": u} for u in pods],
        },
    }


def test_slices_and_claims_give_each_node_its_claimed_gpus() -> None:
    slices = [parse_slice(_slice("a", ["gpu-0", "gpu-1", "gpu-5"])), parse_slice(_slice("b", ["gpu-0"]))]
    assert parse_slice(_slice("a", ["x"], driver="gpu.nvidia.com")) is None
    claims = [
        parse_claim(_claim("u1", [(DRIVER, "a", "gpu-0"), (DRIVER, "a", "gpu-1")], ["pod1"])),
        parse_claim(_claim("u2", [(DRIVER, "a", "gpu-5"), ("gpu.nvidia.com", "a", "gpu-7")], [])),
        parse_claim(_claim("u3", [], [])),
        parse_claim(_claim("u4", [(DRIVER, "gone", "gpu-3")], ["pod4"])),
    ]
    got = in_use_by_node(claims, [s for s in slices if s is not None], {"pod1": "ns", "pod4": "ns"}.get)
    assert got == {"a": GpusInUse(pods={"pod1": frozenset({0, 1})}, other=frozenset({5})), "b": GpusInUse()}
    assert claims[1] == ClaimInfo("u2", "ns", "c-u2", "a", frozenset({5}), frozenset())
    assert slices[1] == SliceInfo("b", "b", 1, frozenset({0}))


@pytest.mark.parametrize(
    ("obj", "kind", "message"),
    [
        ({"spec": {"driver": DRIVER, "pool": {"name": "a", "generation": 1}}}, "slice", "no spec.nodeName"),
        (_slice("a", ["gpu-01"]), "slice", "not a gputopo GPU"),
        (
            {"spec": {"driver": DRIVER, "nodeName": "a", "pool": {"name": "a", "generation": "1"}}},
            "slice",
            "integer generation",
        ),
        ({"spec": "x"}, "slice", "spec is not an object"),
        (_claim("u", [(DRIVER, "a", "nic-0")], []), "claim", "not a gputopo GPU"),
        (_claim("u", [(DRIVER, "a", "gpu-0"), (DRIVER, "b", "gpu-1")], []), "claim", "from 2 pools"),
        (
            {"metadata": {"name": "c"}, "status": {"allocation": {"devices": {"results": "x"}}}},
            "claim",
            "results is not a list",
        ),
        ({"metadata": {"name": "c", "uid": 3}}, "claim", "must be strings"),
    ],
)
def test_malformed_objects_are_refused_with_their_name(obj: dict[str, Any], kind: str, message: str) -> None:
    with pytest.raises(DraObjectError, match=message):
        (parse_slice if kind == "slice" else parse_claim)(obj)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@given(json_values, json_values)
@settings(max_examples=400, deadline=None)
def test_any_json_is_read_or_refused_never_a_crash(spec: Any, status: Any) -> None:
    for parse, obj in ((parse_slice, {"spec": spec}), (parse_claim, {"status": status, "metadata": spec})):
        with contextlib.suppress(DraObjectError):
            parse(obj)
