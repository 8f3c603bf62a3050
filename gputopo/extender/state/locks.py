"""A fixed table of locks picked by key: serialises work per node or per group without keeping one lock
per name (request bodies name any strings; a lock per distinct name grew without bound)."""

from __future__ import annotations

import threading
from collections.abc import Hashable


class StripedLocks:
    def __init__(self, stripes: int = 64) -> None:
        self._locks = tuple(threading.Lock() for _ in range(stripes))

    def __len__(self) -> int:
        return len(self._locks)

    def __call__(self, key: Hashable) -> threading.Lock:
        """The lock for `key`; two keys may share one (they then wait for each other, rarely)."""
        return self._locks[hash(key) % len(self._locks)]
