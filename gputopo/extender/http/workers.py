"""Work a listener hands off its event loop (`BoundedWorkers`): the webhook parses and reads AdmissionReviews
here, so a flood of large reviews never runs where the listener answers its probes, and the queue is bounded in
all and per client address, so one address's flood cannot make the API server's review wait behind it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["BoundedWorkers", "Busy"]

T = TypeVar("T")


class Busy(Exception):
    """The work was not queued: the queue is full, in all or for this address. The text says which."""


class BoundedWorkers:
    """`workers` threads; at most `queue` calls waiting or running in all and `per_peer` of one address, past
    which `run` raises `Busy` at once (nothing queued). `run` is called from one event loop."""

    def __init__(self, workers: int = 2, queue: int = 16, per_peer: int = 4, name: str = "gputopo-review") -> None:
        self.workers, self.queue, self.per_peer = workers, queue, per_peer
        self.name = name
        self.pending = 0
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, peer: str, fn: Callable[[], T]) -> T:
        if self.pending >= self.queue:
            self.refused += 1
            raise Busy(f"{self.pending} reviews are being read already; retry")
        if self.by_peer[peer] >= self.per_peer:
            self.refused += 1
            raise Busy(f"{self.by_peer[peer]} reviews from {peer} are being read already; retry")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name)
        self.pending += 1
        self.by_peer[peer] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.pending -= 1
            self.by_peer[peer] -= 1
            if not self.by_peer[peer]:
                del self.by_peer[peer]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
