"""The Event poster's flush is a barrier: it returns once every Event submitted before it was posted or failed,
whichever of the posting threads holds it; an Event that failed counts as done."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from gputopo.extender.verbs.events import EventPoster
from gputopo.kube import KubeError
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS

HELD = "held"  # the pod whose Event the source holds until the test releases it


class GatedSource(FakeSource):
    """Holds the post of `HELD`'s Event until `release` is set; `fail` makes a post raise instead."""

    def __init__(self) -> None:
        super().__init__(NS)
        self.release = threading.Event()
        self.started = threading.Event()  # the held post began
        self.fail: Callable[[str], Exception | None] = lambda _name: None

    def create_event(self, namespace: str, event: JSON) -> None:
        pod = event["involvedObject"]["name"]
        if pod == HELD:
            self.started.set()
            assert self.release.wait(30), "the test never released the held Event"
        error = self.fail(pod)
        if error is not None:
            raise error
        super().create_event(namespace, event)


@pytest.fixture
def source() -> Iterator[GatedSource]:
    s = GatedSource()
    yield s
    s.release.set()  # never leave a posting thread waiting


def _posted(source: FakeSource) -> list[str]:
    return sorted(e["involvedObject"]["name"] for e in source.events)


def test_flush_waits_for_an_event_still_posting_on_the_other_thread(source: GatedSource) -> None:
    poster = EventPoster(lambda: source)
    poster.placed(NS, HELD, "uid-held", "placed")
    assert source.started.wait(10)
    poster.placed(NS, "quick", "uid-quick", "placed")  # the second thread is free: posted at once
    # A no-op queued behind the quick Event would run now; the barrier still waits for the held one.
    with pytest.raises(TimeoutError):
        poster.flush(timeout=0.2)
    source.release.set()
    poster.flush(timeout=10)
    assert _posted(source) == [HELD, "quick"]
    poster.close()


def test_flush_returns_once_every_earlier_event_was_posted_or_failed(source: GatedSource) -> None:
    failures: dict[str, Exception] = {
        "refused": KubeError(403, "events is forbidden", "Forbidden"),
        "broken": RuntimeError("not a KubeError"),
    }
    source.fail = failures.get
    poster = EventPoster(lambda: source)
    source.release.set()
    for name in ("a", "refused", "broken", "b", HELD):
        poster.placed(NS, name, f"uid-{name}", "placed")
    poster.flush(timeout=10)
    assert _posted(source) == ["a", "b", HELD]
    poster.flush(timeout=10)  # nothing pending: returns at once
    poster.close()


def test_each_flush_waits_for_what_was_submitted_before_it(source: GatedSource) -> None:
    poster = EventPoster(lambda: source)
    poster.placed(NS, "first", "uid-first", "placed")
    poster.flush(timeout=10)  # the barrier for "first"
    poster.placed(NS, HELD, "uid-held", "placed")
    assert source.started.wait(10)
    with pytest.raises(TimeoutError):
        poster.flush(timeout=0.2)  # the held Event was submitted before this flush: waited for
    assert _posted(source) == ["first"]
    source.release.set()
    poster.close()
    assert _posted(source) == ["first", HELD]  # close flushes what is queued first
