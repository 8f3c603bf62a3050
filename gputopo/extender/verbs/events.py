"""core/v1 Events that explain what already happened (a placement, a placement mismatch, a gang member gated),
posted by a small worker pool off every request's critical path. A lost Event is only logged.

`flush` is a barrier: it returns once every Event submitted before it was posted or failed (each post's
future is kept until it is done, and `flush` waits for the ones pending when it was called)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime

from gputopo.extender.state.mismatch import Mismatch
from gputopo.extender.watch.source import JSON, ClusterSource
from gputopo.kube import KubeError
from gputopo.model import EXTENDER_COMPONENT

log = logging.getLogger("gputopo.extender.verbs.events")

EVENT_REASON = "TopologyPlacement"
MISMATCH_REASON = "TopologyPlacementMismatch"
MAX_EVENT_NAME = 253


class EventPoster:
    def __init__(self, source: Callable[[], ClusterSource | None]) -> None:
        self._source = source  # read at post time: the app may attach its API client after start
        self.instance = socket.gethostname()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gputopo-events")
        self._closed = False
        self._lock = threading.Lock()
        self._pending: set[Future[None]] = set()  # posts submitted and not done yet

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every Event submitted before this call was posted or failed (tests, shutdown);
        TimeoutError when some are still pending after `timeout` seconds. Events submitted meanwhile are
        not waited for."""
        with self._lock:
            pending = set(self._pending)
        if pending and wait(pending, timeout=timeout).not_done:
            raise TimeoutError(f"Events still being posted after {timeout:g} s")

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        future = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)  # runs at once when the post already finished

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)
        if not future.cancelled() and (e := future.exception()) is not None:  # not a KubeError: logged here
            log.warning("could not post an Event", extra={"error": repr(e)})

    def close(self, timeout: float = 10.0) -> None:
        """Post what is queued (bounded by `timeout`), then stop the posting threads; later posts are dropped."""
        try:
            self.flush(timeout)
        except Exception as e:  # shutdown goes on: a lost event is only logged
            log.warning("events still queued at shutdown were not all posted", extra={"error": str(e)})
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._closed = True

    def placed(self, namespace: str, name: str, uid: str, sentence: str) -> None:
        if self._closed:
            return
        self._submit(self._placed, namespace, name, uid, sentence)

    def mismatch(self, m: Mismatch) -> None:
        if self._closed:
            return
        self._submit(self._mismatch, m)

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, kind: str, text: str, suffix: str) -> None:
        """An Event about a pod under a fixed name per pod and `suffix`: a second replica, or this one after a
        restart, gets 409 and posts no twin."""
        if self._closed:
            return
        self._submit(self._pod_event, namespace, name, uid, reason, kind, text, suffix)

    def _pod_event(self, namespace: str, name: str, uid: str, reason: str, kind: str, text: str, suffix: str) -> None:
        source = self._source()
        if source is None:
            return
        event = self._body(namespace, name, uid, reason, kind, text)
        tail = f".{uid}.{suffix}"
        event["metadata"]["name"] = name[: MAX_EVENT_NAME - len(tail)].rstrip(".-") + tail
        try:
            source.create_event(namespace, event)
        except KubeError as e:
            if e.status != 409:
                log.warning(
                    f"could not create the {reason} event", extra={"pod": f"{namespace}/{name}", "error": str(e)}
                )

    def _placed(self, namespace: str, name: str, uid: str, sentence: str) -> None:
        source = self._source()
        if source is None:
            return
        event = self._body(namespace, name, uid, EVENT_REASON, "Normal", sentence)
        event["metadata"]["generateName"] = f"{name}."
        try:
            source.create_event(namespace, event)
        except KubeError as e:  # the bind succeeded; a lost event is only logged
            log.warning(
                "could not create the TopologyPlacement event", extra={"pod": f"{namespace}/{name}", "error": str(e)}
            )

    def _mismatch(self, m: Mismatch) -> None:
        source = self._source()
        if source is None:
            return
        event = self._body(m.namespace, m.name, m.uid, MISMATCH_REASON, "Warning", m.sentence())
        # A fixed name per pod: a second replica, or this one after a restart, gets 409 and posts no twin.
        suffix = f".{m.uid}.placement-mismatch"
        event["metadata"]["name"] = m.name[: MAX_EVENT_NAME - len(suffix)].rstrip(".-") + suffix
        try:
            source.create_event(m.namespace, event)
        except KubeError as e:
            if e.status != 409:
                log.warning(
                    "could not create the TopologyPlacementMismatch event", extra={"pod": m.ref, "error": str(e)}
                )

    def _body(self, namespace: str, name: str, uid: str, reason: str, kind: str, text: str) -> JSON:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace, "uid": uid},
            "reason": reason,
            "message": text[:1024],
            "type": kind,
            "source": {"component": EXTENDER_COMPONENT},
            "reportingComponent": EXTENDER_COMPONENT,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
