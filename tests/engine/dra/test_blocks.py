"""Clique blocks (gputopo/engine/dra/blocks.py): which blocks each named system publishes, the caps, and
best-fit order: a first-fit allocator over the published order, with counter accounting, gives a
k-block claim the best published block by the engine's rank (fragmentation first), never a block that
fragments more than the engine's own choice, and never a GPU twice, even when allocations race a
stale publication."""

from __future__ import annotations

import random
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.dra.blocks import block_devices, block_order, clique_blocks, first_free, node_blocks
from gputopo.engine.dra.devices import block_id
from gputopo.engine.node.blocks import MAX_BLOCKS, fit_key
from gputopo.engine.node.gpusets import choose_clique, rank_key
from gputopo.engine.state.cliques import bits, mask_of, popcount
from gputopo.engine.state.snapshot import shape_of
from gputopo.model import Health, NodeTopology
from gputopo.systems import build_system as _build
from tests.engine.dra.blocks_fixtures import nvswitch
from tests.engine.dra.test_clique_cap import mesh_minus_matching


@cache
def build_system(name: str) -> NodeTopology:
    return _build(name)


@pytest.mark.parametrize(
    ("system", "blocks"),
    [
        pytest.param("dgx-h100", ["0-7", "0-3", "4-7", "0-1", "2-3", "4-5", "6-7"], id="nvswitch-8-one-8-two-4-four-2"),
        pytest.param(
            "dgx-1v",
            ["0-3", "4-7", "0-1", "0,4", "1,5", "2-3", "2,6", "3,7", "4-5", "6-7"],
            id="dgx-1v-quads-their-pairs-and-cross-pairs",
        ),
        pytest.param("a100-pcie-bridged", ["0-1", "2-3", "4-5", "6-7"], id="nv12-bridged-pairs"),
        pytest.param("gb200-tray", ["0-3", "0-1", "2-3"], id="gb200-tray-one-4-two-2"),
        pytest.param("l40s-4", [], id="pcie-only-none"),
    ],
)
def test_each_system_publishes_its_cliques_and_aligned_sub_blocks(system: str, blocks: list[str]) -> None:
    assert [block_id(m) for m in node_blocks(build_system(system)).masks] == blocks


def test_a_clique_of_six_gives_its_aligned_4_and_three_2s_not_6() -> None:
    six = mask_of(list(range(6)))
    assert [bits(m) for m in clique_blocks(6, (six,)).masks] == [[0, 1, 2, 3], [0, 1], [2, 3], [4, 5]]


def test_a_failed_gpu_is_in_no_block() -> None:
    topo = build_system("dgx-h100")
    broken = topo.model_copy(
        update={"gpus": tuple(g.model_copy(update={"health": Health.FAILED}) if g.index == 3 else g for g in topo.gpus)}
    )
    assert all(not m >> 3 & 1 for m in node_blocks(broken).masks)


@pytest.mark.parametrize(
    ("topo", "count", "left_out", "why"),
    [
        pytest.param(nvswitch(32), 30, 0, "", id="32-gpus-16s-8s-4s-2s"),
        pytest.param(nvswitch(33), 0, 0, "33 GPUs", id="past-32-gpus-none-one-counter-set"),
        pytest.param(mesh_minus_matching(32), MAX_BLOCKS, 1, "", id="many-cliques-capped-smallest-left-out"),
    ],
)
def test_blocks_stay_within_the_api_limits(topo: NodeTopology, count: int, left_out: int, why: str) -> None:
    found = node_blocks(topo)
    assert len(found.masks) == count
    assert (len(found.left_out) >= left_out) and (left_out or not found.left_out)
    assert why in found.none_because
    sizes = [popcount(m) for m in found.masks]
    assert sizes == sorted(sizes, reverse=True)  # the largest are kept
    assert all(popcount(m) <= min(popcount(x) for x in found.masks) for m in found.left_out)


