"""The ledger's memo of one request's verdicts by node kind (`Verdicts`) and each requested node's kind beside
them (`Kinds`): a filter over thousands of nodes evaluates each kind of node once and splits the nodes by set
operations over kinds; and the service's `Decision` for one pod, its per-node outcomes."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from gputopo.engine.node.placement import Outcome
from gputopo.engine.state.reasons import Code
from gputopo.model import PodRequest


class Verdicts(dict[int, Outcome]):
    """The memoised outcome of each node kind for one request, and the kinds that fit (`passing`), kept as
    outcomes are added: a filter over thousands of nodes splits them by set operations over kinds, without
    reading an outcome per kind on every call."""

    __slots__ = ("passing",)

    def __init__(self) -> None:
        super().__init__()
        self.passing: set[int] = set()

    def __setitem__(self, key: int, outcome: Outcome) -> None:
        super().__setitem__(key, outcome)
        if outcome.code is Code.SUCCESS:
            self.passing.add(key)


class Kinds(NamedTuple):
    """Each requested node's kind (parallel to the names) and the verdict of each kind for one request."""

    keys: list[int]
    verdicts: Verdicts


# Decisions that tell every node one outcome (`[o] * len(names)`): a group's, or a pod's that is invalid.
ONE_OUTCOME = frozenset({"invalid", "group_waiting", "group_failed"})


@dataclass
class Decision:
    """Per-node outcomes for one pod, plus the kind of decision (a bounded metrics label)."""

    kind: str  # pass_through | invalid | evaluated | group_waiting | group_failed | group_planned
    names: Sequence[str] = ()
    outcomes: list[Outcome] = field(default_factory=list)  # parallel to names
    priorities: list[int] | None = None  # overrides the outcome scores (group plans)
    request: PodRequest | None = None
    kinds: Kinds | None = None  # each node's kind, parallel to names (an evaluation over the ledger)

    def reason_label(self) -> str:
        """The dominant failure reason when nothing fits ('' when something does)."""
        if self.kind in ONE_OUTCOME and self.outcomes:  # one outcome for every node: no count
            o = self.outcomes[0]
            return o.reason.value if o.reason else "unknown"
        # Outcomes are shared between equivalent nodes: look at each distinct one; count nodes per
        # outcome (C-level) only when none fits.
        distinct = dict(zip(map(id, self.outcomes), self.outcomes, strict=True))
        if not distinct or any(o.code is Code.SUCCESS for o in distinct.values()):
            return ""
        counts: collections.Counter[str] = collections.Counter()
        for k, n in collections.Counter(map(id, self.outcomes)).items():
            o = distinct[k]
            counts[o.reason.value if o.reason else "unknown"] += n
        return counts.most_common(1)[0][0]
