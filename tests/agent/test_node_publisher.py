"""Publishing: change detection, labels, Lease heartbeats, retries with backoff."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.labels import node_labels
from gputopo.agent.nodepublisher import (
    LeaseSpec,
    LeaseTerms,
    Publisher,
    desired_metadata,
    metadata_changes,
)
from gputopo.kube import Backoff, Kube, KubeError, is_retryable
from gputopo.kube import retry as call_with_retry
from gputopo.model import (
    GPUS_IN_USE_ANNOTATION,
    LABEL_GPU_MEMORY_GIB,
    LABEL_NVLINK_DOMAIN,
    LABEL_NVLINK_FABRIC,
    LABEL_NVSWITCH,
    LABEL_RDMA,
    TOPOLOGY_ANNOTATION,
    DegradedLink,
    GpusInUse,
    LinkState,
    NodeTopology,
    NvlinkInfo,
    agent_lease_name,
    parse_topology,
)
from gputopo.systems import build_system
from tests.agent.memory_api import InMemoryNodeApi

NODE = "gpu-07"
NS = "gputopo-system"


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.delays.append(seconds)
        return False  # never told to stop


class WallClock:
    def __init__(self) -> None:
        self.t = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.t += timedelta(seconds=30)
        return self.t


def make(api: InMemoryNodeApi | None = None) -> tuple[Publisher, InMemoryNodeApi, Sleeps]:
    api = api or InMemoryNodeApi(NODE, annotations={"other/keep": "x"}, labels={"gputopo.io/network-leaf": "leaf-3"})
    sleeps = Sleeps()
    return Publisher(api, NODE, LeaseTerms(NS, 120, WallClock()), sleep=sleeps), api, sleeps


def with_link_down(topo: NodeTopology, gpu: int, link: int) -> NodeTopology:
    links = [list(r) for r in topo.nvlink.links]
    for j in range(len(links)):
        if j != gpu:
            links[gpu][j] -= 1
            links[j][gpu] -= 1
    nvlink = NvlinkInfo(
        generation=topo.nvlink.generation,
        gbps_per_link=topo.nvlink.gbps_per_link,
        nvswitch=topo.nvlink.nvswitch,
        links=tuple(tuple(r) for r in links),
    )
    down = DegradedLink(gpu=gpu, link=link, state=LinkState.DOWN, detail="link not active")
    return topo.model_copy(update={"nvlink": nvlink, "degraded_links": (down,)})


H100 = build_system("dgx-h100", NODE)


def used(*other: int) -> GpusInUse:
    return GpusInUse(other=frozenset(other))


def test_first_publish_writes_annotations_and_labels_only_once() -> None:
    pub, api, _ = make()
    assert pub.publish(H100, used(0, 5)) is PublishResult.CHANGED
    assert pub.publish(H100, used(0, 5)) is PublishResult.UNCHANGED
    assert pub.publish(H100, used(5, 0)) is PublishResult.UNCHANGED
    assert api.calls["patch_node"] == 1
    assert parse_topology(api.annotations[TOPOLOGY_ANNOTATION]) == H100
    assert api.annotations[GPUS_IN_USE_ANNOTATION] == '{"version":2,"pods":{},"other":[0,5]}'
    assert {k: api.labels[k] for k in node_labels(H100)} == {
        LABEL_NVLINK_DOMAIN: "8",
        LABEL_NVSWITCH: "true",
        LABEL_RDMA: "infiniband",
        LABEL_GPU_MEMORY_GIB: "80",
    }
    assert api.annotations["other/keep"] == "x"  # other keys are never touched
    assert api.labels["gputopo.io/network-leaf"] == "leaf-3"


@pytest.mark.parametrize(
    ("after", "in_use_after", "patched_annotations"),
    [
        pytest.param(with_link_down(H100, 3, 5), used(0), {TOPOLOGY_ANNOTATION}, id="link down: topology only"),
        pytest.param(H100, used(0, 1), {GPUS_IN_USE_ANNOTATION}, id="pod takes a GPU: in-use only"),
        pytest.param(
            H100,
            GpusInUse(pods={"uid-a": frozenset({0})}),
            {GPUS_IN_USE_ANNOTATION},
            id="the GPU's pod becomes known: in-use only",
        ),
        pytest.param(H100, None, set(), id="in-use unknown: annotation left alone, no write"),
    ],
)
def test_a_change_patches_only_what_changed(
    after: NodeTopology, in_use_after: GpusInUse | None, patched_annotations: set[str]
) -> None:
    pub, api, _ = make()
    pub.publish(H100, used(0))
    result = pub.publish(after, in_use_after)
    assert result is (PublishResult.CHANGED if patched_annotations else PublishResult.UNCHANGED)
    if patched_annotations:
        assert set(api.patches[-1][0]) == patched_annotations
        assert api.patches[-1][1] == {}  # labels did not change
    assert len(api.patches) == (2 if patched_annotations else 1)


def test_unchanged_per_pod_truth_makes_no_node_write() -> None:
    """The same truth built in another order is the same bytes: no write, also after re-verifying."""
    ticks = [0.0]
    api = InMemoryNodeApi(NODE)
    pub = Publisher(api, NODE, LeaseTerms(NS, 120), sleep=Sleeps(), reverify_s=60.0, monotonic=lambda: ticks[0])
    first = GpusInUse(pods={"uid-b": frozenset({3, 2}), "uid-a": frozenset({0, 1})}, other=frozenset({7}))
    again = GpusInUse(pods={"uid-a": frozenset({1, 0}), "uid-b": frozenset({2, 3})}, other=frozenset({7}))
    assert pub.publish(H100, first) is PublishResult.CHANGED
    for t in (10.0, 70.0, 200.0):  # 70 and 200 are past reverify_s: the Node is read back, not written
        ticks[0] = t
        assert pub.publish(H100, again) is PublishResult.UNCHANGED
    assert api.calls["patch_node"] == 1
    assert api.calls["read_node"] == 3
    assert api.annotations[GPUS_IN_USE_ANNOTATION] == first.to_annotation() == again.to_annotation()


def test_label_change_is_published() -> None:
    pub, api, _ = make()
    pub.publish(build_system("dgx-1v", NODE), used())
    pub.publish(H100, used())
    assert api.patches[-1][1][LABEL_NVLINK_DOMAIN] == "8"
    assert api.labels[LABEL_NVLINK_DOMAIN] == "8"


def test_same_json_with_other_spacing_is_not_a_change() -> None:
    api = InMemoryNodeApi(NODE)
    _, labels = desired_metadata(H100, used(2))
    pretty = json.dumps(json.loads(H100.to_annotation()), indent=2)
    in_use = json.dumps(json.loads(used(2).to_annotation()), indent=1)
    api.annotations = {TOPOLOGY_ANNOTATION: pretty, GPUS_IN_USE_ANNOTATION: in_use}
    api.labels = dict(labels)
    pub, _, _ = make(api)
    assert pub.publish(H100, used(2)) is PublishResult.UNCHANGED
    assert api.calls["patch_node"] == 0


def test_the_fabric_label_follows_the_tray_and_is_removed_when_it_stops_reporting() -> None:
    pub, api, _ = make()
    assert pub.publish(build_system("gb200-tray", NODE), used()) is PublishResult.CHANGED
    assert api.labels[LABEL_NVLINK_FABRIC] == "healthy"
    assert pub.publish(build_system("gb200-tray-degraded", NODE), used()) is PublishResult.CHANGED
    assert api.labels[LABEL_NVLINK_FABRIC] == "degraded"
    assert pub.publish(H100, used()) is PublishResult.CHANGED
    assert LABEL_NVLINK_FABRIC not in api.labels
    assert api.patches[-1][1][LABEL_NVLINK_FABRIC] is None  # a merge patch's null removes it
    assert api.labels["gputopo.io/network-leaf"] == "leaf-3"  # the operator's labels stay
    assert pub.publish(H100, used()) is PublishResult.UNCHANGED


def test_a_node_without_the_fabric_label_gets_no_patch_to_remove_it() -> None:
    pub, api, _ = make()
    pub.publish(H100, used())
    assert LABEL_NVLINK_FABRIC not in api.patches[0][1]
    api.labels[LABEL_NVLINK_FABRIC] = "unknown"  # left by an earlier agent, or set by hand
    fresh, _, _ = make(api)
    assert fresh.publish(H100, used()) is PublishResult.CHANGED
    assert api.patches[-1] == ({}, {LABEL_NVLINK_FABRIC: None})
    assert LABEL_NVLINK_FABRIC not in api.labels


def test_metadata_changes_ignores_foreign_labels() -> None:
    from gputopo.agent.nodepublisher import NodeMeta

    current = NodeMeta(annotations={}, labels={"gputopo.io/network-spine": "a"})
    ann, lab = metadata_changes(current, {}, {"gputopo.io/network-spine": "b", LABEL_RDMA: "none"})
    assert (ann, lab) == ({}, {LABEL_RDMA: "none"})


def test_heartbeat_creates_then_renews_the_lease_and_never_touches_the_node() -> None:
    pub, api, _ = make()
    assert pub.heartbeat()
    first = api.leases[(NS, agent_lease_name(NODE))]
    assert pub.heartbeat()
    second = api.leases[(NS, "gputopo-agent-gpu-07")]
    assert (api.calls["create_lease"], api.calls["renew_lease"]) == (1, 2)
    assert second.renew_time > first.renew_time
    assert second == LeaseSpec(holder=NODE, renew_time=second.renew_time, duration_s=120)
    assert api.calls["read_node"] == api.calls["patch_node"] == 0


@pytest.mark.parametrize(
    ("errors", "result", "sleeps"),
    [
        pytest.param([KubeError(500, "")] * 2, PublishResult.CHANGED, [0.5, 1.0], id="two 500s then success"),
        pytest.param([KubeError(429, "")], PublishResult.CHANGED, [0.5], id="throttled once then success"),
        pytest.param([ConnectionRefusedError()], PublishResult.CHANGED, [0.5], id="connection refused is retried"),
        pytest.param([KubeError(503, "")] * 4, PublishResult.ERROR, [0.5, 1.0, 2.0], id="gives up after 4 tries"),
        pytest.param([KubeError(403, "")], PublishResult.ERROR, [], id="403 forbidden is not retried"),
    ],
)
def test_api_errors_retried_with_exponential_backoff(
    errors: list[BaseException], result: PublishResult, sleeps: list[float]
) -> None:
    pub, api, slept = make()
    api.fail_next = list(errors)
    assert pub.publish(H100, used()) is result  # never raises
    assert slept.delays == sleeps
    assert (TOPOLOGY_ANNOTATION in api.annotations) is (result is PublishResult.CHANGED)


def test_heartbeat_failure_is_reported_not_raised() -> None:
    pub, api, slept = make()
    api.fail_next = [KubeError(500, "")] * 4
    assert pub.heartbeat() is False
    assert slept.delays == [0.5, 1.0, 2.0]
    assert pub.heartbeat() is True


def test_retry_stops_when_told_to_stop() -> None:
    calls = []

    def fail() -> None:
        calls.append(1)
        raise KubeError(500, "")

    with pytest.raises(KubeError):
        call_with_retry(fail, Backoff(), lambda _s: True, "x")
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (KubeError(500, ""), True),
        (KubeError(409, ""), True),
        (KubeError(422, ""), False),
        (KubeError(404, ""), False),
        (TimeoutError(), True),
    ],
    ids=["server error", "conflict", "invalid", "not found", "timeout"],
)
def test_is_retryable(error: BaseException, retry: bool) -> None:
    assert is_retryable(error) is retry


def test_backoff_is_capped() -> None:
    assert Backoff(base_s=1, factor=3, cap_s=5, attempts=5).delays() == [1, 3, 5, 5]


def _renewed_by_another(api: InMemoryNodeApi) -> None:
    key = (NS, agent_lease_name(NODE))
    api.leases[key] = LeaseSpec(NODE, api.leases[key].renew_time + timedelta(seconds=1), 120)


def _gone(api: InMemoryNodeApi) -> None:
    del api.leases[(NS, agent_lease_name(NODE))]


@pytest.mark.parametrize(
    ("meanwhile", "lease_left"),
    [
        pytest.param(lambda _api: None, False, id="its own last renewal: deleted"),
        pytest.param(_renewed_by_another, True, id="renewed by a successor since: kept"),
        pytest.param(_gone, False, id="already gone: nothing to do"),
    ],
)
def test_release_lease_deletes_only_the_lease_this_agent_last_renewed(
    meanwhile: Callable[[InMemoryNodeApi], None], lease_left: bool
) -> None:
    pub, api, slept = make()
    assert pub.heartbeat()
    meanwhile(api)
    assert pub.release_lease() is True
    assert ((NS, agent_lease_name(NODE)) in api.leases) is lease_left
    assert api.calls["delete_lease"] == 1 and slept.delays == []  # 404 and 409 are not retried
    assert api.calls["read_node"] == api.calls["patch_node"] == 0


def test_release_lease_without_a_heartbeat_calls_nothing() -> None:
    pub, api, _ = make()
    assert pub.release_lease() is True
    assert sum(api.calls.values()) == 0


@pytest.mark.parametrize(
    ("stopping", "calls", "sleeps"),
    [
        pytest.param(False, 4, [0.5, 1.0, 2.0], id="running: retried with backoff"),
        pytest.param(True, 1, [0.5], id="stop signal set: one try"),
    ],
)
def test_release_lease_failure_is_reported_not_raised(stopping: bool, calls: int, sleeps: list[float]) -> None:
    delays: list[float] = []

    def sleep(seconds: float) -> bool:
        delays.append(seconds)
        return stopping

    api = InMemoryNodeApi(NODE)
    pub = Publisher(api, NODE, LeaseTerms(NS, 120, WallClock()), sleep=sleep)
    assert pub.heartbeat()
    api.fail_next = [KubeError(503, "")] * 4
    assert pub.release_lease() is False
    assert (api.calls["delete_lease"], delays) == (calls, sleeps)
    assert (NS, agent_lease_name(NODE)) in api.leases


@pytest.mark.parametrize(
    ("stored_renew", "expected"),
    [
        pytest.param("2026-01-02T03:04:05.678900Z", ["GET", "DELETE"], id="unchanged: deleted on its version"),
        pytest.param("2026-01-02T03:04:35.000000Z", ["GET"], id="renewed since: 409, not deleted"),
    ],
)
def test_kube_node_api_deletes_the_lease_only_at_the_version_it_read(
    tmp_path: Path, stored_renew: str, expected: list[str]
) -> None:
    from gputopo.agent.nodepublisher import KubeNodeApi
    from tests.kube.test_kube_layer import FakeApiServer, Reply, write_kubeconfig

    server = FakeApiServer()
    try:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{agent_lease_name(NODE)}"
        lease = {
            "metadata": {"name": agent_lease_name(NODE), "resourceVersion": "41"},
            "spec": {"renewTime": stored_renew},
        }
        server.replies = [Reply(200, lease), Reply(200, {"kind": "Status", "status": "Success"})]
        api = KubeNodeApi(Kube(write_kubeconfig(tmp_path / "kubeconfig", server.url)))
        when = datetime(2026, 1, 2, 3, 4, 5, 678900, tzinfo=UTC)
        if expected == ["GET"]:
            with pytest.raises(KubeError) as err:
                api.delete_lease(NS, agent_lease_name(NODE), when)
            assert err.value.status == 409
        else:
            api.delete_lease(NS, agent_lease_name(NODE), when)
        assert [(s.method, s.path) for s in server.seen] == [(m, path) for m in expected]
        if "DELETE" in expected:
            assert server.seen[1].body == {"preconditions": {"resourceVersion": "41"}}
    finally:
        server.close()
