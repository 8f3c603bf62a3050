"""The device plugin over its real unix socket: devices and health, Allocate per strategy, registration with a
stand-in kubelet (first start, kubelet restart, our socket removed, stale socket), MIG refusal."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gputopo.agent.deviceplugin import api_pb2
from gputopo.agent.deviceplugin.devices import DeviceListStrategy, MigModeError
from gputopo.agent.deviceplugin.plugin import DevicePlugin, PluginConfig
from gputopo.agent.deviceplugin.preferred import PreferredAllocation, Preferrer
from gputopo.agent.deviceplugin.servicer import DevicePluginServicer
from gputopo.agent.nvml_backend import MIG_REASON, NvmlAdapter
from gputopo.agent.pods import StaticLocalPods
from gputopo.engine.node.besteffort import best_effort
from gputopo.model import Health
from tests.agent.dp_harness import NODE, running_plugin, topology, wait_for, with_gpu
from tests.agent.fake_pynvml import fake_system


def _devices(resp: api_pb2.ListAndWatchResponse) -> dict[str, tuple[str, list[int]]]:
    return {d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in resp.devices}


@pytest.mark.parametrize(
    ("change", "health", "numa"),
    [
        pytest.param({}, "Healthy", [1], id="healthy-gpu-with-numa"),
        pytest.param({"health": Health.FAILED}, "Unhealthy", [1], id="failed-gpu-unhealthy"),
        pytest.param({"health": Health.DEGRADED}, "Healthy", [1], id="degraded-gpu-still-healthy"),
        pytest.param({"numa_node": None}, "Healthy", [], id="numa-unknown-no-topology"),
        pytest.param({"numa_node": -1}, "Healthy", [], id="numa-negative-no-topology"),
    ],
)
def test_list_and_watch_reports_one_device_per_gpu(
    tmp_path: Path, change: dict[str, object], health: str, numa: list[int]
) -> None:
    base = topology()
    topo = with_gpu(base, 5, **{"numa_node": 1, **change})
    with running_plugin(tmp_path, topo) as h:
        first = next(h.stub.ListAndWatch(api_pb2.Empty(), timeout=10))
    devices = _devices(first)
    assert list(devices) == [g.uuid for g in topo.gpus]
    assert devices[topo.gpus[5].uuid] == (health, numa)


def test_degraded_nvlink_is_not_device_health(tmp_path: Path) -> None:
    from gputopo.model import DegradedLink, LinkState

    topo = topology().model_copy(update={"degraded_links": (DegradedLink(gpu=2, link=0, state=LinkState.DOWN),)})
    with running_plugin(tmp_path, topo) as h:
        first = next(h.stub.ListAndWatch(api_pb2.Empty(), timeout=10))
    assert {d.health for d in first.devices} == {"Healthy"}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param({"health": Health.FAILED}, "Unhealthy", id="gpu-fails"),
        pytest.param({"reasons": (MIG_REASON,)}, "Unhealthy", id="gpu-switched-to-mig"),
    ],
)
def test_list_and_watch_streams_health_changes(tmp_path: Path, change: dict[str, object], expected: str) -> None:
    topo = topology()
    with running_plugin(tmp_path, topo) as h:
        stream = h.stub.ListAndWatch(api_pb2.Empty(), timeout=10)
        assert _devices(next(stream))[topo.gpus[3].uuid][0] == "Healthy"
        h.plugin.update(topo)  # unchanged: nothing is streamed
        h.plugin.update(with_gpu(topo, 3, **change))
        second = _devices(next(stream))
        stream.cancel()
    assert second[topo.gpus[3].uuid][0] == expected
    assert [s for _, (s, _) in second.items()].count("Unhealthy") == 1


def test_options_offer_preferred_allocation(tmp_path: Path) -> None:
    with running_plugin(tmp_path) as h:
        opts = h.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        pre = h.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["x"]), timeout=10)
    assert opts.get_preferred_allocation_available and not opts.pre_start_required
    assert pre == api_pb2.PreStartContainerResponse()


def _envvar(resp: api_pb2.ContainerAllocateResponse, uuids: list[str]) -> None:
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids)}
    assert not resp.annotations and not resp.cdi_devices


def _cdi_annotations(resp: api_pb2.ContainerAllocateResponse, uuids: list[str]) -> None:
    ((key, value),) = resp.annotations.items()
    # container-device-interface's annotation key rule: prefix, then ≤ 63 chars, alphanumeric at both ends.
    assert re.fullmatch(r"cdi\.k8s\.io/gputopo-agent_[A-Za-z0-9][A-Za-z0-9_.-]*[A-Za-z0-9]", key)
    assert len(key.removeprefix("cdi.k8s.io/")) <= 63
    assert value == ",".join(f"nvidia.com/gpu={u}" for u in uuids)
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": "void"}


def _cdi_cri(resp: api_pb2.ContainerAllocateResponse, uuids: list[str]) -> None:
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={u}" for u in uuids]
    assert not resp.annotations
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": "void"}


@pytest.mark.parametrize(
    ("strategy", "check"),
    [
        pytest.param(DeviceListStrategy.ENVVAR, _envvar, id="envvar"),
        pytest.param(DeviceListStrategy.CDI_ANNOTATIONS, _cdi_annotations, id="cdi-annotations"),
        pytest.param(DeviceListStrategy.CDI_CRI, _cdi_cri, id="cdi-cri"),
    ],
)
def test_allocate_tells_the_container_toolkit_each_containers_gpus(
    tmp_path: Path, strategy: DeviceListStrategy, check: Callable[[api_pb2.ContainerAllocateResponse, list[str]], None]
) -> None:
    u = [g.uuid for g in topology().gpus]
    with running_plugin(tmp_path, strategy=strategy) as h:
        # Device order in the request does not matter: GPUs are listed in index order.
        resp = h.allocate([u[3], u[1]], [u[6]])
    assert len(resp.container_responses) == 2
    check(resp.container_responses[0], [u[1], u[3]])
    check(resp.container_responses[1], [u[6]])
    if strategy is DeviceListStrategy.CDI_ANNOTATIONS:
        keys = [next(iter(c.annotations)) for c in resp.container_responses]
        assert len(set(keys)) == 2


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(["GPU-not-here"], id="only-unknown"),
        pytest.param([None, "GPU-not-here"], id="known-and-unknown"),
        pytest.param(["GPU-6cf32200-9dd3-59a2-bda8-b0460febf76f::1"], id="replica-suffix"),
    ],
)
def test_allocate_unknown_device_is_invalid_argument(tmp_path: Path, ids: list[str | None]) -> None:
    u0 = topology().gpus[0].uuid
    request = [u0 if i is None else i for i in ids]
    bad = next(i for i in request if i != u0)
    with running_plugin(tmp_path) as h, pytest.raises(grpc.RpcError) as err:
        h.allocate(request)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad in (err.value.details() or "")


def test_registers_with_the_kubelet(tmp_path: Path) -> None:
    with running_plugin(tmp_path) as h:
        wait_for(lambda: h.kubelet.count() == 1, what="registration")
        (req,) = h.kubelet.requests
        assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "gputopo-gpu.sock", "nvidia.com/gpu")
        assert req.options.get_preferred_allocation_available
        assert h.socket == tmp_path / "gputopo-gpu.sock" and h.socket.is_socket()
    assert not h.socket.exists(), "stop() removes the socket"


def _kubelet_restarts(h: object) -> None:
    h.kubelet.restart()  # type: ignore[attr-defined]


def _kubelet_sock_recreated(h: object) -> None:
    h.kubelet.stop()  # type: ignore[attr-defined]
    h.kubelet.start()  # type: ignore[attr-defined]


def _our_socket_removed(h: object) -> None:
    h.socket.unlink()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("event", "reserved"),
    [
        pytest.param(_kubelet_restarts, True, id="kubelet-restart-removes-every-socket"),
        pytest.param(_kubelet_sock_recreated, False, id="kubelet-sock-recreated"),
        pytest.param(_our_socket_removed, True, id="our-socket-removed"),
    ],
)
def test_registers_again_and_serves_after(tmp_path: Path, event: Callable[[object], None], reserved: bool) -> None:
    with running_plugin(tmp_path) as h:
        wait_for(lambda: h.kubelet.count() == 1, what="first registration")
        assert h.plugin.server is not None
        serves = h.plugin.server.serves
        event(h)
        wait_for(lambda: h.kubelet.count() == 2, what="registration again")
        wait_for(lambda: h.socket.is_socket(), what="our socket")
        assert (h.plugin.server.serves > serves) is reserved
        # The kubelet dials the endpoint it was given: it must answer there.
        with grpc.insecure_channel(f"unix://{h.socket}") as ch:
            from gputopo.agent.deviceplugin import api_pb2_grpc

            opts = api_pb2_grpc.DevicePluginStub(ch).GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        assert opts.get_preferred_allocation_available
        assert h.kubelet.count() == 2, "registered once per kubelet.sock"


def test_registration_waits_for_the_kubelet(tmp_path: Path) -> None:
    with running_plugin(tmp_path, kubelet=False) as h:
        assert h.plugin.server is not None and not h.plugin.server.registered
        h.kubelet.start()
        # The kubelet counts the Register call before its answer reaches the plugin: wait for both.
        server = h.plugin.server
        wait_for(lambda: h.kubelet.count() == 1 and server.registered, what="registration once kubelet.sock appears")
        assert h.kubelet.count() == 1


def test_stale_socket_of_a_previous_agent_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "gputopo-gpu.sock"
    stale.write_text("left by a killed agent")
    with running_plugin(tmp_path) as h:
        assert h.socket.is_socket()
        assert h.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10).get_preferred_allocation_available


@pytest.mark.parametrize(
    ("resource", "socket"),
    [
        pytest.param("nvidia.com/gpu", "gputopo-gpu.sock", id="nvidia-gpu"),
        pytest.param("example.com/h100", "gputopo-h100.sock", id="other-resource"),
    ],
)
def test_socket_named_after_the_resource(tmp_path: Path, resource: str, socket: str) -> None:
    plugin = DevicePlugin(PluginConfig(resource_name=resource, plugin_dir=tmp_path, poll_s=0.02), StaticLocalPods(NODE))
    plugin.start(topology())
    try:
        assert (tmp_path / socket).is_socket()
    finally:
        plugin.stop()


@pytest.mark.parametrize("mig_gpus", [pytest.param([0], id="one-gpu"), pytest.param([2, 6], id="two-gpus")])
def test_mig_mode_refuses_to_start(tmp_path: Path, mig_gpus: list[int]) -> None:
    topo = topology()
    for i in mig_gpus:
        topo = with_gpu(topo, i, reasons=(MIG_REASON,))
    plugin = DevicePlugin(PluginConfig(plugin_dir=tmp_path), StaticLocalPods(NODE))
    with pytest.raises(MigModeError) as err:
        plugin.start(topo)
    for i in mig_gpus:
        assert f"{i} ({topo.gpus[i].uuid})" in str(err.value)
    assert not list(tmp_path.iterdir()), "nothing served"


def test_mig_gpu_discovered_through_nvml_refuses_to_start(tmp_path: Path) -> None:
    # The plugin recognises MIG by the reason the NVML backend writes, end to end through the adapter.
    fake = fake_system("dgx-a100")
    fake.gpus[4].mig = (1, 1)
    topo = NvmlAdapter(fake, sysfs_root=tmp_path / "sys").discover().topology
    plugin = DevicePlugin(PluginConfig(plugin_dir=tmp_path / "dp"), StaticLocalPods(NODE))
    with pytest.raises(MigModeError, match=re.escape(f"GPU 4 ({topo.gpus[4].uuid}) is in MIG mode")):
        plugin.start(topo)


class _Stream:
    """The gRPC context ListAndWatch needs, for calling the servicer directly."""

    def add_callback(self, fn: Callable[[], None]) -> bool:
        return True

    def is_active(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("quiet_s", "health"),
    [
        pytest.param(29.0, {"Healthy"}, id="discovery quiet for less than unhealthy-after: unchanged"),
        pytest.param(30.0, {"Unhealthy"}, id="quiet for unhealthy-after: every device unhealthy"),
    ],
)
def test_devices_go_unhealthy_when_no_discovery_succeeds_and_come_back_with_the_next(
    quiet_s: float, health: set[str]
) -> None:
    clock, topo = _Clock(), topology()
    preferrer = Preferrer(StaticLocalPods(NODE), PreferredAllocation.PLACEMENT, best_effort, None)
    servicer = DevicePluginServicer(topo, preferrer, unhealthy_after_s=30.0, clock=clock)
    stream = servicer.ListAndWatch(api_pb2.Empty(), _Stream())
    assert {d.health for d in next(stream).devices} == {"Healthy"}
    clock.now += quiet_s
    assert {"Healthy" if d.healthy else "Unhealthy" for d in servicer.devices()} == health
    if health == {"Unhealthy"}:
        assert {d.health for d in next(stream).devices} == {"Unhealthy"}  # streamed to the kubelet
        servicer.update(topo)  # discovery works again
        assert {d.health for d in next(stream).devices} == {"Healthy"}
    servicer.stop()
    assert list(stream) == []


def test_an_unreadable_gpu_is_the_only_unhealthy_device(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    fake.gpus[2].raises = {"nvmlDeviceGetPciInfo": OSError("sysfs read failed")}
    topo = NvmlAdapter(fake, sysfs_root=tmp_path / "sys").discover().topology
    with running_plugin(tmp_path, topo) as h:
        first = next(h.stub.ListAndWatch(api_pb2.Empty(), timeout=10))
    devices = _devices(first)
    assert devices.pop(topo.gpus[2].uuid)[0] == "Unhealthy"
    assert {health for health, _ in devices.values()} == {"Healthy"} and len(devices) == 7
