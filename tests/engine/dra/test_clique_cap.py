"""The clique enumeration's cap (security issue L10): a graph with exponentially many maximal cliques is
encoded under the cap, every published block still a clique; an unchanged topology is not enumerated
again; a clique id never outgrows an attribute value."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.dra import devices as dra
from gputopo.engine.state.cliques import bits, capped_cliques, maximal_cliques, popcount
from gputopo.model import NodeTopology
from gputopo.systems import build_system


def mesh_minus_matching(n: int) -> NodeTopology:
    """`n` GPUs each NVLinked to all but its partner (2k, 2k+1): 2^(n/2) maximal cliques of n/2."""
    base = build_system("dgx-h100", "node-a")
    gpu = base.gpus[0]
    gpus = tuple(gpu.model_copy(update={"index": i, "uuid": f"GPU-{i:04d}", "pci_bus_id": ""}) for i in range(n))
    links = tuple(tuple(0 if j in (i, i ^ 1) else 2 for j in range(n)) for i in range(n))
    nvlink = base.nvlink.model_copy(update={"links": links})
    return base.model_copy(update={"gpus": gpus, "nvlink": nvlink, "nics": (), "degraded_links": ()})


def _adjacency(topo: NodeTopology) -> tuple[int, ...]:
    links = topo.nvlink.links
    return tuple(sum(1 << j for j, v in enumerate(row) if v) for row in links)


def _is_clique(adj: tuple[int, ...], mask: int) -> bool:
    return all(adj[a] >> b & 1 for a, b in combinations(bits(mask), 2))


def _assert_sound(adj: tuple[int, ...], usable: int, enc: dra.Encoding) -> None:
    """Every block a claim could match on is fully connected, and every usable GPU is in one."""
    assert all(c & ~usable == 0 and _is_clique(adj, c) for c in enc.cliques)
    for part in enc.partitions:
        for gpu, block in enumerate(part):
            assert block >> gpu & 1 and _is_clique(adj, block)
    covered = 0
    for c in enc.cliques:
        covered |= c
    assert covered == usable


@pytest.fixture
def fresh_memo() -> Iterator[None]:
    dra.encode.cache_clear()
    yield
    dra.encode.cache_clear()


@pytest.mark.usefixtures("fresh_memo")
def test_a_32_gpu_mesh_minus_a_matching_is_encoded_under_the_cap() -> None:
    topo = mesh_minus_matching(32)
    enc = dra.encoding(topo)
    assert enc.capped
    assert len(enc.cliques) <= dra.MAX_CLIQUES
    adj = _adjacency(topo)
    _assert_sound(adj, (1 << 32) - 1, enc)
    assert max(popcount(c) for c in enc.cliques) == 16  # the greedy cover finds a largest one here
    devices = dra.devices(topo, list_attributes=True)
    assert all(len(d.attributes[dra.ATTR_CLIQUES]) <= dra.MAX_CLIQUES for d in devices)  # type: ignore[arg-type]
    assert all(d.attributes[dra.ATTR_CLIQUE_SIZE] == 16 for d in devices)
    size = len(json.dumps([dict(d.attributes) for d in devices]))
    assert size < 256 * 1024  # was 47 MiB: every GPU listed 32,768 clique ids


def test_named_systems_are_not_capped() -> None:
    for system in ("dgx-1v", "dgx-h100", "a100-pcie-bridged", "l40s-4"):
        assert not dra.encoding(build_system(system)).capped


@st.composite
def dense_graphs(draw: st.DrawFn) -> tuple[int, tuple[int, ...], int]:
    n = draw(st.integers(2, 40))
    p = draw(st.sampled_from([0.5, 0.8, 0.95]))
    rnd = draw(st.randoms(use_true_random=False))
    adj = [0] * n
    for a, b in combinations(range(n), 2):
        if rnd.random() < p:
            adj[a] |= 1 << b
            adj[b] |= 1 << a
    usable = draw(st.integers(0, (1 << n) - 1))
    return n, tuple(adj), usable


@settings(max_examples=150, deadline=None)
@given(graph=dense_graphs(), cap=st.integers(1, 8), steps=st.integers(1, 400))
def test_a_capped_encoding_publishes_only_cliques_and_covers_every_gpu(
    graph: tuple[int, tuple[int, ...], int], cap: int, steps: int
) -> None:
    n, adj, usable = graph
    saved = dra.MAX_CLIQUES, dra.MAX_CLIQUE_STEPS
    dra.MAX_CLIQUES, dra.MAX_CLIQUE_STEPS = cap, steps
    try:
        dra.encode.cache_clear()
        enc = dra.encode(n, adj, usable)
    finally:
        dra.MAX_CLIQUES, dra.MAX_CLIQUE_STEPS = saved
        dra.encode.cache_clear()
    _assert_sound(adj, usable, enc)
    if enc.capped:
        assert len(enc.cliques) <= max(cap, len(dra.greedy_cover(adj, usable)))
    else:
        assert enc.cliques == tuple(maximal_cliques(adj, usable))


@pytest.mark.usefixtures("fresh_memo")
def test_an_unchanged_topology_is_not_enumerated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = capped_cliques

    def counting(*args: Any, **kwargs: Any) -> tuple[list[int], bool]:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(dra, "capped_cliques", counting)
    topo = mesh_minus_matching(32)
    first = dra.devices(topo, list_attributes=True)
    again = dra.devices(topo.model_copy(deep=True), list_attributes=True)  # equal content, another object
    assert again == first and len(calls) == 1
    dra.devices(build_system("dgx-1v", "node-a"), list_attributes=True)
    assert len(calls) == 2  # another topology is enumerated


def test_a_clique_id_past_an_attribute_values_length_is_its_mask() -> None:
    evens = sum(1 << i for i in range(0, 64, 2))
    odds_but_last = sum(1 << i for i in range(1, 62, 2))
    assert dra.block_id(evens) == "mask-5555555555555555"
    assert len(dra.block_id(odds_but_last)) <= dra.MAX_ID_CHARS
    assert dra.block_id(evens) != dra.block_id(evens & ~(1 << 62))  # a truncated list would tie these
    assert dra.block_id(0b1111) == "0-3"
