"""Best-fit order for DRA (gputopo/engine/dra/order.py): the allocator's first fit over the published order
is the engine's best choice among the sets the claim can match, on random node states; and a slice
published before allocations it does not know of (re-publication racing allocation) costs only
optimality: no GPU is allocated twice, and every clique claim still gets GPUs that are one clique."""

from __future__ import annotations

import random
from functools import cache
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.dra.devices import device_name, devices, encoding
from gputopo.engine.node.gpusets import choose_clique, rank_key
from gputopo.engine.state.cliques import mask_of
from gputopo.engine.state.snapshot import shape_of
from gputopo.model import Health, NodeTopology
from gputopo.sim.draallocator import allocate, list_claim, partition_claim, unconstrained_claim
from gputopo.systems import build_system as _build


@cache
def build_system(name: str) -> NodeTopology:
    return _build(name)  # one topology per system: the encodings and orders memoise on it


# The named systems with one partition holding every maximal clique (NVSwitch, bridged pairs, trays),
# and DGX-1V, whose cross-quad pairs need a second partition.
ONE_PARTITION = ("dgx-h100", "dgx-a100", "hgx-a100-4", "a100-pcie-bridged", "gb200-tray")
SYSTEMS = (*ONE_PARTITION, "dgx-1v")


def _claim(k: int):  # type: ignore[no-untyped-def]
    return unconstrained_claim(1) if k == 1 else partition_claim(k)


def _claimable_best(system: str, in_use: frozenset[int], k: int) -> int | None:
    """The engine's best k-set (rank_key, no NIC) among those the partition claim can match: inside one
    block of the first partition that has a block with k free GPUs."""
    topo = build_system(system)
    shape = shape_of(topo)
    free = mask_of([g.index for g in topo.gpus if g.index not in in_use])
    if k == 1:
        sets = [1 << g for g in range(len(topo.gpus)) if free >> g & 1]
    else:
        sets = []
        for part in encoding(topo).partitions:
            for block in set(part):
                inside = [g for g in range(len(topo.gpus)) if (block & free) >> g & 1]
                sets += [mask_of(list(c)) for c in combinations(inside, k)]
            if sets:
                break
    if not sets:
        return None
    return max(sets, key=lambda s: rank_key("clique", shape, free, s, 0)[1:3])


def _first_fit(system: str, published_with: frozenset[int], in_use: frozenset[int], k: int) -> tuple[int, ...] | None:
    topo = build_system(system)
    devs = devices(topo, list_attributes=False, in_use=published_with)
    got = allocate(devs, _claim(k), [device_name(i) for i in sorted(in_use)])
    return got.gpus if got is not None else None


@st.composite
def _states(draw: st.DrawFn) -> tuple[str, frozenset[int], int]:
    system = draw(st.sampled_from(SYSTEMS))
    n = len(build_system(system).gpus)
    in_use = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
    k = draw(st.integers(1, n - len(in_use)))
    return system, in_use, k


@settings(max_examples=200, deadline=None)
@given(_states())
def test_first_fit_over_the_published_order_is_the_engines_best_claimable_choice(
    state: tuple[str, frozenset[int], int],
) -> None:
    system, in_use, k = state
    got = _first_fit(system, in_use, in_use, k)
    best = _claimable_best(system, in_use, k)
    assert (got is None) == (best is None)
    if got is None or best is None:
        return
    shape = shape_of(build_system(system))
    free = mask_of([g for g in range(shape.n) if g not in in_use])
    # Equal on the engine's fragmentation terms: the largest clique and the NVLink pairs left free.
    assert rank_key("clique", shape, free, mask_of(list(got)), 0)[1:3] == rank_key("clique", shape, free, best, 0)[1:3]


@settings(max_examples=150, deadline=None)
@given(_states())
def test_with_the_list_attribute_first_fit_is_best_fit_over_every_clique(
    state: tuple[str, frozenset[int], int],
) -> None:
    """A list claim (one maximal clique in common, KEP-5491) can match every clique, DGX-1V's cross-quad
    pairs included: first fit over the order is then the best of all of them on the engine's
    fragmentation terms (the largest clique and the NVLink pairs left free)."""
    system, in_use, k = state
    if k < 2:
        return
    topo = build_system(system)
    shape = shape_of(topo)
    free_gpus = [g for g in range(shape.n) if g not in in_use]
    free = mask_of(free_gpus)
    cliques = [
        mask_of(list(c))
        for c in combinations(free_gpus, k)
        if all(shape.adj[a] >> b & 1 for a, b in combinations(c, 2))
    ]
    devs = devices(topo, list_attributes=True, in_use=in_use)
    got = allocate(devs, list_claim(k), [device_name(g) for g in sorted(in_use)])
    assert (got is None) == (not cliques)
    if got is not None:
        best = max(rank_key("clique", shape, free, c, 0)[1:3] for c in cliques)
        assert rank_key("clique", shape, free, mask_of(list(got.gpus)), 0)[1:3] == best


