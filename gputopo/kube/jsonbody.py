"""API answers and watch lines decoded as JSON, whatever depth a tenant nested a value to.

The API server stores values nested up to 10,000 deep (Go's decoder's bound) where a kind keeps free-form
JSON: a ResourceClaimTemplate's or ResourceClaim's opaque device parameters (up to 10 KiB), a CRD's
unpruned fields. orjson refuses anything past 1,024 deep, so one such object would make a whole list,
every namespace's objects of the kind, unreadable, on every try. `loads` decodes as orjson does and, only
where orjson refused for depth, again with every value nested past `MAX_DEPTH` replaced by null: no field
gputopo reads lies that deep (an API object's own structure is a few dozen levels at most).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson

log = logging.getLogger(__name__)

MAX_DEPTH = 512  # levels kept; orjson's own bound is 1,024
# A JSON string (skipped whole: brackets inside it are text) or one bracket.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN = frozenset(b"[{")


def loads(data: bytes | str) -> Any:
    """`data` decoded; orjson.JSONDecodeError (a ValueError) when it is no JSON, as orjson.loads."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        if "depth limit" not in str(e):
            raise
    raw = data.encode() if isinstance(data, str) else data
    out = orjson.loads(clip_deep(raw))
    log.warning("decoded a JSON document with values nested past the depth read", extra={"depth": MAX_DEPTH})
    return out


def clip_deep(data: bytes, depth: int = MAX_DEPTH) -> bytes:
    """`data` with each array or object that opens past `depth` levels replaced by `null` (the document is
    otherwise as it was; unbalanced input stays unbalanced, and orjson then refuses it)."""
    parts: list[bytes] = []
    level, start, kept = 0, 0, 0
    for m in _TOKENS.finditer(data):
        c = data[m.start()]
        if c == 0x22:  # a string
            continue
        if c in _OPEN:
            level += 1
            if level == depth + 1:
                start = m.start()
            continue
        if level == depth + 1:
            parts += (data[kept:start], b"null")
            kept = m.end()
        level -= 1
    parts.append(data[kept:])
    return b"".join(parts)
