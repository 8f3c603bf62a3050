"""End to end: clique-aware preemption with the real kube-scheduler's DefaultPreemption and the
extender's preempt verb (the chart's `scheduler.extender.preemptVerb: preempt`).

kube-scheduler picks victims by GPU count; gputopo keeps, per node, only victims that free a full
NVLink clique and never takes part of a gputopo group. A node whose free GPUs suffice by count but
hold no clique is FailedAndUnresolvable, so DefaultPreemption never meets kubernetes#135486's
"expected at least one victim" error there (no served release up to 1.37 carries the fix).

Victims are 1-GPU pods the same scheduler places; each wave is steered onto chosen GPUs by having
the agents report every other free GPU as in use, so each test decides which GPU every victim
holds. PriorityClasses come from the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import pytest
from workloads import bound_after_nudges

from conftest import serve
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.chart import RenderedChart, helm_binary, local_values, render
from gputopo.localcluster.kube import KubeApiError
from gputopo.localcluster.stack import GpuNode, SchedulerPods, Stack, StackTiming
from gputopo.model import GPUS_IN_USE_ANNOTATION, PLACEMENT_ANNOTATION, parse_gpus_in_use, parse_placement

pytestmark = pytest.mark.e2e

SCHEDULER = "gputopo-preempt"
ROLE = "e2e.gputopo.test/role"  # only nodes with role=target are the preemptor's to take
PRIORITIES = {"low": 10, "lower": 5, "mid": 100, "high": 1000}


class PreemptingStack(Stack):
    """The chart's layout with preemption calls enabled, as `--set scheduler.extender.preemptVerb=preempt`."""

    @property
    def chart(self) -> RenderedChart:
        if self._chart is None:
            values = local_values(scheduler_name=self.scheduler_name)
            values["scheduler"]["extender"] = {"preemptVerb": "preempt"}
            self._chart = render(helm_binary(self.cp.bin_dir), values, release=self.release, namespace=self.namespace)
        return self._chart


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    kube.apply(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": f"e2e-preempt-{name}"},
            "value": value,
        }
        for name, value in PRIORITIES.items()
    )
    yield from serve(
        PreemptingStack(
            control_plane,
            kube,
            timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=2, interval_seconds=1),
            scheduler=SchedulerPods(scheduler_name=SCHEDULER, extender_name="gputopo-extender-preempt"),
        )
    )


@pytest.fixture(scope="module")
def k8s_version(control_plane: ControlPlane) -> tuple[int, int, int]:
    return kubernetes_version(control_plane.bin_dir)


Wave = list[tuple[str, str, str | None]]  # (pod name, priority, group)


