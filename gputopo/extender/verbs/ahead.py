"""The prioritize-ahead memory: what one pod's filter leaves for the prioritize that follows it.

kube-scheduler's cycle for one pod is serial: filter, its own score plugins, then prioritize over the
nodes filter passed (docs/extender.md, "Prioritize is answered ahead"). Everything that cycle lets the
extender keep between the two calls lives here, in one place:

- the last evaluation (`Evaluation`: the pod, its request, the ledger generation it was read at, the
  per-node outcomes), which a decision for the same pod and request at the same generation reuses
  within `REUSE_SECONDS` (`recall`; filled by `gputopo.extender.verbs.service` as it decides);
- the nodes the last filter passed and its request's bytes (`passed`);
- the prioritize answer computed from them once the filter's answer is written (`prepare`, called by
  the verbs server through the door while kube-scheduler scores: the passed nodes' outcomes `ranked`,
  as prioritize ranks them), handed out once by `take` when the prioritize that arrives is the one it
  was computed for and none of its nodes changed since.

The ledger is only read: its generation, its clock, which nodes changed kind since a generation
(`Ledger.unchanged_since`) and its figures for best fit above the node (`Ledger.fabric`: equal scores
are ranked by them, as of the prepare; another node's change since moves no prepared answer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import orjson

from gputopo.engine.network.domains import TieKey
from gputopo.engine.node.placement import Outcome
from gputopo.engine.state.reasons import Code
from gputopo.engine.state.scoring import first_ranked, wire_scores
from gputopo.extender.state.domainfree import FabricFigures
from gputopo.extender.state.verdicts import Kinds
from gputopo.extender.wire import PodInfo
from gputopo.model import AnnotationError, PodRequest, is_gputopo_pod, parse_pod_request

log = logging.getLogger("gputopo.extender")

EvaluationKey = tuple[str, PodRequest, int]  # the pod (uid, else namespace/name), its request, the generation


class ChangeLog(Protocol):
    """What the memory reads of the ledger."""

    @property
    def tier_names(self) -> tuple[str, ...]: ...

    @property
    def fabric(self) -> FabricFigures: ...

    def clock(self) -> float: ...

    def unchanged_since(self, generation: int, names: Sequence[str]) -> bool: ...


@dataclass
class Evaluation:
    """One decision's per-node outcomes, for the calls of the same cycle that follow it."""

    key: EvaluationKey
    at: float
    info: PodInfo
    names: list[str]
    outcomes: list[Outcome]
    kinds: Kinds | None
    passed: tuple[list[str], list[Outcome], Kinds | None] | None = None  # the nodes filter passed: outcomes, kinds
    raw: bytes = b""  # the body of the filter request that passed them


@dataclass(frozen=True)
class _Prepared:
    evaluation: Evaluation
    expect: bytes | None  # the prioritize request's bytes (None: not known, decode and compare)
    answer: bytes


Encode = Callable[[list[str], list[int]], bytes]  # the prioritize answer for nodes and their wire scores
Decode = Callable[[bytes], tuple[PodInfo, list[str]] | None]  # a prioritize body, None when unreadable

_NODE_NAMES = b',"NodeNames":'


def _kind_scores(outcomes: list[Outcome], kinds: Kinds | None) -> tuple[list[int], dict[int, float]]:
    """Each node's kind, and the engine score of each fitting kind (outcomes are shared between
    equivalent nodes: one score per kind)."""
    if kinds is not None:  # the ledger's kinds: ints, and which of them fit
        ids, verdicts = kinds
        fits = verdicts.passing
        return ids, {k: verdicts[k].score for k in set(ids) if k in fits}
    ids = list(map(id, outcomes))
    distinct = dict(zip(ids, outcomes, strict=True))
    return ids, {k: o.score for k, o in distinct.items() if o.code is Code.SUCCESS}


def ranked(
    names: Sequence[str], outcomes: list[Outcome], kinds: Kinds | None, order: Mapping[str, TieKey] | None = None
) -> list[int]:
    """The wire scores (0..10) prioritize gives `names` from their evaluated outcomes, ranked over the
    fitting nodes (`wire_scores` reads names only at the best levels), equal scores by `order` (the
    ledger's `fabric` keys: best fit above the node; None: by name)."""
    ids, scores = _kind_scores(outcomes, kinds)
    return wire_scores(names, ids, scores, order)


def first(
    names: Sequence[str], outcomes: list[Outcome], kinds: Kinds | None, order: Mapping[str, TieKey] | None = None
) -> int | None:
    """The index of the node `ranked` gives 10 (None: none fits), without ranking the others."""
    ids, scores = _kind_scores(outcomes, kinds)
    return first_ranked(names, ids, scores, order)


