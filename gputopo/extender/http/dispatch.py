"""The verbs server's dispatch (`gputopo.extender.http.verbserver`): which door call a request is, and that call, on the
loop or on the door's worker threads, its outcome handed straight back to the loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import orjson

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future

Answer = tuple[int, bytes]  # HTTP status, JSON body

log = logging.getLogger("gputopo.extender.http")


class Entry(Protocol):
    """What the server hands requests to: `gputopo.extender.verbs.door.Door` (or a benchmark's floor)."""

    max_request_bytes: int

    def route(self, method: bytes, path: str) -> str | Answer:
        """The verb a request names, or the answer to a request that names none."""
        ...

    def reads_body(self, verb: str) -> bool: ...

    def pool_for(self, verb: str) -> Executor | None:
        """The worker pool `verb` runs on (None: on the loop)."""
        ...

    def answer(self, verb: str, body: bytes) -> Answer: ...

    def after(self, verb: str) -> None:
        """Called on the loop once a 200 answer to `verb` is written."""
        ...

    def ready(self, verb: str, body: bytes) -> Answer | None:
        """An answer the loop may send at once, without a worker (None: hand the call to a worker)."""
        ...


def error(text: str) -> bytes:
    return orjson.dumps({"Error": text})


SHUTTING_DOWN: Answer = (503, error("gputopo-extender is shutting down"))


class Dispatch:
    """One connection's door calls."""

    def __init__(self, door: Entry, loop: asyncio.AbstractEventLoop) -> None:
        self.door = door
        self.loop = loop

    def plan(self, method: bytes, path: str, body: bytes) -> tuple[str, Executor | None, Answer | None]:
        """The verb, its worker pool, and the answer when the loop gives it at once (None: the pool must)."""
        door = self.door
        name = door.route(method, path)
        if not isinstance(name, str):  # 404, 405
            return "", None, name
        pool = door.pool_for(name)
        if pool is None:  # healthz, readyz: on the loop, so they answer while every worker decides
            return name, None, door.answer(name, body)
        return name, pool, door.ready(name, body)

    def submit(self, pool: Executor, verb: str, body: bytes, done: Callable[[Future[Answer]], None]) -> bool:
        """`door.answer` on `pool`, `done` called on the loop with its future; False when the pools are shut down
        (the server is stopping)."""
        try:
            future = pool.submit(self.door.answer, verb, body)
        except RuntimeError:
            return False
        # The worker hands the finished future straight back to the loop: no asyncio Future chained to it
        # (run_in_executor's wrapping was a tenth of the loop's time in the throughput benchmark).
        loop = self.loop

        def finished(f: Future[Answer]) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the server stopped, nobody waits for it
                loop.call_soon_threadsafe(done, f)

        future.add_done_callback(finished)
        return True

    @staticmethod
    def outcome(path: str, future: Future[Answer]) -> Answer:
        if future.cancelled():
            return SHUTTING_DOWN
        if (exc := future.exception()) is not None:  # `answer` catches everything; this is the last resort
            log.error("unhandled error", extra={"path": path, "error": repr(exc)})
            return 500, error(f"internal: {type(exc).__name__}: {exc}")
        return future.result()
