"""GetPreferredAllocation over the real socket: which pod is being admitted, its placement slice as the answer,
best effort when there is no usable placement; the kubelet is played step by step (ask, then Allocate)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from gputopo.agent.deviceplugin.preferred import PreferredAllocation, pod_slices
from gputopo.agent.podresources import api_pb2 as pr_pb2
from gputopo.agent.pods import StaticLocalPods, parse_local_pod
from gputopo.engine.node.besteffort import best_effort
from tests.agent.dp_harness import NODE, Harness, pod_object, running_plugin, serve_podresources, topology

TOPO = topology()
U = [g.uuid for g in TOPO.gpus]
ALL = tuple(range(len(U)))
BE = "besteffort"


@dataclass(frozen=True)
class Step:
    """One kubelet request: available and must-include GPU indices, size; the answer expected."""

    available: Sequence[int]
    must: Sequence[int]
    size: int
    expect: Sequence[int] | str  # indices in answer order, or BE: what besteffort would pick
    allocate: Sequence[int] | None = None  # what the kubelet then allocates (default: the answer)


@dataclass(frozen=True)
class Case:
    pods: list[dict[str, Any]]
    steps: list[Step]
    mode: PreferredAllocation = PreferredAllocation.PLACEMENT
    allocate: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _t(second: int) -> str:
    return f"2026-01-01T00:00:{second:02d}Z"


def _best(available: Sequence[int], must: Sequence[int], size: int) -> list[int]:
    return list(best_effort(TOPO, sorted(available), sorted(must), size))


def _minus(*gone: int) -> tuple[int, ...]:
    return tuple(i for i in ALL if i not in gone)


CASES = {
    "two-pods-same-size-back-to-back-each-get-their-own": Case(
        pods=[pod_object("b", [0, 1], created=_t(2)), pod_object("a", [4, 5], created=_t(1))],
        steps=[Step(ALL, (), 2, [4, 5]), Step(_minus(4, 5), (), 2, [0, 1])],
    ),
    "promise-holds-even-before-allocate": Case(
        pods=[pod_object("a", [4, 5], created=_t(1)), pod_object("b", [0, 1], created=_t(2))],
        steps=[Step(ALL, (), 2, [4, 5]), Step(ALL, (), 2, [0, 1])],
        allocate=False,
    ),
    "placement-gpus-no-longer-available-best-effort": Case(
        pods=[pod_object("a", [0, 1], created=_t(1))],
        steps=[Step(_minus(1), (), 2, BE)],
    ),
    "pod-without-placement-best-effort": Case(
        pods=[pod_object("a", None, containers=[("main", 2)])],
        steps=[Step(ALL, (), 2, BE), Step(_minus(0, 3), (), 3, BE)],
    ),
    "must-include-from-init-container-honoured": Case(
        pods=[pod_object("a", [2, 3, 6, 7], containers=[("main", 4)], init=[("init", 2)])],
        steps=[Step(ALL, (), 2, [2, 3]), Step(ALL, (2, 3), 4, [2, 3, 6, 7])],
    ),
    "must-include-outside-the-placement-best-effort": Case(
        pods=[pod_object("a", [2, 3])],
        steps=[Step(ALL, (5,), 2, BE)],
    ),
    "placement-for-another-node-ignored": Case(
        pods=[pod_object("a", [4, 5], node="gpu-node-2")],
        steps=[Step(ALL, (), 2, BE)],
    ),
    "multi-container-pod-gets-its-slices-in-order": Case(
        pods=[pod_object("a", [7, 4, 5, 6], containers=[("c1", 1), ("c2", 3)])],
        steps=[Step(ALL, (), 1, [7]), Step(_minus(7), (), 3, [4, 5, 6])],
    ),
    "besteffort-mode-ignores-placements": Case(
        pods=[pod_object("a", [4, 7], created=_t(1))],
        steps=[Step(ALL, (), 2, BE)],
        mode=PreferredAllocation.BESTEFFORT,
    ),
    "running-pod-is-not-being-admitted": Case(
        pods=[pod_object("old", [0, 1], phase="Running", created=_t(0)), pod_object("new", [2, 5], created=_t(5))],
        steps=[Step(ALL, (), 2, [2, 5])],
    ),
    "pods-of-other-sizes-are-passed-over": Case(
        pods=[pod_object("pair", [0, 1], created=_t(0)), pod_object("three", [4, 5, 6], created=_t(5))],
        steps=[Step(ALL, (), 3, [4, 5, 6]), Step(_minus(4, 5, 6), (), 2, [0, 1])],
    ),
    "answered-older-pod-leaves-the-next-size-to-the-newer": Case(
        pods=[pod_object("big", [0, 1, 2, 3], created=_t(0)), pod_object("one", [6], created=_t(5))],
        steps=[Step(ALL, (), 4, [0, 1, 2, 3]), Step(_minus(0, 1, 2, 3), (), 1, [6])],
    ),
    "kubelet-allocating-elsewhere-still-uses-up-the-promise": Case(
        pods=[pod_object("a", [4, 5], created=_t(1)), pod_object("b", [0, 1], created=_t(2))],
        steps=[Step(ALL, (), 2, [4, 5], allocate=[6, 7]), Step(_minus(6, 7), (), 2, [0, 1])],
    ),
    "allocate-without-asking-marks-the-placement-answered": Case(
        pods=[pod_object("a", [4, 5], created=_t(1)), pod_object("b", [0, 1], created=_t(2))],
        steps=[Step(ALL, (), 2, [0, 1])],
        extra={"allocate_first": [4, 5]},
    ),
}


def _admit(h: Harness, step: Step, allocate: bool) -> list[int]:
    answer = h.preferred([U[i] for i in step.available], [U[i] for i in step.must], step.size)
    got = [U.index(d) for d in answer]
    if allocate:
        h.allocate([U[i] for i in (step.allocate if step.allocate is not None else got)])
    return got


@pytest.mark.parametrize("case", [pytest.param(c, id=k) for k, c in CASES.items()])
def test_preferred_allocation_follows_the_admitted_pods_placement(tmp_path: Path, case: Case) -> None:
    with running_plugin(tmp_path, TOPO, case.pods, mode=case.mode) as h:
        if "allocate_first" in case.extra:
            h.allocate([U[i] for i in case.extra["allocate_first"]])
        for n, step in enumerate(case.steps):
            got = _admit(h, step, case.allocate)
            want = _best(step.available, step.must, step.size) if step.expect == BE else list(step.expect)
            assert got == want, f"step {n}"


class LaggingPods(StaticLocalPods):
    """A view that shows its pods only after refresh(), as a watch that has not caught up yet."""

    def __init__(self, later: list[dict[str, Any]]) -> None:
        super().__init__(NODE)
        self._later = later

    def refresh(self) -> None:
        super().refresh()
        self.set_objects(self._later)


@pytest.mark.parametrize(
    ("later", "expect_refreshes"),
    [
        pytest.param([pod_object("a", [3, 4])], 1, id="pod-appears-after-refresh"),
        pytest.param([], 1, id="still-nothing-best-effort"),
    ],
)
def test_lagging_view_is_refreshed_once(tmp_path: Path, later: list[dict[str, Any]], expect_refreshes: int) -> None:
    with running_plugin(tmp_path, TOPO) as h:
        pods = LaggingPods(later)
        h.plugin.preferrer._pods = pods
        got = [U.index(d) for d in h.preferred(U, [], 2)]
    assert pods.refreshes == expect_refreshes
    assert got == ([3, 4] if later else _best(ALL, (), 2))


def test_no_refresh_when_a_pending_pod_without_placement_explains_the_request(tmp_path: Path) -> None:
    with running_plugin(tmp_path, TOPO, [pod_object("a", None, containers=[("main", 2)])]) as h:
        h.preferred(U, [], 2)
        assert h.pods.refreshes == 0


def test_promises_of_pods_that_left_are_forgotten(tmp_path: Path) -> None:
    a = pod_object("a", [4, 5], created=_t(1))
    with running_plugin(tmp_path, TOPO, [a, pod_object("b", [0, 1], created=_t(2))]) as h:
        assert [U.index(d) for d in h.preferred(U, [], 2)] == [4, 5]
        assert set(h.plugin.preferrer.promised()) == {"uid-default-a"}
        h.pods.set_objects([pod_object("b", [0, 1], created=_t(2))])
        assert [U.index(d) for d in h.preferred(U, [], 2)] == [0, 1]
        assert set(h.plugin.preferrer.promised()) == {"uid-default-b"}


@pytest.mark.parametrize(
    ("available", "must", "size", "fragment"),
    [
        pytest.param(ALL[:2], (), 3, "allocationSize 3", id="size-above-available"),
        pytest.param(ALL[:4], (5,), 2, "are not in availableDeviceIDs", id="must-not-available"),
        pytest.param(ALL, (0, 1, 2), 2, "allocationSize 2", id="must-above-size"),
    ],
)
def test_impossible_request_is_invalid_argument(
    tmp_path: Path, available: Sequence[int], must: Sequence[int], size: int, fragment: str
) -> None:
    with running_plugin(tmp_path, TOPO) as h, pytest.raises(grpc.RpcError) as err:
        h.preferred([U[i] for i in available], [U[i] for i in must], size)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (err.value.details() or "")


@pytest.mark.parametrize(
    ("pod", "slices"),
    [
        pytest.param(pod_object("a", [5, 1]), [("c:main", (5, 1)), ("p:1", (5,))], id="one-container"),
        pytest.param(
            pod_object("a", [3, 2, 1], containers=[("x", 2), ("y", 1)]),
            [("c:x", (3, 2)), ("c:y", (1,)), ("p:1", (3,)), ("p:3", (3, 2, 1))],
            id="two-containers-and-prefixes",
        ),
        pytest.param(pod_object("a", [0, 1], containers=[("main", 3)]), [], id="count-mismatch-unusable"),
        pytest.param(pod_object("a", [1, 1]), [], id="repeated-gpu-unusable"),
        pytest.param(pod_object("a", None), [], id="no-placement"),
    ],
)
def test_pod_slices(pod: dict[str, Any], slices: list[tuple[str, tuple[int, ...]]]) -> None:
    local, _ = parse_local_pod(pod, NODE)
    assert [(s.key, s.gpus) for s in pod_slices(local)] == slices


class BrokenPods(StaticLocalPods):
    def pods(self) -> list[Any]:
        raise RuntimeError("view broke")


def _raise_value_error(*_a: object) -> tuple[int, ...]:
    raise ValueError("best effort broke")


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param("pod-view-raises", id="pod-view-raises"),
        pytest.param("best-effort-raises", id="best-effort-raises"),
    ],
)
def test_internal_failure_still_answers_because_an_error_fails_admission(tmp_path: Path, breakage: str) -> None:
    with running_plugin(tmp_path, TOPO) as h:
        if breakage == "pod-view-raises":
            h.plugin.preferrer._pods = BrokenPods(NODE)
        else:
            h.plugin.preferrer._best = _raise_value_error
        answer = h.preferred([U[i] for i in (6, 2, 5, 7)], [U[5]], 3)
    assert len(set(answer)) == 3 and U[5] in answer
    assert set(answer) <= {U[i] for i in (6, 2, 5, 7)}


class KubeletView:
    """What the kubelet's PodResources `List` says: pod name → containers holding devices; None: unreadable."""

    def __init__(self) -> None:
        self.holds: dict[str, set[str]] | None = {}
        self.calls = 0

    def kubelet_pods(self) -> dict[tuple[str, str], frozenset[str]]:
        self.calls += 1
        if self.holds is None:
            raise RuntimeError("PodResources List failed: UNAVAILABLE")
        return {("default", name): frozenset(cs) for name, cs in self.holds.items()}


