"""Exact clique search over GPU bitmasks."""

from __future__ import annotations

from itertools import combinations

import pytest

from gputopo.engine.state.cliques import bits, k_cliques, mask_of, max_clique_size
from gputopo.engine.state.snapshot import shape_of
from gputopo.systems import build_system


def brute_force_cliques(adj: tuple[int, ...], candidates: int, k: int) -> set[int]:
    out = set()
    for combo in combinations(bits(candidates), k):
        if all(adj[a] >> b & 1 for a, b in combinations(combo, 2)):
            out.add(mask_of(combo))
    return out


@pytest.mark.parametrize(
    "system", ["dgx-1v", "dgx-h100", "a100-pcie-bridged", "a100-pcie-bridged-nonadjacent", "l40s-4"]
)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("taken", [frozenset(), frozenset({0}), frozenset({1, 6})])
def test_k_cliques_matches_brute_force(system: str, k: int, taken: frozenset[int]) -> None:
    shape = shape_of(build_system(system))
    cand = ((1 << shape.n) - 1) & ~mask_of(list(taken))
    assert set(k_cliques(shape.adj, cand, k)) == brute_force_cliques(shape.adj, cand, k)


@pytest.mark.parametrize(
    ("system", "taken", "expected"),
    [
        pytest.param("dgx-1v", (), 4, id="dgx1v-quads"),
        pytest.param("dgx-1v", (0,), 4, id="dgx1v-one-quad-left-whole"),
        pytest.param("dgx-1v", (0, 4), 3, id="dgx1v-both-quads-broken"),
        pytest.param("dgx-h100", (), 8, id="nvswitch-all"),
        pytest.param("dgx-h100", (0, 1, 2), 5, id="nvswitch-rest"),
        pytest.param("a100-pcie-bridged", (), 2, id="bridged-pairs"),
        pytest.param("l40s-4", (), 1, id="pcie-only"),
    ],
)
def test_max_clique_size(system: str, taken: tuple[int, ...], expected: int) -> None:
    shape = shape_of(build_system(system))
    assert max_clique_size(shape.adj, ((1 << shape.n) - 1) & ~mask_of(list(taken))) == expected


def test_dgx1v_has_exactly_two_four_cliques() -> None:
    shape = shape_of(build_system("dgx-1v"))
    found = [tuple(bits(m)) for m in k_cliques(shape.adj, 0xFF, 4)]
    assert found == [(0, 1, 2, 3), (4, 5, 6, 7)]
