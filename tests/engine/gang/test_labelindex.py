"""The label index answers every nodeSelector as matching every node with `selects` does, through any sequence
of nodes coming, changing labels and going, and its kept answers never outlive a label change."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.gang.assigned import HOSTNAME, Selector, selects
from gputopo.engine.gang.labelindex import LabelIndex

KEYS = ["leaf", "rack", "zone", HOSTNAME]
VALUES = ["a", "b", "n0", "n1"]
NAMES = ["n0", "n1", "n2", "n3"]

labels_st = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=3)
selector_st = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=3).map(
    lambda d: tuple(sorted(d.items()))
)
Step = tuple[str, str, dict[str, str]]
step_st: st.SearchStrategy[Step] = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(NAMES), labels_st),
    st.tuples(st.just("drop"), st.sampled_from(NAMES), st.just({})),
    st.tuples(st.just("ask"), st.sampled_from(NAMES), st.just({})),
)


def _scan(nodes: dict[str, dict[str, str]], selector: Selector) -> frozenset[str]:
    return frozenset(n for n, labels in nodes.items() if selects(selector, n, labels))


@settings(max_examples=300, deadline=None)
@given(st.lists(step_st, max_size=30), st.lists(selector_st, min_size=1, max_size=6))
def test_the_index_equals_the_scan(steps: list[Step], selectors: list[Selector]) -> None:
    index, nodes = LabelIndex(), dict[str, dict[str, str]]()
    for kind, name, labels in steps:
        if kind == "put":
            index.put(name, labels)
            nodes[name] = labels
        elif kind == "drop":
            index.drop([name])
            nodes.pop(name, None)
        for sel in selectors:  # asked between every change: a kept answer must follow the change
            assert index.select(sel) == _scan(nodes, sel), (sel, nodes)
    assert len(index) == len(nodes)


@pytest.mark.parametrize(
    ("labels", "selector", "selected"),
    [
        pytest.param({}, (), {"n0"}, id="the-empty-selector-selects-every-node"),
        pytest.param({}, ((HOSTNAME, "n0"),), {"n0"}, id="a-hostname-selector-reads-the-name-without-the-label"),
        pytest.param({HOSTNAME: "h"}, ((HOSTNAME, "n0"),), set(), id="the-hostname-label-wins-over-the-name"),
        pytest.param({"leaf": "a"}, (("leaf", "a"), ("zone", "x")), set(), id="every-key-must-match"),
        pytest.param({"leaf": "a"}, (("absent", "x"),), set(), id="an-unknown-pair-selects-nothing"),
    ],
)
def test_selectors_read_labels_as_selects_does(labels: dict[str, str], selector: Selector, selected: set[str]) -> None:
    index = LabelIndex({"n0": labels})
    assert index.select(selector) == selected == _scan({"n0": labels}, selector)


def test_the_generation_moves_only_when_labels_change() -> None:
    index = LabelIndex({"n0": {"leaf": "a"}})
    before = index.generation
    index.put("n0", {"leaf": "a"})
    index.drop(["absent"])
    assert index.generation == before
    index.put("n0", {"leaf": "b"})
    assert index.generation == before + 1