@dataclass(frozen=True)
class Admission:
    """The kubelet's pods at the time of one request, then the request."""

    holds: dict[str, set[str]] | None
    step: Step


PAIR_A = pod_object("a", [0, 3], created=_t(1))
PAIR_B = pod_object("b", [1, 2], created=_t(2))

ADMISSIONS = {
    "kubelet-reached-the-younger-pod-first": (
        [PAIR_A, PAIR_B],
        [
            Admission({"b": set()}, Step(ALL, (), 2, [1, 2])),
            Admission({"b": {"main"}, "a": set()}, Step(_minus(1, 2), (), 2, [0, 3])),
        ],
    ),
    "kubelet-reached-the-older-pod-first": (
        [PAIR_A, PAIR_B],
        [
            Admission({"a": set()}, Step(ALL, (), 2, [0, 3])),
            Admission({"a": {"main"}, "b": set()}, Step(_minus(0, 3), (), 2, [1, 2])),
        ],
    ),
    "a-pod-the-kubelet-has-not-reached-is-never-the-answer": (
        [PAIR_A, PAIR_B],
        [Admission({}, Step(ALL, (), 2, BE))],
    ),
    "unreadable-kubelet-falls-back-to-the-oldest-pending-pod": (
        [PAIR_A, PAIR_B],
        [Admission(None, Step(ALL, (), 2, [0, 3])), Admission(None, Step(_minus(0, 3), (), 2, [1, 2]))],
    ),
    # A restarted agent promised nothing yet; the kubelet says c1 already holds devices (not its placed ones).
    "container-the-kubelet-lists-with-devices-is-answered": (
        [pod_object("m", [0, 1, 4, 5], containers=[("c1", 2), ("c2", 2)])],
        [Admission({"m": {"c1"}}, Step(_minus(6, 7), (), 2, [4, 5]))],
    ),
}