@pytest.mark.parametrize("system", ONE_PARTITION)
def test_on_one_partition_systems_first_fit_matches_the_engines_own_clique_choice(system: str) -> None:
    rng = random.Random(43)
    topo = build_system(system)
    shape = shape_of(topo)
    n = len(topo.gpus)
    for _ in range(60):
        in_use = frozenset(rng.sample(range(n), rng.randrange(n)))
        free = mask_of([g for g in range(n) if g not in in_use])
        for k in range(2, n - len(in_use) + 1):
            engine = choose_clique(shape, free, k)
            got = _first_fit(system, in_use, in_use, k)
            assert (engine is None) == (got is None), (in_use, k)
            if engine is not None and got is not None:
                want = rank_key("clique", shape, free, mask_of(list(engine.gpus)), 0)[:3]
                assert rank_key("clique", shape, free, mask_of(list(got)), 0)[:3] == want, (in_use, k)


@pytest.mark.parametrize(
    ("system", "in_use", "k", "expected"),
    [
        pytest.param("dgx-1v", {4, 5}, 2, (6, 7), id="DGX-1V, 4-5 busy: a pair takes 6-7, the whole quad 0-3 stays"),
        pytest.param("dgx-1v", {0, 1, 4, 5}, 2, (2, 3), id="DGX-1V, two half quads: a pair fills the first"),
        pytest.param("dgx-1v", {4}, 4, (0, 1, 2, 3), id="DGX-1V, one GPU busy: four take the whole free quad"),
        pytest.param("a100-pcie-bridged", {2}, 1, (3,), id="bridged pairs: one GPU takes the broken pair's"),
        pytest.param("dgx-h100", {0}, 1, (1,), id="NVSwitch: one block, the lowest free GPU"),
    ],
)
def test_named_states_get_the_best_fit(system: str, in_use: set[int], k: int, expected: tuple[int, ...]) -> None:
    assert _first_fit(system, frozenset(in_use), frozenset(in_use), k) == expected


def test_stock_index_order_breaks_the_whole_quad_where_best_fit_does_not() -> None:
    # The run: {0,1}, {2,3}, {4,5} taken, the first two released: index order takes {0,1}.
    topo = build_system("dgx-1v")
    stock = allocate(devices(topo, list_attributes=False), partition_claim(2), ["gpu-4", "gpu-5"])
    assert stock is not None and stock.gpus == (0, 1)
    assert _first_fit("dgx-1v", frozenset({4, 5}), frozenset({4, 5}), 2) == (6, 7)


def test_every_gpu_is_published_once_and_a_failed_one_is_never_first_fit() -> None:
    topo = build_system("dgx-h100")
    failed = topo.gpus[2].model_copy(update={"health": Health.FAILED})
    topo = topo.model_copy(update={"gpus": (*topo.gpus[:2], failed, *topo.gpus[3:])})
    devs = devices(topo, list_attributes=False, in_use=frozenset({5}))
    assert sorted(d.index for d in devs) == list(range(8))
    got = allocate(devs, unconstrained_claim(1), ["gpu-5"])
    assert got is not None and got.gpus != (2,)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SYSTEMS), st.randoms(use_true_random=False))
def test_allocations_racing_republication_never_double_allocate_nor_break_a_clique(
    system: str, rng: random.Random
) -> None:
    """Claims come and go while the slice is re-published only now and then: each allocation reads
    whatever order was published last (stale by several allocations), as the allocator may."""
    topo = build_system(system)
    n = len(topo.gpus)
    adj = shape_of(topo).adj
    held: dict[int, tuple[int, ...]] = {}
    published = frozenset[int]()
    for step in range(60):
        in_use = frozenset(g for gs in held.values() for g in gs)
        if rng.random() < 0.3:
            published = in_use  # the driver re-publishes after some changes, not all
        if held and rng.random() < 0.4:
            del held[rng.choice(sorted(held))]
            continue
        k = rng.randint(1, max(1, n // 2))
        got = _first_fit(system, published, in_use, k)
        if got is None:
            continue
        assert not set(got) & in_use, f"GPUs {set(got) & in_use} allocated twice"
        assert len(got) == k
        assert all(adj[a] >> b & 1 for a, b in combinations(got, 2)), f"{got} is no clique"
        held[step] = got
