"""Building hostile Kubernetes objects in tests: setting a field by its dotted path."""

from __future__ import annotations

from typing import Any


def with_paths(obj: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`obj` with each dotted path of `over` set to its value (parents made as needed)."""
    for path, value in over.items():
        cur = obj
        *parents, leaf = path.split(".")
        for k in parents:
            cur = cur.setdefault(k, {})
        cur[leaf] = value
    return obj
