"""One way to publish an object to the API server: write only when it differs, confirm, re-verify.

The agent publishes two objects this way, its Node's metadata (`gputopo.agent.nodepublisher`) and, in DRA
mode, its ResourceSlice (`gputopo.agent.dra.slices`); each is a small `Target`. A `Confirmed` publisher
remembers the desired value the API server is known to hold: an unchanged desired value costs no API
call at all until `reverify_s` passes or `reverify()` asks for reads (then a read repairs external
edits or deletions). It also remembers what the server made of its last write, so a field the server
drops (a feature gate that is off) costs one write, not one per round. A write that meets a conflict
(409: someone wrote since the read) is re-read and re-decided, a bounded number of times. Any other
failure is a result, never an exception: the next round reads again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar, cast

from gputopo.kube import Backoff, retry, short_error

log = logging.getLogger(__name__)

D = TypeVar("D")  # the desired value, as the target builds its write from it
C = TypeVar("C")  # the current object, as the target read it
D_contra = TypeVar("D_contra", contravariant=True)

CONFLICT_TRIES = 3


class PublishResult(StrEnum):
    """Outcome of one publish; also the `result` label of gputopo_agent_publish_total."""

    CHANGED = "changed"
    UNCHANGED = "unchanged"
    ERROR = "error"


class Target(Protocol[D_contra, C]):
    """One object on the API server; each call raises on API failure (after its own retries)."""

    what: str  # for logs: "the Node", "the ResourceSlice"

    def comparable(self, desired: D_contra) -> Any:
        """The desired value as compared: equal values need no write."""
        ...

    def read(self) -> C: ...

    def holds(self, current: C, want: Any) -> Any:
        """What `current` holds of `want`, comparable with it; None when it must be written anyway
        (absent, or not ours)."""
        ...

    def write(self, current: C, desired: D_contra) -> Any:
        """Write `desired` over `current`; the comparable of what the server kept."""
        ...


def is_conflict(e: BaseException) -> bool:
    return getattr(e, "status", None) == 409


T = TypeVar("T")


def retry_write(fn: Callable[[], T], backoff: Backoff, sleep: Callable[[float], bool], what: str) -> T:
    """`gputopo.kube.retry`, except that a conflict is raised at once: the same body would only meet it
    again, so `Confirmed` reads the object again instead."""
    conflicts: list[Exception] = []

    def once() -> T | None:
        try:
            return fn()
        except Exception as e:
            if not is_conflict(e):
                raise
            conflicts.append(e)
            return None

    answer = retry(once, backoff, sleep, what)
    if conflicts:
        raise conflicts[0]
    return cast(T, answer)  # fn's own answer: there was no conflict


class Confirmed(Generic[D, C]):
    """Publishes through a `Target`, writing only what differs; see the module's docstring."""

    def __init__(
        self,
        target: Target[D, C],
        reverify_s: float,
        monotonic: Callable[[], float] = time.monotonic,
        conflict_tries: int = CONFLICT_TRIES,
    ) -> None:
        self.target = target
        self._reverify_s = reverify_s
        self._monotonic = monotonic
        self._conflict_tries = conflict_tries
        self._confirmed: Any = None  # the comparable desired value the server is known to hold
        self._confirmed_at = 0.0
        self._read_until = 0.0  # reverify(): read on every publish until then
        self._sent: Any = None  # what the last write sent (comparable) ...
        self._answer: Any = None  # ... and what the server kept of it
        self.writes = 0

    def reverify(self, window_s: float = 0.0) -> None:
        """Read on the next publish, and on every publish for `window_s` more."""
        self._confirmed = None
        self._read_until = self._monotonic() + window_s

    def publish(self, desired: D) -> PublishResult:
        want = self.target.comparable(desired)
        now = self._monotonic()
        if self._confirmed == want and now - self._confirmed_at < self._reverify_s and now >= self._read_until:
            return PublishResult.UNCHANGED
        try:
            changed = self._reconcile(desired, want)
        except Exception as e:
            self._confirmed = None  # the next round reads again; what the server kept is still known
            log.error(f"publishing {self.target.what} failed", extra={"error": short_error(e)})
            return PublishResult.ERROR
        self._confirmed, self._confirmed_at = want, self._monotonic()
        return PublishResult.CHANGED if changed else PublishResult.UNCHANGED

    def _reconcile(self, desired: D, want: Any) -> bool:
        for attempt in range(self._conflict_tries):
            current = self.target.read()
            have = self.target.holds(current, want)
            if have is not None and (have == want or (want == self._sent and have == self._answer)):
                return False
            try:
                answer = self.target.write(current, desired)
            except Exception as e:
                if not is_conflict(e) or attempt == self._conflict_tries - 1:
                    raise
                log.info(f"{self.target.what} changed under us; reading it again", extra={"attempt": attempt + 1})
                continue
            self.writes += 1
            self._sent, self._answer = want, answer
            if answer != want:
                log.warning(
                    f"the API server changed {self.target.what} we wrote (a feature gate off?); keeping its version"
                )
            return True
        raise AssertionError("unreachable")  # the loop either returns or raises
