"""Work a listener hands off its event loop (`BoundedWorkers`): the webhook parses and reads AdmissionReviews
here, so a flood of large reviews never runs where the listener answers its probes.

Waiting calls are served round-robin by client address, so one address's backlog delays another address's
call by at most one call per address ahead of it, never by the whole backlog. The counts are bounded in all
and per address; the bytes they hold are bounded before (the listener's body budget). The bounds are wide
enough for the API server's bursts: it calls the webhook once per pod created, from one address (or a few
replicas), and a JobSet or a `kubectl apply` of a thousand pods makes as many calls at once as its clients
allow. A review refused here leaves the pod unmutated (the chart's failurePolicy Ignore) or refused (Fail),
so a caller the listener authenticated as the API server (`trusted`) is held to the bound in all only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["BoundedWorkers", "Busy"]

T = TypeVar("T")

_Call = tuple[Callable[[], Any], "asyncio.Future[Any]"]


class Busy(Exception):
    """The work was not queued: the queue is full, in all or for this address. The text says which."""


class BoundedWorkers:
    """`workers` threads; at most `queue` calls waiting or running in all and `per_peer` of one address
    (unless `trusted`), past which `run` raises `Busy` at once (nothing queued); waiting calls start
    round-robin by address. `run` is called from one event loop."""

    def __init__(self, workers: int = 2, queue: int = 256, per_peer: int = 64, name: str = "gputopo-review") -> None:
        self.workers, self.queue, self.per_peer = workers, queue, per_peer
        self.name = name
        self.pending = 0
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: collections.OrderedDict[str, collections.deque[_Call]] = collections.OrderedDict()
        self._running = 0

    async def run(self, peer: str, fn: Callable[[], T], *, trusted: bool = False) -> T:
        if self.pending >= self.queue:
            self.refused += 1
            raise Busy(f"{self.pending} reviews are being read already; retry")
        if not trusted and self.by_peer[peer] >= self.per_peer:
            self.refused += 1
            raise Busy(f"{self.by_peer[peer]} reviews from {peer} are being read already; retry")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._waiting.setdefault(peer, collections.deque()).append((fn, done))
        self.pending += 1
        self.by_peer[peer] += 1
        try:
            self._start(loop)
            return await done
        finally:
            self.pending -= 1
            self.by_peer[peer] -= 1
            if not self.by_peer[peer]:
                del self.by_peer[peer]

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start waiting calls while a thread is free: the first address's oldest, that address then last."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name)
        while self._running < self.workers and self._waiting:
            peer, calls = next(iter(self._waiting.items()))
            fn, done = calls.popleft()
            if calls:
                self._waiting.move_to_end(peer)
            else:
                del self._waiting[peer]
            if done.done():  # its caller left while it waited
                continue
            self._running += 1
            self._pool.submit(fn).add_done_callback(functools.partial(self._back, loop, done=done))

    def _back(self, loop: asyncio.AbstractEventLoop, f: Future[Any], *, done: asyncio.Future[Any]) -> None:
        """On the worker thread: hand the outcome to the loop (none once the listener has stopped)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for the answer
            loop.call_soon_threadsafe(self._finished, loop, f, done)

    def _finished(self, loop: asyncio.AbstractEventLoop, f: Future[Any], done: asyncio.Future[Any]) -> None:
        self._running -= 1
        if not done.done():
            if f.cancelled():
                done.cancel()
            elif (error := f.exception()) is not None:
                done.set_exception(error)
            else:
                done.set_result(f.result())
        self._start(loop)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
