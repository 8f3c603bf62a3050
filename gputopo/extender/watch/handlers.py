"""What the cache registers per watched kind: a `KindHandler` (a full list, one watch event), the report
of an unreadable object (`Bad`), and the one loop that reads a list past its unreadable objects."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from gputopo.kube import JSON

T = TypeVar("T")

# (kind, object, error): log it, count it, move on (the cache's `_bad`).
Bad = Callable[[str, Any, Exception], None]


@dataclass(frozen=True)
class KindHandler:
    """One kind's side of the cache: `replace(items)` takes a full list, `apply(event_type, obj)` one
    watch event (the cache contains what `apply` raises to that object), `not_served()` hears that the
    API server does not serve the kind."""

    replace: Callable[[list[JSON]], None]
    apply: Callable[[str, JSON], None]
    # An optional kind the API server does not serve (after `replace([])`): where that differs from "none".
    not_served: Callable[[], None] = lambda: None


def each_readable(kind: str, items: list[JSON], read: Callable[[JSON], T], bad: Bad) -> Iterator[tuple[JSON, T]]:
    """Each object of a list with what `read` made of it; one it cannot read is reported and skipped."""
    for obj in items:
        try:
            value = read(obj)
        except Exception as e:
            bad(kind, obj, e)
            continue
        yield obj, value


def object_at(obj: Any, where: str) -> Mapping[str, Any]:
    """An object's optional sub-object: {} when absent or null; ValueError naming `where` when not an object."""
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} is not an object")
    return obj
