"""The list+watch loops (the extender's `Informer` and the agent's `KubeLocalPods`, over the one core
`gputopo.kube.run_list_watch`) against a scripted loopback API server: repeated 410 Gone and watches
that end at once are spaced by growing, jittered, capped delays (client-go's reflector's figures),
a watch that ran a while starts the backoff afresh, and the relist counter counts. Delays are the ones
the loop chose (an injected sleep records them and ends the loop), never wall time."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.agent.pods import KubeLocalPods, KubePodSource
from gputopo.extender.app import create_listeners
from gputopo.extender.metrics import Metrics
from gputopo.extender.settings import Settings
from gputopo.extender.watch.source import Informer, Kind, KubeSource
from gputopo.kube import KIND_NAMES, REFLECTOR_BACKOFF, Backoff, Kube, Pacing
from tests.extender.fake import FakeSource
from tests.kube.scripted import (
    ENDS_AT_ONCE,
    GONE_EVENT,
    GONE_STATUS,
    JSON,
    WAIT_S,
    ScriptedApi,
    Watch,
    events,
    kubeconfig,
    line,
    status,
)

# client-go's reflector: 0.8 s doubling, capped at 30 s (before jitter).
GROWING = [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]


class Sleeps:
    """The loop's sleep: records each delay and tells the loop to stop after `n`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.delays.append(seconds)
        return len(self.delays) >= self.n


class Handler:
    """The cache's part of an informer; each applied event advances `clock` by `per_event_s`, so a
    watch that delivers one has run a while."""

    def __init__(self, per_event_s: float = 0.0) -> None:
        self.now = 0.0
        self.per_event_s = per_event_s
        self.names: set[str] = set()
        self.applied: list[str] = []

    def clock(self) -> float:
        return self.now

    def replace(self, kind: Kind, items: list[JSON]) -> None:
        self.names = {i["metadata"]["name"] for i in items}

    def apply(self, kind: Kind, event_type: str, obj: JSON) -> None:
        self.names.add(obj["metadata"]["name"])
        self.applied.append(obj["metadata"]["name"])
        self.now += self.per_event_s

    def not_served(self, kind: Kind) -> None:
        pass

    def heard_from_api(self) -> None:
        pass


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def api() -> Iterator[ScriptedApi]:
    server = ScriptedApi()
    yield server
    server.close()


@pytest.fixture
def source(api: ScriptedApi, tmp_path: Path) -> Iterator[KubeSource]:
    src = KubeSource(kubeconfig(tmp_path / "kubeconfig", api.url), "gputopo-system", request_timeout=5.0)
    yield src
    src.close()


def run_informer(inf: Informer, sleeps: Sleeps) -> None:
    """Run the informer's thread body until it has slept `sleeps.n` times (then it stops itself)."""
    thread = threading.Thread(target=inf.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(sleeps.delays) >= sleeps.n, f"{sleeps.n} waits")
    finally:
        inf.stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()


# ----------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    ("backoff", "failures", "r", "expected"),
    [
        pytest.param(REFLECTOR_BACKOFF, 0, 0.0, 0.8, id="first-wait-unjittered"),
        pytest.param(REFLECTOR_BACKOFF, 0, 1.0, 1.6, id="first-wait-fully-jittered"),
        pytest.param(REFLECTOR_BACKOFF, 3, 0.5, 6.4 * 1.5, id="fourth-wait-half-jittered"),
        pytest.param(REFLECTOR_BACKOFF, 6, 0.0, 30.0, id="capped"),
        pytest.param(REFLECTOR_BACKOFF, 6, 1.0, 60.0, id="capped-then-jittered-like-client-go"),
        pytest.param(REFLECTOR_BACKOFF, 10_000, 0.0, 30.0, id="hours-of-failures-stay-capped"),
        pytest.param(
            Backoff(base_s=1, factor=10, cap_s=5, jitter=0.25), 5_000, 1.0, 6.25, id="any-factor-overflows-to-cap"
        ),
    ],
)
def test_the_backoff_is_exponential_jittered_and_capped(
    backoff: Backoff, failures: int, r: float, expected: float
) -> None:
    assert backoff.jittered(failures, r) == pytest.approx(expected)


@given(failures=st.integers(0, 100_000), r=st.floats(0.0, 1.0), jitter=st.floats(0.0, 2.0))
def test_jitter_keeps_each_delay_within_d_and_d_times_one_plus_jitter(failures: int, r: float, jitter: float) -> None:
    backoff = Backoff(base_s=0.8, factor=2.0, cap_s=30.0, jitter=jitter)
    d = backoff.delay(failures)
    assert d == min(30.0, 0.8 * 2.0 ** min(failures, 64))
    assert d <= backoff.jittered(failures, r) <= d * (1 + jitter) + 1e-9


# ----------------------------------------------------------------------------------- the extender's informer


@pytest.mark.parametrize(
    ("failure", "lists"),
    [
        pytest.param(GONE_STATUS, len(GROWING), id="410-status-relists-after-each-wait"),
        pytest.param(GONE_EVENT, len(GROWING), id="410-error-event-relists-after-each-wait"),
        pytest.param(ENDS_AT_ONCE, 1, id="watches-that-end-at-once-wait-too"),
    ],
)
def test_repeated_watch_failures_are_spaced_by_growing_delays(
    api: ScriptedApi, source: KubeSource, failure: Watch, lists: int
) -> None:
    api.default_watch = failure
    sleeps = Sleeps(len(GROWING))
    inf = Informer(source, "pods", Handler(), pacing=Pacing(sleep=sleeps, rand=lambda: 0.0))
    run_informer(inf, sleeps)
    assert sleeps.delays == pytest.approx(GROWING)
    # A 410 waits before its relist (client-go's order): the last wait ended the loop before one.
    assert (api.lists, len(api.watched)) == (lists, len(GROWING))


