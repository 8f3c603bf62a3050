"""The local cluster's pod tracker runs on the project's one list+watch loop: a 410 relists, a failed
round waits its growing backoff instead of retrying hot, and the pods it keeps follow the watch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest

from gputopo.kube import Backoff, Gone, KubeError, Pacing, WatchEvent
from gputopo.localcluster.kube import KubeClient
from gputopo.localcluster.podwatch import PodTracker


def pod(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv}}


class FakeKube:
    """Lists once per call; each watch takes the next script entry: events, or an error to raise."""

    def __init__(self, script: list[list[WatchEvent] | Exception]) -> None:
        self.script = script
        self.lists = 0
        self.watches: list[str] = []

    def request(self, method: str, path: str) -> dict[str, Any]:
        self.lists += 1
        return {"items": [pod("a", "1")], "metadata": {"resourceVersion": str(self.lists)}}

    def watch(self, path: str, rv: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        self.watches.append(rv)
        step = self.script.pop(0) if self.script else []
        if isinstance(step, Exception):
            raise step
        yield from step


@pytest.mark.parametrize(
    ("script", "lists", "waits", "pods"),
    [
        pytest.param(
            [[WatchEvent("ADDED", pod("b", "5"))]], 2, 1, {"a", "b"}, id="events applied; a watch ending at once waits"
        ),
        pytest.param([Gone(410, "too old", "Expired")], 3, 2, {"a"}, id="410 Gone relists after a wait"),
        pytest.param(
            [KubeError(500, "boom", ""), KubeError(500, "boom", "")], 2, 3, {"a"}, id="failures wait a growing backoff"
        ),
    ],
)
def test_the_tracker_runs_on_the_one_list_watch_loop(
    script: list[list[WatchEvent] | Exception], lists: int, waits: int, pods: set[str]
) -> None:
    kube = FakeKube(script)
    waited: list[float] = []
    done = threading.Event()

    def sleep(s: float) -> bool:
        waited.append(s)
        if len(waited) >= waits:
            done.set()
            return True  # stop the loop: every round it had to run has run
        return False

    pacing = Pacing(backoff=Backoff(base_s=0.2, factor=2.0, cap_s=2.0), sleep=sleep, clock=lambda: 0.0)
    tracker = PodTracker(cast(KubeClient, kube), "ns", pacing=pacing)
    tracker.run()
    assert done.is_set()
    assert kube.lists == lists
    assert waited == sorted(waited) and waited[0] == pytest.approx(0.2)
    assert set(tracker.pods) == pods