class Cluster:
    """This test's dgx-1v nodes, its victims and its preemptor; nodes removed afterwards."""

    def __init__(self, stack: Stack, kube: KubeClient, namespace: str, test_id: str) -> None:
        self.stack, self.kube, self.ns, self.test_id = stack, kube, namespace, test_id
        self.nodes: list[str] = []
        self.held: dict[str, set[int]] = {}

    def node(self, name: str, *, target: bool) -> str:
        full = f"{name}-{self.test_id[-6:]}"
        labels = {ROLE: "target" if target else "other"}
        self.stack.add_nodes([GpuNode(full, "dgx-1v", labels=labels)], extra_labels={TEST_LABEL: self.test_id})
        self.nodes.append(full)
        self.held[full] = set()
        self.stack.wait_published([full])
        return full

    def _report(self, other: Mapping[str, set[int]]) -> None:
        """Each node's agent reports `other[node]` in use (by something that is not a pod), published."""
        for node in self.nodes:
            self.stack.set_in_use(node, sorted(other[node]))
        for node in self.nodes:
            self.stack.wait_node_annotation(node, GPUS_IN_USE_ANNOTATION, _reports(other[node]))

    def place(self, gpus: Mapping[str, set[int]], wave: Wave) -> None:
        """Schedule 1-GPU pods (name, priority, group) onto exactly the GPUs `gpus` names per node."""
        self._report({n: set(range(8)) - gpus.get(n, set()) - self.held[n] for n in self.nodes})
        for name, priority, group in wave:
            ann = {"gputopo.io/nvlink": "required"}
            if group is not None:
                size = sum(g == group for *_, g in wave)
                # spread none: members may share a node; the steering decides where each lands
                ann |= {"gputopo.io/group": group, "gputopo.io/group-size": str(size), "gputopo.io/spread": "none"}
            pod = pod_manifest(
                name,
                namespace=self.ns,
                gpus=1,
                annotations=ann,
                scheduling=PodScheduling(scheduler_name=SCHEDULER, node_selector={TEST_LABEL: self.test_id}),
            )
            pod["spec"]["priorityClassName"] = f"e2e-preempt-{priority}"
            self.kube.create_pod(pod)
        landed = [placement(self.kube, self.ns, name) for name, *_ in wave]
        assert sorted((n, g[0]) for n, g in landed) == sorted((n, g) for n, gs in gpus.items() for g in gs)
        for n, g in landed:
            self.held[n].add(g[0])

    def settle(self) -> None:
        """From here on only the placed pods hold GPUs."""
        self._report({n: set() for n in self.nodes})

    def preemptor(self, name: str = "tp4-high") -> str:
        pod = pod_manifest(
            name,
            namespace=self.ns,
            gpus=4,
            annotations={"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(
                scheduler_name=SCHEDULER, node_selector={TEST_LABEL: self.test_id, ROLE: "target"}
            ),
        )
        pod["spec"]["priorityClassName"] = "e2e-preempt-high"
        self.kube.create_pod(pod)
        return name

    def gone(self, pods: list[str]) -> list[str]:
        """Those of `pods` the API server no longer has."""
        out = []
        for pod in pods:
            try:
                self.kube.get_pod(self.ns, pod)
            except KubeApiError as e:
                if e.status != 404:
                    raise
                out.append(pod)
        return out

    def cleanup(self) -> None:
        for name in self.nodes:
            self.stack.cp.remove(self.stack.agent_component(name), grace=2)
            try:
                self.kube.delete_node(name)
            except KubeApiError as e:
                if e.status != 404:
                    raise


def _reports(gpus: set[int]) -> Callable[[str | None], bool]:
    """A predicate on a node's gputopo.io/gpus-in-use: it says exactly `gpus` are in use."""
    return lambda value: value is not None and set(parse_gpus_in_use(value)) == gpus


@pytest.fixture
def cluster(stack: Stack, kube: KubeClient, namespace: str, test_id: str) -> Iterator[Cluster]:
    c = Cluster(stack, kube, namespace, test_id)
    yield c
    c.cleanup()


def wave(prefix: str, priority: str, count: int, group: str | None = None) -> Wave:
    return [(f"{prefix}-{i}", priority, group) for i in range(count)]


def names(w: Wave) -> list[str]:
    return [name for name, *_ in w]


# A preemptor can sit in kube-scheduler's unschedulable pool after its victims are gone: a retry that
# raced the victims' deletion starts a second, empty preemption that sends no delete event
# (kubernetes#141694, open on every served release); on 1.34 it was seen to wait past the 5-minute
# flush. On a real node the kubelet's and agent's Node updates after the victims leave are the event
# that retries it; these nodes have none, so the wait touches the target node's labels
# (`bound_after_nudges`), as such an update would.
PREEMPTOR_BIND_TIMEOUT = 480.0
# The test's own limit must outlast that wait (the suite's default per-test limit is 300 s).
OUTLASTS_THE_FLUSH = pytest.mark.timeout(PREEMPTOR_BIND_TIMEOUT + 180)


def placement(kube: KubeClient, ns: str, pod: str, timeout: float = 120) -> tuple[str, list[int]]:
    node = kube.wait_pod_bound(ns, pod, timeout=timeout)
    return placed(kube, ns, pod, node)


def preemptor_placement(kube: KubeClient, ns: str, pod: str, target: str) -> tuple[str, list[int]]:
    """The preemptor's node and GPUs once bound, touching `target`'s labels meanwhile (see above)."""
    node = bound_after_nudges(kube, ns, pod, target, timeout=PREEMPTOR_BIND_TIMEOUT)
    return placed(kube, ns, pod, node)


