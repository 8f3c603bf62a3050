"""The verbs server's deadlines (`gputopo.extender.http.verbserver`): one timer per connection, for what it does now —
reading a request (`--read-timeout-seconds` from its first byte), idle (`--idle-timeout-seconds`), or a write the
client does not read (the read timeout again)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gputopo.extender.settings import ListenerLimits


class Deadlines:
    """The connection's one pending timer and its kind: "read", "idle", "stall" or "" (none); each kind's handler
    runs once it fires, the timer already cleared."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        limits: ListenerLimits,
        *,
        read: Callable[[], None],
        idle: Callable[[], None],
        stall: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.kind = ""
        self._timer: asyncio.TimerHandle | None = None
        self._kinds = {
            "read": (limits.read_timeout_s, read),
            "idle": (limits.idle_timeout_s, idle),
            "stall": (limits.read_timeout_s, stall),
        }

    def follow(self, in_request: bool, answering: bool) -> None:
        """The timer for what the connection does now: a request being read has until its read deadline (never
        restarted by its own bytes), an idle connection until the idle timeout, one that is being answered none;
        a stalled write's timer stays."""
        if self.kind == "stall":
            return
        want = "read" if in_request else "" if answering else "idle"
        if want != self.kind:
            if want:
                self.arm(want)
            else:
                self.disarm()

    def arm(self, kind: str) -> None:
        self.disarm()
        seconds, fn = self._kinds[kind]
        self._timer, self.kind = self.loop.call_later(seconds, self._fire, fn), kind

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self.kind = None, ""

    def _fire(self, fn: Callable[[], None]) -> None:
        self._timer, self.kind = None, ""
        fn()
