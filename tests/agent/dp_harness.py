"""A device plugin on a real unix socket and small stand-ins for the kubelet's Registration and
PodResources services."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gputopo.agent.deviceplugin import api_pb2, api_pb2_grpc
from gputopo.agent.deviceplugin.devices import DeviceListStrategy
from gputopo.agent.deviceplugin.plugin import DevicePlugin, PluginConfig
from gputopo.agent.deviceplugin.preferred import PreferredAllocation
from gputopo.agent.podresources import api_pb2 as pr_pb2
from gputopo.agent.podresources import api_pb2_grpc as pr_grpc
from gputopo.agent.pods import StaticLocalPods
from gputopo.model import PLACEMENT_ANNOTATION, NodeTopology, Placement
from gputopo.systems import build_system

NODE = "gpu-node-1"
T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout_s: float = 10.0, what: str = "condition") -> T:
    """Poll `check` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def topology(system: str = "dgx-1v") -> NodeTopology:
    return build_system(system, NODE)


def with_gpu(topo: NodeTopology, index: int, **changes: object) -> NodeTopology:
    """`topo` with GPU `index` changed (health, reasons, numaNode...)."""
    gpus = tuple(g.model_copy(update=changes) if g.index == index else g for g in topo.gpus)
    return topo.model_copy(update={"gpus": gpus})


def pod_object(
    name: str,
    gpus: Sequence[int] | None = None,
    *,
    containers: Sequence[tuple[str, int]] = (),
    init: Sequence[tuple[str, int]] = (),
    node: str = NODE,
    created: str = "2026-01-01T00:00:00Z",
    phase: str = "Pending",
    namespace: str = "default",
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod object bound to this node; `gpus` set → a placement on `node`; containers default to one."""
    if not containers:
        containers = (("main", len(gpus) if gpus is not None else 1),)
    ann = dict(annotations or {})
    if gpus is not None:
        ann[PLACEMENT_ANNOTATION] = Placement(node=node, gpus=tuple(gpus), score=1, reason="test").to_annotation()

    def spec(cs: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
        return [{"name": c, "resources": {"limits": {"nvidia.com/gpu": str(n)}}} for c, n in cs]

    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "creationTimestamp": created,
            "annotations": ann,
        },
        "spec": {"nodeName": NODE, "containers": spec(containers), "initContainers": spec(init)},
        "status": {"phase": phase},
    }


class FakeKubelet(api_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    """The kubelet's Registration endpoint on `<dir>/kubelet.sock`; records every RegisterRequest."""

    def __init__(self, plugin_dir: Path) -> None:
        self.dir = plugin_dir
        self.requests: list[api_pb2.RegisterRequest] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def Register(self, request: api_pb2.RegisterRequest, context: Any) -> api_pb2.Empty:
        with self._lock:
            self.requests.append(request)
        return api_pb2.Empty()

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.dir / 'kubelet.sock'}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        (self.dir / "kubelet.sock").unlink(missing_ok=True)

    def restart(self) -> None:
        """What a kubelet restart does to the directory: every socket removed, then kubelet.sock anew."""
        self.stop()
        for p in self.dir.glob("*.sock"):
            p.unlink()
        self.start()


class Harness:
    def __init__(self, plugin: DevicePlugin, kubelet: FakeKubelet, pods: StaticLocalPods, socket: Path) -> None:
        self.plugin = plugin
        self.kubelet = kubelet
        self.pods = pods
        self.socket = socket
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.stub = api_pb2_grpc.DevicePluginStub(self.channel)

    def preferred(self, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        req = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available), must_include_deviceIDs=list(must), allocation_size=size
                )
            ]
        )
        resp = self.stub.GetPreferredAllocation(req, timeout=10)
        return list(resp.container_responses[0].deviceIDs)

    def allocate(self, *containers: Sequence[str]) -> api_pb2.AllocateResponse:
        req = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(c)) for c in containers]
        )
        resp: api_pb2.AllocateResponse = self.stub.Allocate(req, timeout=10)
        return resp


@contextmanager
def running_plugin(
    plugin_dir: Path,
    topo: NodeTopology | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
    *,
    strategy: DeviceListStrategy = DeviceListStrategy.ENVVAR,
    mode: PreferredAllocation = PreferredAllocation.PLACEMENT,
    kubelet: bool = True,
    podresources: Path | None = None,
) -> Iterator[Harness]:
    fake = FakeKubelet(plugin_dir)
    if kubelet:
        fake.start()
    local = StaticLocalPods(NODE, pods)
    config = PluginConfig(
        plugin_dir=plugin_dir,
        device_list_strategy=strategy,
        preferred_allocation=mode,
        poll_s=0.02,
        podresources_socket=podresources,
    )
    plugin = DevicePlugin(config, local)
    plugin.start(topo or topology())
    assert plugin.server is not None
    h = Harness(plugin, fake, local, plugin.server.socket_path)
    try:
        yield h
    finally:
        h.channel.close()
        plugin.stop()
        fake.stop()


@dataclass
class PodResourcesKubelet(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    pods: list[Any] = field(default_factory=list)
    allocatable: list[Any] | None = None  # None: answer UNIMPLEMENTED like an old kubelet
    list_calls: int = 0
    allocatable_calls: int = 0
    socket: Path | None = None

    def List(self, request: Any, context: Any) -> Any:
        self.list_calls += 1
        return pr_pb2.ListPodResourcesResponse(pod_resources=self.pods)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        self.allocatable_calls += 1
        if self.allocatable is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetAllocatableResources is not served")
        return pr_pb2.AllocatableResourcesResponse(devices=self.allocatable)


@contextmanager
def serve_podresources(socket_path: Path) -> Iterator[PodResourcesKubelet]:
    servicer = PodResourcesKubelet(socket=socket_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield servicer
    finally:
        server.stop(grace=None).wait()
