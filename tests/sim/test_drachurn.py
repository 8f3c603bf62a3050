"""Claims with departures under DRA (gputopo/sim/drachurn.py): on the issue's DGX-1V sequence the stock
index order breaks the whole free quad where best-fit order and the device plugin keep it, and every
mode keeps claims on one clique, holds no GPU twice, and frees what leaves."""

from __future__ import annotations

import pytest

from gputopo.engine.state.snapshot import node_state
from gputopo.sim.drachurn import MODES, Arrival, Mode, simulate_churn
from gputopo.systems import build_system

# Three 2-GPU claims take {0,1}, {2,3}, {4,5}; the first two leave; a fourth 2-GPU claim arrives, then a
# 4-GPU claim that needs a whole quad (the issue's run on 1.37.2's real allocator).
SEQUENCE = [Arrival(2, 3), Arrival(2, 2), Arrival(2, 100), Arrival(2, 100), Arrival(4, 100)]


@pytest.mark.parametrize(
    ("mode", "quad_left"),
    [
        pytest.param("device-plugin", True, id="device plugin: the pair fills 6-7, the 4-GPU claim gets 0-3"),
        pytest.param("dra-stock", False, id="DRA index order: the pair takes 0-1, no whole quad is left"),
        pytest.param("dra-best-fit", True, id="DRA best-fit order: the pair fills 6-7, the 4-GPU claim gets 0-3"),
        pytest.param("dra-blocks", True, id="DRA clique blocks: pair blocks inside one quad, then the quad block"),
    ],
)
def test_the_issues_dgx1v_sequence(mode: Mode, quad_left: bool) -> None:
    nodes = [node_state("dgx1", build_system("dgx-1v"))]
    f = simulate_churn(nodes, SEQUENCE, mode)
    assert f.arrivals == 5
    # The last claim: on one clique where a whole quad was left, else refused a clique (it still fits
    # on 4 free GPUs that are no clique: nvlink preferred).
    assert f.clique_refused == (0 if quad_left else 1)
    assert f.multi_on_clique == f.multi_placed_could


@pytest.mark.parametrize("mode", MODES)
def test_a_long_churn_frees_everything_that_leaves(mode: Mode) -> None:
    nodes = [node_state(f"n{i}", build_system("dgx-1v")) for i in range(2)]
    arrivals = [Arrival(k, 3.5) for k in [1, 2, 4, 2, 1, 8, 2, 4] * 20]
    f = simulate_churn(nodes, arrivals, mode)
    assert f.arrivals == len(arrivals)
    assert f.unplaced < len(arrivals)  # departures free GPUs: later claims are placed
    assert f.multi_on_clique == f.multi_placed_could
