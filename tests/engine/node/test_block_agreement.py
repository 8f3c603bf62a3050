"""The block a pod asking `gputopo.io/gpu-clique<N>: 1` is expected to get (gputopo.engine.node.blocks, the
extender's filter and sentence) is the block the agent lists first among the free ones of that size
(gputopo.engine.dra.blocks, the allocator's first fit), over random node states: node choice and device
choice agree. Skipped where the agent's block module is not there."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.node.blocks import first_fit_block, published_blocks
from gputopo.engine.state.cliques import mask_of
from gputopo.engine.state.snapshot import node_state, shape_of
from gputopo.model.dra import BLOCK_SIZES
from gputopo.systems import build_system

agent_blocks = pytest.importorskip("gputopo.engine.dra.blocks")

SYSTEMS = ("dgx-1v", "dgx-h100", "dgx-a100", "hgx-a100-4", "a100-pcie-bridged", "gb200-tray")


@settings(max_examples=300, deadline=None)
@given(system=st.sampled_from(SYSTEMS), busy=st.sets(st.integers(0, 7)), size=st.sampled_from(BLOCK_SIZES))
def test_the_extenders_block_is_the_agents_first_free_block(system: str, busy: set[int], size: int) -> None:
    topology = build_system(system, "n")
    n = len(topology.gpus)
    in_use = frozenset(g for g in busy if g < n)
    state = node_state("n", topology, in_use=in_use)
    assert state.shape is not None
    usable = state.all_mask & ~state.failed_mask
    published = agent_blocks.node_blocks(topology).masks
    assert sorted(published_blocks(state.shape, usable, size)) == sorted(m for m in published if m.bit_count() == size)
    order = agent_blocks.block_order(shape_of(topology), published, usable, mask_of(sorted(in_use)))
    expected = agent_blocks.first_free(order, size, mask_of(sorted(in_use)))
    assert first_fit_block(state.shape, usable, usable & ~state.in_use_mask, size) == expected
