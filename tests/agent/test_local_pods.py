"""The node-local pod view: Pod objects to LocalPods, malformed ones skipped with one log line, and the
list+watch thread (events applied, 410 relists, errors back off, refresh, close)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.agent.pods import KubeLocalPods, StaticLocalPods, parse_local_pod
from gputopo.kube import Backoff, Gone, Pacing
from gputopo.model import PLACEMENT_ANNOTATION
from tests.agent.dp_harness import NODE, pod_object, wait_for
from tests.objects import with_paths


def _pod(**over: Any) -> dict[str, Any]:
    return with_paths(pod_object("p", [0, 1]), over)


def _limits(*pairs: tuple[str, Any]) -> list[dict[str, Any]]:
    return [{"name": n, "resources": {"limits": {"nvidia.com/gpu": v}}} for n, v in pairs]


@pytest.mark.parametrize(
    ("obj", "requested", "containers"),
    [
        pytest.param(_pod(), 2, (("main", 2),), id="one-container"),
        pytest.param(
            _pod(**{"spec.containers": [*_limits(("a", "1")), {"name": "sidecar"}, *_limits(("b", 3))]}),
            4,
            (("a", 1), ("b", 3)),
            id="containers-without-gpus-left-out",
        ),
        pytest.param(
            _pod(**{"spec.containers": _limits(("a", "1")), "spec.initContainers": _limits(("i", "4"))}),
            4,
            (("a", 1),),
            id="init-container-larger-than-app",
        ),
        pytest.param(
            _pod(**{"spec.containers": [{"name": "r", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}),
            2,
            (("r", 2),),
            id="requests-when-no-limits",
        ),
        pytest.param(_pod(**{"spec.containers": [{"name": "cpu"}]}), 0, (), id="no-gpus"),
    ],
)
def test_gpu_requests(obj: dict[str, Any], requested: int, containers: tuple[tuple[str, int], ...]) -> None:
    pod, error = parse_local_pod(obj, NODE)
    assert (pod.gpus_requested, pod.container_gpus, error) == (requested, containers, None)


@pytest.mark.parametrize(
    ("annotation", "has_placement", "has_error"),
    [
        pytest.param(None, True, False, id="placement-for-this-node"),
        pytest.param(
            '{"node":"elsewhere","gpus":[0],"score":1,"reason":"r"}', False, False, id="placement-for-another-node"
        ),
        pytest.param("{not json", False, True, id="unreadable-placement"),
    ],
)
def test_placement(annotation: str | None, has_placement: bool, has_error: bool) -> None:
    obj = _pod()
    if annotation is not None:
        obj["metadata"]["annotations"][PLACEMENT_ANNOTATION] = annotation
    pod, error = parse_local_pod(obj, NODE)
    assert (pod.placement is not None, error is not None) == (has_placement, has_error)
    if has_placement:
        assert pod.placement is not None and pod.placement.gpus == (0, 1)


def test_fields() -> None:
    pod, _ = parse_local_pod(_pod(**{"metadata.creationTimestamp": "2026-01-01T00:01:00Z"}), NODE)
    assert (pod.uid, pod.namespace, pod.name, pod.phase) == ("uid-default-p", "default", "p", "Pending")
    assert pod.created == 1767225660.0


MALFORMED = [
    pytest.param({"spec": {}}, id="no-metadata"),
    pytest.param(_pod(**{"metadata.uid": ""}), id="no-uid"),
    pytest.param(_pod(**{"spec.containers": "x"}), id="containers-not-a-list"),
    pytest.param(_pod(**{"spec.containers": _limits(("a", "two"))}), id="limit-not-integer"),
    pytest.param(_pod(**{"spec.containers": _limits(("a", "-1"))}), id="limit-negative"),
    pytest.param(_pod(**{"metadata.creationTimestamp": "yesterday"}), id="bad-timestamp"),
]


@pytest.mark.parametrize("bad", MALFORMED)
def test_malformed_pod_is_skipped_with_one_log_line(bad: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gputopo.agent.pods"):
        view = StaticLocalPods(NODE, [bad, pod_object("good", [3])])
        view.set_objects([bad, pod_object("good", [3])])
    assert [p.name for p in view.pods()] == ["good"]
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1


def test_unreadable_placement_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    obj = _pod()
    obj["metadata"]["annotations"][PLACEMENT_ANNOTATION] = "{bad"
    with caplog.at_level(logging.WARNING, logger="gputopo.agent.pods"):
        view = StaticLocalPods(NODE, [obj])
        view.set_objects([obj])
    (pod,) = view.pods()
    assert pod.placement is None
    assert len([r for r in caplog.records if "placement" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("phase", "listed"),
    [
        pytest.param("Pending", True, id="pending"),
        pytest.param("Running", True, id="running"),
        pytest.param("", True, id="no-phase-yet"),
        pytest.param("Succeeded", False, id="succeeded"),
        pytest.param("Failed", False, id="failed"),
    ],
)
def test_terminated_pods_are_not_listed(phase: str, listed: bool) -> None:
    view = StaticLocalPods(NODE, [pod_object("p", [0], phase=phase)])
    assert (view.get("default", "p") is not None) is listed
    assert [p.name for p in view.pods()] == (["p"] if listed else [])


# --------------------------------------------------------------------------------------------------
# list + watch


def _with_rv(obj: dict[str, Any], rv: int) -> dict[str, Any]:
    obj["metadata"]["resourceVersion"] = str(rv)
    return obj


class FakeSource:
    """A PodSource whose watch replays queued items: (type, obj), an exception to raise, or 'end'."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] = []
        self.rv = 10
        self.lists = 0
        self.watches: list[str] = []
        self.list_fails = 0
        self.closed = False
        self._queue: list[Any] = []
        self._cond = threading.Condition()

    def push(self, *items: Any) -> None:
        with self._cond:
            self._queue.extend(items)
            self._cond.notify_all()

    def list_pods(self, node: str) -> tuple[list[dict[str, Any]], str]:
        assert node == NODE
        self.lists += 1
        if self.list_fails:
            self.list_fails -= 1
            raise ConnectionError("api server down")
        return list(self.objects), str(self.rv)

    def watch_pods(
        self, node: str, resource_version: str, timeout_seconds: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        self.watches.append(resource_version)
        while True:
            with self._cond:
                while not self._queue and not self.closed:
                    self._cond.wait(0.05)
                if self.closed:
                    return
                item = self._queue.pop(0)
            if item == "end":
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


@pytest.fixture
def source() -> FakeSource:
    return FakeSource()


def _view(source: FakeSource) -> KubeLocalPods:
    view = KubeLocalPods(NODE, source, pacing=Pacing(backoff=Backoff(base_s=0.01, cap_s=0.05)))
    wait_for(view.synced.is_set, what="first list")
    return view


def _names(view: KubeLocalPods) -> list[str]:
    return sorted(p.name for p in view.pods())


def test_watch_events_are_applied(source: FakeSource) -> None:
    source.objects = [_with_rv(pod_object("a", [0]), 5)]
    view = _view(source)
    try:
        assert _names(view) == ["a"]
        source.push(("ADDED", _with_rv(pod_object("b", [1]), 11)))
        wait_for(lambda: _names(view) == ["a", "b"], what="b added")
        source.push(("MODIFIED", _with_rv(pod_object("a", [0], phase="Succeeded"), 12)))
        wait_for(lambda: _names(view) == ["b"], what="a terminated")
        source.push(
            ("DELETED", _with_rv(pod_object("b", [1]), 13)), ("BOOKMARK", {"metadata": {"resourceVersion": "14"}})
        )
        wait_for(lambda: _names(view) == [], what="b deleted")
        source.push(
            {"type": "junk"} and ("ADDED", {"metadata": "not an object"}), ("ADDED", _with_rv(pod_object("c"), 15))
        )
        wait_for(lambda: _names(view) == ["c"], what="malformed skipped, c added")
    finally:
        view.close()
    assert source.closed


@pytest.mark.parametrize(
    ("failure", "relists"),
    [
        pytest.param(Gone(410, "too old"), 2, id="410-gone-relists"),
        pytest.param(ConnectionError("reset"), 1, id="error-backs-off-and-watches-again"),
        pytest.param("end", 1, id="watch-timeout-watches-again"),
    ],
)
def test_watch_recovers(source: FakeSource, failure: Any, relists: int) -> None:
    view = _view(source)
    try:
        source.objects = [_with_rv(pod_object("late", [2]), 20)]
        source.rv = 20
        source.push(failure)
        wait_for(lambda: len(source.watches) >= 2, what="a second watch")
        if relists == 2:
            wait_for(lambda: _names(view) == ["late"], what="relisted view")
            assert source.watches[-1] == "20"
        else:
            assert source.watches[-1] == "10"
        assert view.relists == relists
    finally:
        view.close()


def test_list_failures_back_off_until_the_api_answers(source: FakeSource) -> None:
    source.list_fails = 3
    view = _view(source)
    view.close()
    assert source.lists == 4


def test_refresh_lists_now_and_older_watch_events_do_not_undo_it(source: FakeSource) -> None:
    view = _view(source)
    try:
        source.objects = [_with_rv(pod_object("new", [0]), 30)]
        source.rv = 30
        view.refresh()
        assert _names(view) == ["new"]
        # An event the list already includes arrives late from the watch: it must not resurrect the old state.
        source.push(("DELETED", _with_rv(pod_object("new", [0]), 25)), ("ADDED", _with_rv(pod_object("x", [1]), 31)))
        wait_for(lambda: "x" in _names(view), what="newer event applied")
        assert _names(view) == ["new", "x"]
    finally:
        view.close()


def test_refresh_failure_keeps_the_view(source: FakeSource) -> None:
    source.objects = [_with_rv(pod_object("a", [0]), 5)]
    view = _view(source)
    try:
        source.list_fails = 1
        view.refresh()
        assert _names(view) == ["a"]
    finally:
        view.close()


def test_close_stops_the_thread(source: FakeSource) -> None:
    view = _view(source)
    view.close()
    assert not view._thread.is_alive()
