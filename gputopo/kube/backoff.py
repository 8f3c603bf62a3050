"""Retries: the one capped exponential backoff, which errors are worth retrying, and the body of a
list+watch thread (the informer core the extender's informers and the agent's pod view share), paced
as client-go's reflector paces its own."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from gputopo.kube.errors import Gone

T = TypeVar("T")

# One logger for the whole access layer, whichever of its modules writes the line.
log = logging.getLogger("gputopo.kube")

# Consecutive failures counted at most: the delay is at its cap long before, and the count stays small.
_MAX_FAILURES = 64


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff: `base_s`, `base_s*factor`, … never over `cap_s`. `attempts` bounds
    `retry`; loops that retry for ever use `delay(n)` for their n-th consecutive failure, or
    `jittered(n, r)`: that delay stretched by up to `jitter` of itself, so clients that failed together
    do not come back together."""

    base_s: float = 0.5
    factor: float = 2.0
    cap_s: float = 8.0
    attempts: int = 4
    jitter: float = 0.0

    def delay(self, failures: int) -> float:
        try:
            grown = self.base_s * self.factor ** max(0, failures)
        except OverflowError:  # a loop that has failed for hours: long past the cap
            return float(self.cap_s)
        return float(min(self.cap_s, grown))

    def jittered(self, failures: int, r: float) -> float:
        """`delay(failures)` times 1 + `jitter`·r for r in [0, 1]: within [d, d·(1 + jitter)]."""
        return self.delay(failures) * (1.0 + self.jitter * min(1.0, max(0.0, r)))

    def delays(self) -> list[float]:
        """The waits between `attempts` tries."""
        return [self.delay(i) for i in range(self.attempts - 1)]


# client-go's reflector: 800 ms doubling to 30 s, each wait jittered by up to its own length (so
# [30 s, 60 s) at the cap), and a watch that ends in under a second counts as a failure.
REFLECTOR_BACKOFF = Backoff(base_s=0.8, factor=2.0, cap_s=30.0, jitter=1.0)
MIN_WATCH_S = 1.0


@dataclass(frozen=True)
class Pacing:
    """How a list+watch loop waits between rounds: `backoff` (jittered) after each failed one, where a
    watch that ends in under `min_watch_s` has failed too; a watch that runs longer, however it ends,
    starts the backoff afresh. `sleep(s)` waits and
    returns True when told to stop (None: the loop's stop event); `clock` and `rand` (in [0, 1)) are
    there for tests."""

    backoff: Backoff = REFLECTOR_BACKOFF
    min_watch_s: float = MIN_WATCH_S
    sleep: Callable[[float], bool] | None = None
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status", None)
    return status if isinstance(status, int) else None


def is_retryable(e: BaseException) -> bool:
    """Server-side and throttling errors and lost connections are retried; other client errors
    (403 RBAC, 422 invalid) would only fail again the same way."""
    status = _status(e)
    if status is None or status == 0:
        return True
    return status in (408, 409, 429) or status >= 500


def short_error(e: BaseException) -> str:
    """One line for a log: the Status reason when there is one."""
    reason = getattr(e, "reason", None)
    return str(reason) if reason else (str(e).splitlines() or [type(e).__name__])[0]


def retry(fn: Callable[[], T], backoff: Backoff, sleep: Callable[[float], bool], what: str) -> T:
    """Run fn, retrying retryable errors after each delay; `sleep` returns True when told to stop."""
    delays = backoff.delays()
    for attempt in range(backoff.attempts):
        try:
            return fn()
        except Exception as e:
            if attempt == backoff.attempts - 1 or not is_retryable(e):
                raise
            log.warning(
                "API call failed; retrying",
                extra={"call": what, "status": _status(e), "attempt": attempt + 1, "error": short_error(e)},
            )
            if sleep(delays[attempt]):
                raise
    raise AssertionError("unreachable")  # the loop either returns or raises


def run_list_watch(
    *,
    stop: threading.Event,
    needs_list: Callable[[], bool],
    relist: Callable[[], None],
    watch_once: Callable[[], bool | None],
    context: Mapping[str, str],
    pacing: Pacing | None = None,
) -> None:
    """The body of a list+watch thread: list (at the start, after a 410 Gone, and whenever
    `needs_list()`), then watch until the watch ends, until `stop` is set.

    `watch_once()` consumes one watch and raises `Gone` on 410; it returns False when there was
    nothing to watch (its relist already waited). A round fails when its list or watch fails, on
    410 Gone, or when its watch ends in under `pacing.min_watch_s`; each failure waits the jittered
    backoff, growing with consecutive failures, before the next round (so a 410 waits before its
    relist, as client-go's reflector does). A watch that ran at least `min_watch_s` was a healthy
    one, however it ended (a 410 or a broken stream after a while, an API server restarted after
    hours): the backoff starts afresh, so an earlier outage does not lengthen the wait after this
    one, and the extender is not blind for long after a blip. What floods an API server (watches
    that fail or end at once, a 410 at every watch) still meets a growing backoff. The failures are
    logged; the caller keeps serving what it last saw."""
    pacing = pacing or Pacing()
    sleep = pacing.sleep or stop.wait
    failures = 0
    must_list = True
    while not stop.is_set():
        started: float | None = None
        level, what, error = logging.INFO, "the watch ended at once; watching again after a wait", ""
        try:
            if must_list or needs_list():
                relist()
                must_list = False
            started = pacing.clock()
            if watch_once() is False:
                continue
            if pacing.clock() - started >= pacing.min_watch_s:
                failures = 0
                continue
        except Gone as e:
            must_list = True
            what, error = "watch expired (410 Gone); relisting after a wait", short_error(e)
        except Exception as e:
            level, what, error = logging.WARNING, "list/watch failed; serving what was last seen, retrying", str(e)
        if stop.is_set():
            return
        if started is not None and pacing.clock() - started >= pacing.min_watch_s:
            failures = 0  # a watch that ran a while before it failed: not one failure in a row
        wait = pacing.backoff.jittered(failures, pacing.rand())
        failures = min(failures + 1, _MAX_FAILURES)
        log.log(level, what, extra={**context, "error": error, "failures": failures, "retry_in_s": round(wait, 2)})
        if sleep(wait):
            return
