"""Retries: the one capped exponential backoff, which errors are worth retrying, and the body of a
list+watch thread that keeps retrying until told to stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# One logger for the whole access layer, whichever of its modules writes the line.
log = logging.getLogger("gputopo.kube")


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff: `base_s`, `base_s*factor`, … never over `cap_s`. `attempts` bounds
    `retry`; loops that retry for ever use `delay(n)` for their n-th consecutive failure."""

    base_s: float = 0.5
    factor: float = 2.0
    cap_s: float = 8.0
    attempts: int = 4

    def delay(self, failures: int) -> float:
        return float(min(self.cap_s, self.base_s * self.factor ** max(0, failures)))

    def delays(self) -> list[float]:
        """The waits between `attempts` tries."""
        return [self.delay(i) for i in range(self.attempts - 1)]


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
    watch_once: Callable[[], None],
    backoff: Backoff,
    context: Mapping[str, str],
    min_watch_s: float = 0.0,
) -> None:
    """The body of a list+watch thread: list when `needs_list()`, then watch until the watch ends;
    failures wait `backoff` (doubling, capped) and try again until `stop` is set. A watch that ends
    in under `min_watch_s` also waits, so a server that closes watches at once is not hammered.
    (`watch_once` handles 410 Gone itself by relisting: it is not a failure.)"""
    failures = 0
    while not stop.is_set():
        try:
            if needs_list():
                relist()
            started = time.monotonic()
            watch_once()
            if time.monotonic() - started >= min_watch_s:
                failures = 0
                continue
            wait = backoff.delay(failures)
        except Exception as e:
            if stop.is_set():
                return
            wait = backoff.delay(failures)
            log.warning(
                "list/watch failed; serving what was last seen, retrying",
                extra={**context, "error": str(e), "retry_in_s": round(wait, 2)},
            )
        failures += 1
        if stop.wait(wait):
            return