GONE_AFTER_B = events("b", then=(line("ERROR", status(410)),))


@pytest.mark.parametrize(
    ("script", "event_s", "delays"),
    [
        pytest.param(
            [GONE_STATUS, GONE_STATUS, GONE_STATUS, events("b"), GONE_STATUS, GONE_STATUS],
            5.0,
            [0.8, 1.6, 3.2, 0.8, 1.6],
            id="a-watch-that-ends-well-resets",
        ),
        pytest.param(
            [ENDS_AT_ONCE, ENDS_AT_ONCE, events("b"), ENDS_AT_ONCE],
            5.0,
            [0.8, 1.6, 0.8],
            id="short-watches-then-a-long-one-resets",
        ),
        pytest.param(
            [Watch(status=500), Watch(status=500), events("b"), Watch(status=500)],
            5.0,
            [0.8, 1.6, 0.8],
            id="failed-watches-then-a-long-one-resets",
        ),
        pytest.param(
            [GONE_STATUS, GONE_STATUS, GONE_AFTER_B, GONE_STATUS],
            200.0,
            [0.8, 1.6, 0.8, 1.6],
            id="a-watch-that-got-410-after-minutes-resets",
        ),
        pytest.param(
            [GONE_STATUS, GONE_STATUS, GONE_AFTER_B, GONE_STATUS],
            5.0,
            [0.8, 1.6, 0.8, 1.6],
            id="a-watch-that-got-410-after-seconds-resets",
        ),
        pytest.param(
            [GONE_STATUS, GONE_STATUS, GONE_AFTER_B, GONE_STATUS],
            0.5,
            [0.8, 1.6, 3.2, 6.4],
            id="a-watch-that-got-410-within-a-second-does-not",
        ),
    ],
)
def test_a_healthy_watch_starts_the_backoff_afresh(
    api: ScriptedApi, source: KubeSource, script: list[Watch], event_s: float, delays: list[float]
) -> None:
    api.watches = deque(script)
    handler = Handler(per_event_s=event_s)  # a watch that delivers an event has run this long on the loop's clock
    sleeps = Sleeps(len(delays))
    inf = Informer(source, "pods", handler, pacing=Pacing(sleep=sleeps, clock=handler.clock, rand=lambda: 0.0))
    run_informer(inf, sleeps)
    assert sleeps.delays == pytest.approx(delays)
    assert handler.applied == ["b"]


@pytest.mark.parametrize("r", [0.0, 0.37, 0.999], ids=["no-jitter", "some-jitter", "most-jitter"])
def test_the_informer_jitters_each_delay_within_its_bounds(source: KubeSource, r: float) -> None:
    sleeps = Sleeps(len(GROWING))
    inf = Informer(source, "pods", Handler(), pacing=Pacing(sleep=sleeps, rand=lambda: r))
    run_informer(inf, sleeps)
    assert sleeps.delays == pytest.approx([d * (1 + r) for d in GROWING])
    assert all(d <= got <= 2 * d for d, got in zip(GROWING, sleeps.delays, strict=True))


def test_the_relist_counter_counts_each_list(api: ScriptedApi, source: KubeSource) -> None:
    metrics = Metrics(lambda: 0.0)
    sleeps = Sleeps(4)
    inf = Informer(source, "pods", Handler(), pacing=Pacing(sleep=sleeps), on_relist=metrics.relisted)
    run_informer(inf, sleeps)
    counted = metrics.registry.get_sample_value("gputopo_extender_relists_total", {"kind": "pods"})
    assert (api.lists, counted) == (4, 4)
    assert metrics.registry.get_sample_value("gputopo_extender_relists_total", {"kind": "nodes"}) == 0


def test_the_extenders_informers_feed_the_relist_counter() -> None:
    listeners = create_listeners(Settings(log_level="critical"), cluster=FakeSource(), watch_timeout_seconds=1)
    registry = listeners.prometheus.registry
    with listeners.running():
        for inf in listeners.informers:
            assert inf.synced.wait(WAIT_S)
        relists = "gputopo_extender_relists_total"
        counts = {kind: registry.get_sample_value(relists, {"kind": kind}) for kind in KIND_NAMES}
    assert all(n is not None and n >= 1 for n in counts.values()), counts


# ----------------------------------------------------------------------------------- the agent's pod view


@pytest.mark.parametrize(
    ("failure", "lists"),
    [
        pytest.param(GONE_STATUS, len(GROWING), id="410-relists-after-each-wait"),
        pytest.param(ENDS_AT_ONCE, 1, id="watches-that-end-at-once-wait-too"),
    ],
)
def test_the_agents_pod_view_backs_off_the_same_way(
    api: ScriptedApi, tmp_path: Path, failure: Watch, lists: int
) -> None:
    api.default_watch = failure
    kube = Kube(kubeconfig(tmp_path / "kubeconfig", api.url), request_timeout=5.0)
    sleeps = Sleeps(len(GROWING))
    view = KubeLocalPods("n1", KubePodSource(kube), pacing=Pacing(sleep=sleeps, rand=lambda: 0.0))
    try:
        wait_for(lambda: len(sleeps.delays) >= sleeps.n, f"{sleeps.n} waits")
    finally:
        view.close()
        kube.close()
    assert sleeps.delays == pytest.approx(GROWING)
    assert (api.lists, len(api.watched)) == (lists, len(GROWING))