def placed(kube: KubeClient, ns: str, pod: str, node: str) -> tuple[str, list[int]]:
    p = parse_placement(kube.get_pod(ns, pod)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert p.node == node
    return node, list(p.gpus)


def preemption_failed(kube: KubeClient, ns: str, pod: str) -> str:
    """The FailedScheduling message once kube-scheduler tried preemption for the pod."""
    return kube.wait_pod_event(ns, pod, "FailedScheduling", contains="preemption", timeout=120).message


def no_preemption_error(stack: Stack) -> None:
    """kubernetes#135486's symptom never shows in the scheduler's log."""
    log = stack.cp.log_path(stack.pods[0].scheduler).read_text(errors="replace")
    assert "expected at least one victim" not in log


@OUTLASTS_THE_FLUSH
def test_preempt_evicts_the_lowest_priority_victims_that_free_a_full_quad(
    cluster: Cluster, kube: KubeClient, stack: Stack, k8s_version: tuple[int, int, int]
) -> None:
    # a: its four lowest-priority pods sit on GPUs 0,1,4,5, two per quad. kube-scheduler alone
    # prefers a (its highest victim priority, 5, is below b's 10) and would evict them for no quad.
    # b: its four low pods fill quad 0-3.
    a = cluster.node("a", target=True)
    b = cluster.node("b", target=True)
    a_lower, a_mid = wave("a-lower", "lower", 4), wave("a-mid", "mid", 4)
    b_low, b_mid = wave("b-low", "low", 4), wave("b-mid", "mid", 4)
    cluster.place({a: {0, 1, 4, 5}}, a_lower)
    cluster.place({a: {2, 3, 6, 7}}, a_mid)
    cluster.place({b: {0, 1, 2, 3}}, b_low)
    cluster.place({b: {4, 5, 6, 7}}, b_mid)
    cluster.settle()
    pod = cluster.preemptor()
    assert preemptor_placement(kube, cluster.ns, pod, b) == (b, [0, 1, 2, 3]), f"Kubernetes {k8s_version}"
    assert cluster.gone(names(a_lower + a_mid + b_low + b_mid)) == names(b_low)
    no_preemption_error(stack)


@OUTLASTS_THE_FLUSH
@pytest.mark.parametrize(
    "second_member",
    [
        pytest.param("same node", id="preempt takes a group wholly on the node together"),
        pytest.param("other node", id="preempt never takes a group member whose group runs elsewhere too"),
    ],
)
def test_preempt_takes_a_group_whole_or_not_at_all(
    cluster: Cluster, kube: KubeClient, stack: Stack, second_member: str
) -> None:
    # c's four low pods sit on quad 0-3, one (two when "same node") of them in group "pair".
    c = cluster.node("c", target=True)
    d = cluster.node("d", target=False)
    pair = wave("pair", "low", 2, group="pair")
    if second_member == "same node":
        cluster.place({c: {0, 1}}, pair)
        low = wave("c-low", "low", 2)
        cluster.place({c: {2, 3}}, low)
    else:
        cluster.place({c: {0}, d: {0}}, pair)
        low = wave("c-low", "low", 3)
        cluster.place({c: {1, 2, 3}}, low)
    mid = wave("c-mid", "mid", 4)
    cluster.place({c: {4, 5, 6, 7}}, mid)
    cluster.settle()
    pod = cluster.preemptor()
    if second_member == "same node":
        assert preemptor_placement(kube, cluster.ns, pod, c) == (c, [0, 1, 2, 3])
        assert cluster.gone(names(pair + low + mid)) == names(pair + low)
    else:
        assert "no candidate node for preemption" in preemption_failed(kube, cluster.ns, pod)
        assert cluster.gone(names(pair + low + mid)) == []
    no_preemption_error(stack)


def test_preempt_skips_a_node_whose_free_gpus_hold_no_quad(cluster: Cluster, kube: KubeClient, stack: Stack) -> None:
    # GPUs 2,3,6,7 free: four by count, no quad. kube-scheduler's dry run would find nothing to evict
    # and, before kubernetes#135486, fail the attempt; FailedAndUnresolvable keeps the node out.
    e = cluster.node("e", target=True)
    low = wave("e-low", "low", 4)
    cluster.place({e: {0, 1, 4, 5}}, low)
    cluster.settle()
    pod = cluster.preemptor()
    msg = preemption_failed(kube, cluster.ns, pod)
    assert "1 no free 4-GPU NVLink clique" in msg
    assert "Preemption is not helpful for scheduling" in msg
    assert cluster.gone(names(low)) == []
    no_preemption_error(stack)
