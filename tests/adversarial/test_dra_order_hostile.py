"""Best-fit order against a node wired to defeat it (gputopo/engine/dra/order.py, "The bound"). The agent
orders its own GPUs on every re-publish after an allocation (`--dra-best-fit-order`), and each rank in the
nesting asks for the largest clique left among the free GPUs: on 32 GPUs each linked to all but its
partner, with uneven link counts, the unbounded nesting took tens of seconds an order. Bounds: one order
spends at most `ORDER_BUDGET` work units (a rank, a branch step of its clique search), counted here at the
two calls that do the work, not read from the order; past the budget the order still lists every GPU
once, and the allocator's first fit over it still gives every claim one NVLink clique; the named systems
spend under a tenth of the budget and are never capped."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import pytest

from gputopo.engine.dra import order as order_module
from gputopo.engine.dra.devices import best_fit, device_name, devices, encoding
from gputopo.engine.dra.order import ORDER_BUDGET, bounded_order
from gputopo.engine.node.gpusets import rank_key
from gputopo.engine.state.cliques import mask_of, max_clique_within
from gputopo.engine.state.snapshot import shape_of
from gputopo.model import NodeTopology
from gputopo.sim.draallocator import allocate, partition_claim
from gputopo.systems import build_system
from tests.engine.dra.order_fixtures import mesh_minus_matching


@dataclass
class Work:
    ranks: int = 0
    steps: int = 0

    @property
    def units(self) -> int:
        return self.ranks + self.steps


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[Work]:
    """The work the order module does, counted where it is done; its memo cleared, so nothing is answered
    from an earlier order."""
    count = Work()
    search, rank = max_clique_within, rank_key  # what the order module calls, before it is counted

    def counted_search(adj: tuple[int, ...], mask: int, limit: int | None) -> tuple[int | None, int]:
        size, steps = search(adj, mask, limit)
        # Past `limit` the search stops before the step it counts: `limit` steps were taken.
        count.steps += steps if limit is None else min(steps, limit)
        return size, steps

    def counted_rank(*args: Any, **kwargs: Any) -> tuple[int, ...]:
        count.ranks += 1
        return rank(*args, **kwargs)

    monkeypatch.setattr(order_module, "max_clique_within", counted_search)
    monkeypatch.setattr(order_module, "rank_key", counted_rank)
    bounded_order.cache_clear()
    yield count
    bounded_order.cache_clear()


def _is_clique(topo: NodeTopology, gpus: tuple[int, ...]) -> bool:
    adj = shape_of(topo).adj
    return all(adj[a] >> b & 1 for a, b in combinations(gpus, 2))


HOSTILE = [
    pytest.param(mesh_minus_matching(32), frozenset(), id="32-gpus-uneven-links-nothing-in-use"),
    pytest.param(mesh_minus_matching(32), frozenset({0, 3, 6}), id="32-gpus-uneven-links-three-in-use"),
    pytest.param(mesh_minus_matching(32, uneven=False), frozenset(), id="32-gpus-nv2-nothing-in-use"),
    pytest.param(mesh_minus_matching(24), frozenset({1}), id="24-gpus-uneven-links-one-in-use"),
]


@pytest.mark.parametrize(("topo", "in_use"), HOSTILE)
def test_an_order_on_hostile_wiring_stops_at_its_budget_and_lists_every_gpu_once(
    work: Work, topo: NodeTopology, in_use: frozenset[int]
) -> None:
    got = best_fit(topo, in_use)
    assert got.capped
    assert work.units <= ORDER_BUDGET
    assert got.work == work.units  # what the order reports is what was done
    assert sorted(got.gpus) == list(range(len(topo.gpus)))
    assert [d.index for d in devices(topo, list_attributes=False, in_use=in_use)] == list(got.gpus)


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_first_fit_over_a_capped_order_still_gives_one_clique(work: Work, k: int) -> None:
    topo = mesh_minus_matching(32)
    in_use = frozenset({0, 3, 6})
    published = devices(topo, list_attributes=False, in_use=in_use)
    assert work.units <= ORDER_BUDGET
    got = allocate(published, partition_claim(k), [device_name(g) for g in sorted(in_use)])
    assert got is not None and len(got.gpus) == k
    assert _is_clique(topo, got.gpus) and not set(got.gpus) & in_use


NAMED = ("dgx-1v", "dgx-h100", "dgx-a100", "hgx-a100-4", "a100-pcie-bridged", "a100-pcie-bridged-nonadjacent")


@pytest.mark.parametrize("system", NAMED)
def test_the_named_systems_spend_a_tenth_of_the_budget_and_are_never_capped(work: Work, system: str) -> None:
    topo = build_system(system)
    n = len(topo.gpus)
    rng = random.Random(0)
    states = [frozenset(), *(frozenset(rng.sample(range(n), rng.randrange(n))) for _ in range(40))]
    most = 0
    for in_use in states:
        before = work.units
        got = best_fit(topo, in_use)
        assert not got.capped
        most = max(most, work.units - before)
    assert most <= ORDER_BUDGET // 10


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        # DGX-1V with nothing in use: the first quad, an NV2 pair first, then the second the same way.
        pytest.param(10**6, (0, 3, 2, 1, 4, 7, 6, 5), id="room-the-order-as-ever"),
        # No work at all: every block's free GPUs by index, the blocks still by how few are free.
        pytest.param(0, (0, 1, 2, 3, 4, 5, 6, 7), id="none-every-block-by-index"),
    ],
)
def test_past_the_budget_blocks_keep_their_order_and_list_their_gpus_by_index(
    work: Work, budget: int, expected: tuple[int, ...]
) -> None:
    topo = build_system("dgx-1v")
    got = bounded_order(shape_of(topo), encoding(topo).partitions[0], mask_of(list(range(8))), 0, budget)
    assert got.gpus == expected
    assert got.capped == (budget == 0)
    assert work.units <= budget
