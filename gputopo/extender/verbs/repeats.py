"""What repeats filter after filter, decoded or encoded once: the request's node names, and a failure map
with one reason for every node.

kube-scheduler names the same nodes to every pod of a retry round (5,000 names, about 60 KB), and an
unplaceable gang's members are all told one sentence on every node. Per member filter, decoding the names,
comparing them with the group's kept failure, building the 5,000-entry failure map and encoding it was most
of the filter's CPU. Both memories here are pure: each answer is a function of bytes or values compared in
full on every call, so nothing kept can go stale; they only spare the work of computing it again.

- `RepeatedNames`: a filter body ends `,"NodeNames":[...]}` (Go writes ExtenderArgs' fields in order:
  Pod, Nodes, NodeNames). When that tail is byte-identical to one seen before, only the part before it
  (the Pod) is decoded, and the names are the list decoded then (spelled with the node cache's strings
  at the first repeat, so that later comparisons of them are by identity; a list seen once, as a lone
  pod's shrinking node list mostly is, is never spelled). The split is proven, not guessed: the head with a
  closing brace must decode to an object without `NodeNames`, and the tail's array decoded alone, so the
  body is that object plus that array, exactly what decoding it whole gives.
- `ReasonMaps`: `{name: message}` for every node as one `SameReason` (a read-only mapping) with its JSON
  encoded once, for the same message and names (compared element by element).

Both are bounded in entries and bytes (4 tails of at most 4 MiB; 4 maps of at most 16 MiB, 32 MiB in
all): only kube-scheduler calls filter, but a caller naming ever new nodes or sentences only replaces the
oldest entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import orjson

from gputopo.extender.wire import ExtenderArgs, brackets, checked_args, strings_within_bound

NAMES_KEY = b',"NodeNames":'
SEGMENTS_KEPT = 4  # distinct node lists at once (kube-scheduler profiles, pods whose own filters drop nodes)
SEGMENT_MAX_BYTES = 4 * 1024 * 1024  # 15,000 names of the longest legal length; larger lists are not kept
MIN_NAMES = 64  # shorter lists decode in microseconds: not worth an entry


@dataclass(frozen=True)
class _Segment:
    tail: bytes  # `,"NodeNames":[...]}`, the body's last bytes
    names: list[str]  # the array, decoded (spelled once `spelled`); never handed out (callers get a copy)
    opened: int  # `brackets(tail)`
    spelled: bool = False


class RepeatedNames:
    """The last few node-name tails of filter bodies and their names (module doc). `spell` maps decoded
    names to equal strings (the node cache's), once per tail that repeats."""

    def __init__(self, spell: Callable[[list[str]], list[str]] = list) -> None:
        self.spell = spell
        self._kept: tuple[_Segment, ...] = ()  # newest first; replaced whole (worker threads share it)

    def decode(self, body: bytes) -> ExtenderArgs | None:
        """`fast_extender_args(body)` when the body has kube-scheduler's layout, else None (the caller
        decodes it the usual way)."""
        for seg in self._kept:
            if body.endswith(seg.tail):
                if not seg.spelled:
                    seg = self._spelled(seg)
                head = body[: len(body) - len(seg.tail)]
                return _joined(head, list(seg.names), brackets(head) + seg.opened)
        return self._learn(body)

    def _learn(self, body: bytes) -> ExtenderArgs | None:
        if not body.endswith(b"]}"):
            return None
        at = body.rfind(NAMES_KEY)
        if at < 0:
            return None
        tail = body[at:]
        try:
            names = orjson.loads(tail[len(NAMES_KEY) : -1])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(names, list) or not strings_within_bound(names):
            return None
        if len(names) < MIN_NAMES or len(tail) > SEGMENT_MAX_BYTES:
            return _joined(body[:at], names, brackets(body))
        args = _joined(body[:at], list(names), brackets(body))
        if args is not None:
            self._kept = (_Segment(tail, names, brackets(tail)), *self._kept[: SEGMENTS_KEPT - 1])
        return args

    def _spelled(self, seg: _Segment) -> _Segment:
        """`seg` with its names spelled, put in its place (a segment dropped meanwhile stays dropped)."""
        done = _Segment(seg.tail, self.spell(seg.names), seg.opened, spelled=True)
        self._kept = tuple(done if s is seg else s for s in self._kept)
        return done

    def __len__(self) -> int:
        return len(self._kept)


def _joined(head: bytes, names: list[str], opened: int) -> ExtenderArgs | None:
    """The args of `head + NAMES_KEY + <names' array> + "}"`: `head` closed by a brace must decode to an
    object without NodeNames (so the names are its last member and nothing else names them)."""
    try:
        data = orjson.loads(head + b"}")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or "NodeNames" in data:
        return None
    data["NodeNames"] = names
    return checked_args(data, opened, names_checked=True)


class SameReason(Mapping[str, str]):
    """`dict.fromkeys(names, message)`, read-only, with its JSON (`fragment`: the bytes orjson writes
    for that dict) encoded once."""

    def __init__(self, names: Sequence[str], message: str) -> None:
        self.names = list(names)  # what it answers for, compared in full (a copy: the caller's may change)
        self.message = message
        self._map = dict.fromkeys(self.names, message)
        self.encoded = orjson.dumps(self._map)
        self.fragment = orjson.Fragment(self.encoded)  # written as is into the answer

    def __getitem__(self, name: str) -> str:
        return self._map[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def answers(self, names: Sequence[str], message: str) -> bool:
        return self.message == message and len(self.names) == len(names) and self.names == names


REASON_MAPS_KEPT = 4
REASON_MAP_MAX_BYTES = 16 * 1024 * 1024  # one map's JSON; 65,000 nodes and a 200-character sentence: 15 MB
REASON_MAPS_BYTES = 32 * 1024 * 1024  # all kept maps' JSON together; the oldest goes first


class ReasonMaps:
    """The last few `SameReason` maps (module doc)."""

    def __init__(self) -> None:
        self._kept: tuple[SameReason, ...] = ()  # newest first; replaced whole (worker threads share it)

    def map(self, names: Sequence[str], message: str) -> SameReason:
        for kept in self._kept:
            if kept.answers(names, message):
                return kept
        made = SameReason(names, message)
        if len(names) >= MIN_NAMES and len(made.encoded) <= REASON_MAP_MAX_BYTES:
            newest = (made, *self._kept[: REASON_MAPS_KEPT - 1])
            while len(newest) > 1 and sum(len(m.encoded) for m in newest) > REASON_MAPS_BYTES:
                newest = newest[:-1]
            self._kept = newest
        return made

    def kept_bytes(self) -> int:
        return sum(len(m.encoded) for m in self._kept)

    def __len__(self) -> int:
        return len(self._kept)
