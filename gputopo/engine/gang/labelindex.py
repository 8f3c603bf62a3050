"""Nodes by label, for nodeSelectors: which nodes a selector selects, without matching every node.

A group's members may carry nodeSelectors (Kueue's topology assignment, or any a tenant writes); planning
the group needs the nodes each distinct selector selects. Matched node by node that cost nodes x selectors
per plan: 4,095 members with distinct selectors at 5,000 nodes made 20 million matches. Here each
(key, value) pair names its nodes, a selector is the intersection of its pairs' nodes (the smallest
first), and each distinct selector's answer is kept until a node's labels change (`generation`).

The same rule as `gputopo.engine.gang.assigned.selects`: every key equal, and the hostname key, where a node's
labels lack it, is the node's name. Pure: the caller feeds it the nodes' labels as they change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gputopo.engine.gang.assigned import HOSTNAME, Selector

# Distinct selectors answered at once (any tenant can post pods with new ones): the oldest answer goes
# first; an answer dropped is only computed again.
SELECTORS_KEPT = 8192
_NONE: frozenset[str] = frozenset()


class LabelIndex:
    """The nodes of each label pair, and the nodes each selector asked of it selects (as of `generation`)."""

    def __init__(self, nodes: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self._labels: dict[str, tuple[tuple[str, str], ...]] = {}
        self._by_pair: dict[tuple[str, str], set[str]] = {}
        self._answers: dict[Selector, frozenset[str]] = {}
        self._every: frozenset[str] | None = None
        self.generation = 0  # moves whenever a node comes, goes or changes labels
        for name, labels in (nodes or {}).items():
            self.put(name, labels)

    def __len__(self) -> int:
        return len(self._labels)

    def put(self, name: str, labels: Mapping[str, str]) -> None:
        """Index node `name` with `labels` (replacing what it had)."""
        pairs = tuple(sorted(labels.items()))
        if HOSTNAME not in labels:
            pairs = (*pairs, (HOSTNAME, name))  # `selects` reads the name where the label is missing
        if self._labels.get(name) == pairs:
            return
        self._remove(name)
        self._labels[name] = pairs
        for pair in pairs:
            self._by_pair.setdefault(pair, set()).add(name)
        self._moved()

    def drop(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self._labels:
                self._remove(name)
                self._moved()

    def select(self, selector: Selector) -> frozenset[str]:
        """The nodes `selector` selects (every node for the empty selector)."""
        found = self._answers.get(selector)
        if found is not None:
            return found
        if not selector:
            if self._every is None:
                self._every = frozenset(self._labels)
            return self._every
        sets = sorted((self._by_pair.get(pair, _NONE) for pair in selector), key=len)
        found = frozenset(sets[0]).intersection(*sets[1:]) if sets[0] else _NONE
        answers = self._answers
        if len(answers) >= SELECTORS_KEPT:
            del answers[next(iter(answers))]
        answers[selector] = found
        return found

    def _remove(self, name: str) -> None:
        for pair in self._labels.pop(name, ()):
            names = self._by_pair.get(pair)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_pair[pair]

    def _moved(self) -> None:
        self.generation += 1
        self._answers.clear()
        self._every = None