def prioritize_body(filter_body: bytes, names: list[str], passed: list[str]) -> bytes | None:
    """The body of the prioritize request kube-scheduler sends after the filter request `filter_body` over
    `names` passed `passed`: the same bytes with the passed nodes as the last member, as Go encodes its
    ExtenderArgs (Pod, Nodes, then NodeNames). None when the filter body does not end with `names` exactly
    as orjson writes them (another client's encoding): that prioritize is then decoded.

    Equal bytes mean an equal request: the filter body ends with the top-level NodeNames member (what
    follows the prefix is one array and the closing brace), so the prefix holds the same Pod and Nodes."""
    tail = b"%s%s}" % (_NODE_NAMES, orjson.dumps(names))
    if not filter_body.endswith(tail):
        return None
    return b"%s%s%s}" % (filter_body[: len(filter_body) - len(tail)], _NODE_NAMES, orjson.dumps(passed))


class Ahead:
    """The memory of one extender (module doc). Each slot is replaced whole, so a decision on another
    worker thread reads either the old memory or the new one, never half of each."""

    REUSE_SECONDS = 2.0  # a filter's outcomes answer the prioritize that follows within this window

    def __init__(self, ledger: ChangeLog) -> None:
        self._ledger = ledger
        self._last: Evaluation | None = None  # the last evaluation
        self._fresh: Evaluation | None = None  # the filter answered last, until `prepare`
        self._prepared: _Prepared | None = None  # its prioritize answer, until `take`

    # ------------------------------------------------------------------ filled by the decisions

    def recall(self, key: EvaluationKey, names: Sequence[str], now: float) -> tuple[list[Outcome], Kinds | None] | None:
        """The outcomes of the last evaluation for `names` when it is of this pod and request at this
        generation, and recent; None: evaluate afresh."""
        last = self._last
        if last is None or last.key != key or not 0 <= now - last.at < self.REUSE_SECONDS:
            return None
        # Lists compared in C, no per-node Python work: the filter's own list, or the nodes it passed
        # (what kube-scheduler sends to prioritize).
        if names == last.names:
            return last.outcomes, last.kinds
        if last.passed is not None and names == last.passed[0]:
            return last.passed[1], last.passed[2]
        by_name = dict(zip(last.names, last.outcomes, strict=True))
        try:
            return [by_name[n] for n in names], None
        except KeyError:
            return None  # a node the filter did not see

    def keep(
        self,
        key: EvaluationKey,
        now: float,
        info: PodInfo,
        names: list[str],
        outcomes: list[Outcome],
        kinds: Kinds | None,
    ) -> None:
        self._last = Evaluation(key, now, info, names, outcomes, kinds)

    def passed(
        self, outcomes: list[Outcome], names: list[str], kept: list[Outcome], kinds: Kinds | None, raw: bytes
    ) -> None:
        """The filter whose decision gave `outcomes` passed `names` (with their outcomes `kept` and kinds);
        `raw` is its request's body. Kept only when `outcomes` is the last evaluation's (not a group's or
        an invalid request's: those are not reused). What a filter left unprepared (its answer never
        written) may still be prepared after a later one: `take` checks the request and its nodes anyway."""
        last = self._last
        if last is None or last.outcomes is not outcomes:
            return
        last.passed, last.raw = (names, kept, kinds), raw
        self._fresh = last

    # ------------------------------------------------------------------ consulted by the verbs server

    def prepare(self, encode: Encode) -> None:
        """Once a filter answer is written (on the server's loop): the prioritize answer for the nodes it
        passed (their outcomes `ranked`, the answer `encode`d), and the bytes of the prioritize request
        kube-scheduler sends for them. What prioritize would compute while `take` finds those nodes
        unchanged: their verdicts are the ones the filter read."""
        fresh, self._fresh = self._fresh, None
        self._prepared = None
        if fresh is None or fresh.passed is None:
            return
        passed, outcomes, kinds = fresh.passed
        try:
            expect = prioritize_body(fresh.raw, fresh.names, passed)
            order = self._ledger.fabric.now().order
            self._prepared = _Prepared(fresh, expect, encode(passed, ranked(passed, outcomes, kinds, order)))
        except Exception:  # prioritize itself then answers (and logs) when it is asked
            log.debug("prioritize ahead failed", exc_info=True)

    def take(self, body: bytes, decode: Decode) -> bytes | None:
        """The answer prepared for this prioritize request (same pod and request, exactly the nodes filter
        passed, none of them changed since), once; None: compute it afresh."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        ev = prepared.evaluation
        if body != prepared.expect:  # not byte for byte the request it was computed for: decode and compare
            decoded = decode(body)
            if decoded is None or not self._same_request(ev, *decoded):
                return None
        return prepared.answer if self._holds(ev) else None

    def _same_request(self, ev: Evaluation, info: PodInfo, names: list[str]) -> bool:
        assert ev.passed is not None
        if not (is_gputopo_pod(info.annotations) or info.block):
            return False
        try:
            req = parse_pod_request(info.annotations, info.gpus, self._ledger.tier_names, block=info.block)
        except AnnotationError:
            return False
        uid, want, _ = ev.key
        return (info.uid or info.ref, req) == (uid, want) and names == ev.passed[0]

    def _holds(self, ev: Evaluation) -> bool:
        """Whether the scores given to the nodes its filter passed hold now: recent, and none of those
        nodes changed since."""
        assert ev.passed is not None
        return 0 <= self._ledger.clock() - ev.at < self.REUSE_SECONDS and self._ledger.unchanged_since(
            ev.key[2], ev.passed[0]
        )