@pytest.mark.parametrize(("pods", "admissions"), [pytest.param(*v, id=k) for k, v in ADMISSIONS.items()])
def test_the_kubelets_pod_list_names_the_pod_being_admitted(
    tmp_path: Path, pods: list[dict[str, Any]], admissions: list[Admission]
) -> None:
    view = KubeletView()
    with running_plugin(tmp_path, TOPO, pods) as h:
        h.plugin.preferrer._kubelet = view
        for n, a in enumerate(admissions):
            view.holds = a.holds
            got = _admit(h, a.step, allocate=True)
            want = _best(a.step.available, a.step.must, a.step.size) if a.step.expect == BE else list(a.step.expect)
            assert got == want, f"admission {n}"
    assert view.calls >= len(admissions)


def test_allocate_without_asking_answers_only_a_pod_the_kubelet_holds(tmp_path: Path) -> None:
    # Two pending pods placed on the same pair (the older one's placement went stale): the kubelet's
    # list says which of them took it.
    old = pod_object("old", [4, 5], created=_t(1))
    new = pod_object("new", [4, 5], created=_t(2))
    view = KubeletView()
    view.holds = {"new": set()}
    with running_plugin(tmp_path, TOPO, [old, new]) as h:
        h.plugin.preferrer._kubelet = view
        h.allocate([U[4], U[5]])
        assert h.plugin.preferrer.promised() == {"uid-default-new": {"c:main"}}


def test_the_plugin_asks_the_kubelets_podresources_socket(tmp_path: Path) -> None:
    # The kubelet reached the younger pod first: over its PodResources socket it lists only that one.
    sock = tmp_path / "pr.sock"
    with serve_podresources(sock) as kubelet, running_plugin(tmp_path, TOPO, [PAIR_A, PAIR_B], podresources=sock) as h:
        kubelet.pods = [
            pr_pb2.PodResources(name="b", namespace="default", containers=[pr_pb2.ContainerResources(name="main")])
        ]
        assert [U.index(d) for d in h.preferred(U, [], 2)] == [1, 2]
        assert kubelet.list_calls == 1
