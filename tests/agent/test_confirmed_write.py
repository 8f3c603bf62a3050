"""The one publisher (`gputopo.agent.confirmedwrite.Confirmed`): write only what differs, confirm, re-verify.

First over a fake target, table-driven; then the same rules through its two real targets, the Node's
metadata (`Publisher`) and the ResourceSlice (`SlicePublisher`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from gputopo.agent.backends import NoneInUse
from gputopo.agent.confirmedwrite import CONFLICT_TRIES, Confirmed, PublishResult, retry_write
from gputopo.agent.dra.slices import SlicePublisher, SliceShape, slice_name
from gputopo.agent.metrics import AgentMetrics
from gputopo.agent.nodepublisher import LeaseTerms, NodeMeta, NodeMetaTarget, Publisher
from gputopo.agent.runner import Agent, Pacing
from gputopo.kube import Backoff, KubeError
from gputopo.model import Health, NodeTopology
from tests.agent.dp_harness import NODE, topology, with_gpu
from tests.agent.dra_harness import FakeSlices
from tests.agent.memory_api import InMemoryNodeApi

CONFLICT = KubeError(409, "the object has been modified", "Conflict")
FORBIDDEN = KubeError(403, "forbidden", "Forbidden")
UNAVAILABLE = KubeError(503, "unavailable", "ServiceUnavailable")


@dataclass
class FakeTarget:
    """A dict on a fake server: `read_errors`/`write_errors` are raised by the next calls, in order;
    `keep` is what the server makes of a write (a field it drops)."""

    stored: dict[str, Any] | None = None
    read_errors: list[Exception | None] = field(default_factory=list)
    write_errors: list[Exception | None] = field(default_factory=list)
    keep: Callable[[dict[str, Any]], dict[str, Any]] = dict
    reads: int = 0
    writes: int = 0
    what: str = "the fake"

    def comparable(self, desired: dict[str, Any]) -> dict[str, Any]:
        return dict(desired)

    def read(self) -> dict[str, Any] | None:
        self.reads += 1
        if self.read_errors and (e := self.read_errors.pop(0)) is not None:
            raise e
        return self.stored

    def holds(self, current: dict[str, Any] | None, want: Any) -> Any:
        return current

    def write(self, current: dict[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any]:
        if self.write_errors and (e := self.write_errors.pop(0)) is not None:
            raise e
        self.writes += 1
        self.stored = self.keep(desired)
        return dict(self.stored)


WANT = {"a": 1, "b": "x"}


@pytest.mark.parametrize(
    ("target", "result", "reads", "writes"),
    [
        pytest.param(FakeTarget(stored=dict(WANT)), PublishResult.UNCHANGED, 1, 0, id="unchanged-no-write"),
        pytest.param(FakeTarget(stored={"a": 2}), PublishResult.CHANGED, 1, 1, id="changed-one-write"),
        pytest.param(FakeTarget(), PublishResult.CHANGED, 1, 1, id="absent-created"),
        pytest.param(
            FakeTarget(stored={"a": 2}, write_errors=[CONFLICT]), PublishResult.CHANGED, 2, 1, id="conflict-reread"
        ),
        pytest.param(
            FakeTarget(stored={"a": 2}, write_errors=[CONFLICT] * CONFLICT_TRIES),
            PublishResult.ERROR,
            CONFLICT_TRIES,
            0,
            id="conflicts-bounded",
        ),
        pytest.param(FakeTarget(read_errors=[FORBIDDEN]), PublishResult.ERROR, 1, 0, id="read-error"),
        pytest.param(FakeTarget(stored={}, write_errors=[UNAVAILABLE]), PublishResult.ERROR, 1, 0, id="write-error"),
    ],
)
def test_one_publish(target: FakeTarget, result: PublishResult, reads: int, writes: int) -> None:
    pub = Confirmed(target, reverify_s=60.0, monotonic=lambda: 0.0)
    assert pub.publish(WANT) is result
    assert (target.reads, target.writes, pub.writes) == (reads, writes, writes)
    if result is not PublishResult.ERROR:
        assert target.stored == WANT


@pytest.mark.parametrize(
    ("first", "read_errors", "write_errors"),
    [
        pytest.param(PublishResult.ERROR, [FORBIDDEN], [], id="after-a-read-error"),
        pytest.param(PublishResult.ERROR, [], [UNAVAILABLE], id="after-a-write-error"),
        pytest.param(PublishResult.ERROR, [], [CONFLICT] * CONFLICT_TRIES, id="after-conflicts"),
        pytest.param(PublishResult.CHANGED, [], [], id="after-a-write"),
    ],
)
def test_the_next_round_reads_again_only_when_needed(
    first: PublishResult, read_errors: list[Exception | None], write_errors: list[Exception | None]
) -> None:
    target = FakeTarget(stored={"a": 2}, read_errors=list(read_errors), write_errors=list(write_errors))
    clock = [0.0]
    pub = Confirmed(target, reverify_s=60.0, monotonic=lambda: clock[0])
    assert pub.publish(WANT) is first
    reads = target.reads
    clock[0] = 10.0
    second = pub.publish(WANT)
    if first is PublishResult.ERROR:  # nothing was confirmed: read and write now
        assert second is PublishResult.CHANGED and target.reads == reads + 1 and target.stored == WANT
    else:  # confirmed recently: no API call at all
        assert second is PublishResult.UNCHANGED and target.reads == reads
    clock[0] = 100.0  # past reverify_s: one read, no write
    writes = target.writes
    assert pub.publish(WANT) is PublishResult.UNCHANGED
    assert target.writes == writes and target.reads == reads + (2 if first is PublishResult.ERROR else 1)


def test_reverify_reads_on_every_publish_for_its_window_and_repairs_a_deletion() -> None:
    target, clock = FakeTarget(), [0.0]
    pub = Confirmed(target, reverify_s=60.0, monotonic=lambda: clock[0])
    assert pub.publish(WANT) is PublishResult.CHANGED
    pub.reverify(5.0)
    target.stored = None  # deleted under us
    assert pub.publish(WANT) is PublishResult.CHANGED and target.writes == 2
    assert pub.publish(WANT) is PublishResult.UNCHANGED and target.reads == 3  # still in the window
    clock[0] = 6.0
    assert pub.publish(WANT) is PublishResult.UNCHANGED and target.reads == 3


def test_a_field_the_server_drops_costs_one_write_even_across_an_error() -> None:
    target = FakeTarget(keep=lambda d: {k: v for k, v in d.items() if k != "b"})
    clock = [0.0]
    pub = Confirmed(target, reverify_s=1.0, monotonic=lambda: clock[0])
    assert pub.publish(WANT) is PublishResult.CHANGED
    target.read_errors = [UNAVAILABLE]
    for t in (2.0, 4.0, 6.0):
        clock[0] = t
        pub.publish(WANT)
    assert target.writes == 1 and target.reads == 4  # the error lost nothing of what the server keeps


def test_retry_write_raises_a_conflict_at_once_and_retries_the_rest() -> None:
    calls: list[int] = []

    def failing(errors: list[Exception]) -> Callable[[], str]:
        def fn() -> str:
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return "ok"

        return fn

    backoff, never = Backoff(), lambda _s: False
    with pytest.raises(KubeError):
        retry_write(failing([CONFLICT]), backoff, never, "put")
    assert len(calls) == 1
    assert retry_write(failing([UNAVAILABLE]), backoff, never, "put") == "ok" and len(calls) == 3


# --------------------------------------------------------------------------------------------------
# The two targets


class ConflictingNodeApi(InMemoryNodeApi):
    """Its next `conflicts` patches meet a 409, as if someone wrote the Node between read and patch."""

    conflicts: int = 0

    def patch_node_meta(self, name: str, annotations: Any, labels: Any) -> None:
        if self.conflicts:
            self.conflicts -= 1
            self.calls["patch_node"] += 1
            raise CONFLICT
        super().patch_node_meta(name, annotations, labels)


def _node_publisher(api: InMemoryNodeApi) -> Publisher:
    return Publisher(api, NODE, LeaseTerms("ns", 120), sleep=lambda _s: True, monotonic=lambda: 0.0)


def _slice_publisher(api: FakeSlices) -> SlicePublisher:
    shape = SliceShape(list_attributes=False, device_taints=False)
    return SlicePublisher(api, NODE, shape, sleep=lambda _s: True, monotonic=lambda: 0.0)


def _node_case(conflicts: int, fail: list[BaseException]) -> tuple[Callable[[NodeTopology], PublishResult], Any]:
    api = ConflictingNodeApi(NODE)
    api.conflicts = conflicts
    api.fail_next = list(fail)
    pub = _node_publisher(api)
    return (lambda t: pub.publish(t, None)), (lambda: len(api.patches), lambda: api.calls["read_node"])


class ConflictingSlices(FakeSlices):
    """Someone writes the slice right after each of our next `conflicts` reads."""

    conflicts: int = 0
    fail_reads: tuple[BaseException, ...] = ()

    def get_slice(self, name: str) -> dict[str, Any] | None:
        if self.fail_reads:
            e, self.fail_reads = self.fail_reads[0], self.fail_reads[1:]
            raise e
        found = super().get_slice(name)
        if found is not None and self.conflicts:
            self.conflicts -= 1
            self._rv += 1
            self.slices[name]["metadata"]["resourceVersion"] = str(self._rv)
        return found


def _slice_case(conflicts: int, fail: list[BaseException]) -> tuple[Callable[[NodeTopology], PublishResult], Any]:
    api = ConflictingSlices()
    pub = _slice_publisher(api)
    if conflicts:  # a slice to replace, then the conflicts
        assert pub.publish(with_gpu(topology(), 0, health=Health.FAILED)) is PublishResult.CHANGED
        pub.reverify(1e9)
        api.writes, api.reads, api.conflicts = 0, 0, conflicts
    api.fail_reads = tuple(fail)
    return pub.publish, (lambda: api.writes, lambda: api.reads)


@pytest.mark.parametrize("case", [_node_case, _slice_case], ids=["node-metadata", "resourceslice"])
@pytest.mark.parametrize(
    ("conflicts", "fail", "results", "writes"),
    [
        pytest.param(0, [], [PublishResult.CHANGED, PublishResult.UNCHANGED], 1, id="changed-then-unchanged"),
        pytest.param(1, [], [PublishResult.CHANGED], 1, id="conflict-reread"),
        pytest.param(CONFLICT_TRIES, [], [PublishResult.ERROR, PublishResult.CHANGED], 1, id="conflicts-bounded"),
        pytest.param(0, [FORBIDDEN], [PublishResult.ERROR, PublishResult.CHANGED], 1, id="api-error-then-retried"),
    ],
)
def test_both_targets_follow_the_rules(
    case: Callable[..., Any], conflicts: int, fail: list[BaseException], results: list[PublishResult], writes: int
) -> None:
    publish, (count_writes, _count_reads) = case(conflicts, list(fail))
    topo = topology()
    assert [publish(topo) for _ in results] == results
    assert count_writes() == writes


def test_the_node_target_compares_json_as_values_and_ignores_other_keys() -> None:
    api = InMemoryNodeApi(NODE)
    assert _node_publisher(api).publish(topology(), None) is PublishResult.CHANGED
    target = NodeMetaTarget(api, NODE, lambda _s: True, Backoff())
    current = NodeMeta(annotations=dict(api.annotations), labels={**api.labels, "other": "x"})
    want = target.comparable(({k: v.replace(",", ", ") for k, v in api.annotations.items()}, dict(api.labels)))
    assert target.holds(current, want) == want


def test_the_slice_target_writes_once_per_change() -> None:
    api = FakeSlices()
    pub = _slice_publisher(api)
    assert pub.publish(topology()) is PublishResult.CHANGED
    pub.reverify(1e9)
    assert pub.publish(topology()) is PublishResult.UNCHANGED
    assert pub.publish(with_gpu(topology(), 1, health=Health.FAILED)) is PublishResult.CHANGED
    assert api.writes == 2 and slice_name(NODE) in api.slices


# --------------------------------------------------------------------------------------------------
# The loop publishes both openly


class FixedBackend:
    description = "fixed"

    def discover(self) -> NodeTopology:
        return topology()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("slice_fails", [False, True])
def test_each_cycle_publishes_the_node_then_the_dra_update(slice_fails: bool) -> None:
    api, calls = InMemoryNodeApi(NODE), []

    def dra_update(_topo: NodeTopology) -> PublishResult:
        calls.append(len(api.patches))  # the Node is published first
        if slice_fails:
            raise RuntimeError("boom")
        return PublishResult.UNCHANGED

    metrics = AgentMetrics()
    pacing = Pacing(10.0, 30.0, threading.Event())
    agent = Agent(FixedBackend(), NoneInUse(), _node_publisher(api), metrics, pacing, dra_update=dra_update)
    first, second = agent.cycle(), agent.cycle()
    assert (first.published, second.published) == (PublishResult.CHANGED, PublishResult.UNCHANGED)
    expected = PublishResult.ERROR if slice_fails else PublishResult.UNCHANGED
    assert (first.slice, second.slice) == (expected, expected) and calls == [1, 1]
    assert metrics.registry.get_sample_value("gputopo_agent_publish_total", {"result": "changed"}) == 1.0
