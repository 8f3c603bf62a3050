"""`taking`: a node's state with another set of GPUs in use, derived from a state already built, is the
state `node_state` builds from scratch (binds derive their node's new state this way)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import NodeState, node_state, taking
from gputopo.model import LABEL_NETWORK_LEAF, LABEL_RAILS
from gputopo.systems import SYSTEMS, build_system


def fields(state: NodeState) -> dict[str, object]:
    """Every field's value (states compare by identity)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


GPU_SETS = st.frozensets(st.integers(-2, 70), max_size=12)  # out-of-range indices included: ignored alike


@settings(max_examples=150, deadline=None)
@given(system=st.sampled_from(sorted(SYSTEMS)), before=GPU_SETS, after=GPU_SETS)
def test_taking_equals_building_afresh(system: str, before: frozenset[int], after: frozenset[int]) -> None:
    topo = build_system(system, "n1")
    labels = {LABEL_NETWORK_LEAF: "leaf-1"}
    base = node_state("n1", topo, labels=labels, in_use=before)
    assert fields(taking(base, after)) == fields(node_state("n1", topo, labels=labels, in_use=after))


@pytest.mark.parametrize(
    ("labels", "topology", "problem"),
    [
        ({}, None, None),  # no topology reported
        ({}, "dgx-h100", Reason.TOPOLOGY_STALE),  # a problem given by the caller
        ({LABEL_RAILS: "not-a-rail"}, "dgx-h100", None),  # a rails label that does not match: invalid
    ],
    ids=["missing", "stale", "invalid-rails-label"],
)
def test_taking_on_a_node_with_a_problem_equals_building_afresh(
    labels: dict[str, str], topology: str | None, problem: Reason | None
) -> None:
    topo = build_system(topology, "n1") if topology else None
    base = node_state("n1", topo, labels=labels, in_use=frozenset({0}), problem=problem)
    assert base.problem is not None
    after = frozenset({1, 2})
    assert fields(taking(base, after)) == fields(node_state("n1", topo, labels=labels, in_use=after, problem=problem))