def test_a_block_device_counts_memory_per_gpu_and_takes_the_worst_health() -> None:
    topo = build_system("dgx-h100")
    degraded = topo.model_copy(
        update={
            "gpus": tuple(g.model_copy(update={"health": Health.DEGRADED}) if g.index == 1 else g for g in topo.gpus)
        }
    )
    by_name = {d.name: d for d in block_devices(degraded)}
    pair = by_name["block-0-1"]
    assert pair.gpus == (0, 1) and pair.memory_mib == 2 * topo.gpus[0].memory_mib
    assert pair.attributes["blockSize"] == 2 and pair.attributes["gpus"] == "0-1"
    assert pair.attributes["health"] == "degraded" and pair.attributes["nvlinkImpaired"] is True
    assert by_name["block-2-3"].attributes["health"] == "ok"
    assert by_name["block-0-1-2-3-4-5-6-7"].attributes["nvlinkCliqueSize"] == 8


SYSTEMS = ("dgx-h100", "dgx-1v", "a100-pcie-bridged", "gb200-tray", "hgx-a100-4", "dgx-a100")


@st.composite
def _states(draw: st.DrawFn) -> tuple[str, frozenset[int], int]:
    system = draw(st.sampled_from(SYSTEMS))
    n = len(build_system(system).gpus)
    in_use = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
    k = draw(st.sampled_from([s for s in (2, 4, 8) if s <= n]))
    return system, in_use, k


def _order(topo: NodeTopology, in_use: frozenset[int]) -> tuple[int, ...]:
    usable = mask_of([g.index for g in topo.gpus])
    return block_order(shape_of(topo), node_blocks(topo).masks, usable, mask_of(sorted(in_use)))


@settings(max_examples=200, deadline=None)
@given(_states())
def test_first_free_block_in_published_order_is_the_best_fit_published_block(
    state: tuple[str, frozenset[int], int],
) -> None:
    system, in_use, k = state
    topo = build_system(system)
    shape = shape_of(topo)
    free = mask_of([g.index for g in topo.gpus if g.index not in in_use])
    got = first_free(_order(topo, in_use), k, mask_of(sorted(in_use)))
    takeable = [m for m in node_blocks(topo).masks if popcount(m) == k and m & free == m]
    if not takeable:
        assert got is None
        return
    assert got is not None
    assert fit_key(shape, free, got) == max(fit_key(shape, free, m) for m in takeable)
    # Never more fragmentation than the engine's own choice where that is a published block: the
    # largest clique and the NVLink pairs left free are at least as large.
    engine = choose_clique(shape, free, k)
    if engine is not None and engine.gpus is not None and mask_of(list(engine.gpus)) in takeable:
        ours = rank_key("clique", shape, free, got, 0)[1:3]
        assert ours >= rank_key("clique", shape, free, mask_of(list(engine.gpus)), 0)[1:3]


def _allocate(order: tuple[int, ...], singles: tuple[int, ...], k: int, taken: int) -> int | None:
    """A first-fit allocator with counter accounting: a single GPU or a block is free when none of its
    counters is consumed; the claim consumes them all."""
    if k == 1:
        return next((1 << g for g in singles if not taken >> g & 1), None)
    return first_free(order, k, taken)


@pytest.mark.parametrize("system", SYSTEMS)
def test_allocations_racing_a_stale_publication_never_share_a_gpu(system: str) -> None:
    topo = build_system(system)
    n = len(topo.gpus)
    rng = random.Random(system)
    for _ in range(200):
        held: list[int] = []
        published_with = frozenset[int]()
        order = _order(topo, published_with)
        for _step in range(rng.randint(1, 12)):
            if held and rng.random() < 0.3:
                held.pop(rng.randrange(len(held)))
            taken = sum(held)
            if rng.random() < 0.3:  # the agent re-publishes; otherwise the allocator reads the stale order
                published_with = frozenset(bits(taken))
                order = _order(topo, published_with)
            got = _allocate(order, tuple(range(n)), rng.choice([1, 2, 4, 8]), taken)
            if got is not None:
                assert not got & taken, "a GPU allocated twice"
                held.append(got)
        assert popcount(sum(held)) == sum(popcount(h) for h in held)
