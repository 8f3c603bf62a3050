"""Faults on the real local stack: the API server restarted mid-stream, a watch expired (410), an agent
killed, the extender killed during a bind, the leading scheduler pod killed under a stream of pods.

After each, every pod ends bound and no GPU is held by two live pods (``checks.check_gpus``: what a
node reports per pod, else the pod's placement).
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from conftest import StackNodes
from gputopo.localcluster import APISERVER, TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.checks import check_gpus
from gputopo.localcluster.kube import KubeApiError
from gputopo.localcluster.stack import GpuNode, SchedulerPod, SchedulerPods, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement

pytestmark = pytest.mark.e2e

STALE_AFTER = 30.0  # seconds; agents heartbeat every second. Far longer than an API server restart on 2 busy cores.
HEARTBEAT = 1.0


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=STALE_AFTER, heartbeat_seconds=HEARTBEAT, interval_seconds=1),
    )
    s.start()
    yield s
    s.stop()


def gpu_pod(ns: str, test_id: str, name: str, gpus: int, scheduler: str = "gputopo-scheduler") -> dict[str, Any]:
    return pod_manifest(
        name,
        namespace=ns,
        gpus=gpus,
        annotations={"gputopo.io/nvlink": "required"},
        scheduling=PodScheduling(scheduler_name=scheduler, node_selector={TEST_LABEL: test_id}),
    )


def create_retrying(kube: KubeClient, manifest: dict[str, Any], timeout: float = 60.0) -> None:
    """Create a pod, retrying while the API server is unavailable (a client in a stream would)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kube.create_pod(manifest)
            return
        except KubeApiError as e:
            if e.status == 409:  # created by an attempt whose answer was lost
                return
            if time.monotonic() > deadline:
                raise
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)


def wait_until(check: Callable[[], bool], what: str, timeout: float) -> float:
    """Poll ``check`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - t0


def assert_every_pod_bound_once_and_no_gpu_held_twice(
    kube: KubeClient, ns: str, names: Sequence[str], node_names: Sequence[str], timeout: float = 120.0
) -> dict[str, tuple[str, frozenset[int]]]:
    kube.wait_pods_bound(ns, names, timeout=timeout)
    pods = kube.list_pods(ns)
    result = check_gpus(pods, [kube.get_node(n) for n in node_names])
    assert result.ok, result.summary()
    placed: dict[str, tuple[str, frozenset[int]]] = {}
    for pod in pods:
        p = parse_placement(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert p.node == pod["spec"]["nodeName"]
        placed[pod["metadata"]["name"]] = (p.node, frozenset(p.gpus))
    assert set(placed) == set(names)
    return placed


def filter_verdict(url: str, node: str, ns: str) -> str:
    """The extender's own answer for one node and a 1-GPU NVLink pod: "" if it passes, else why not."""
    pod = pod_manifest("probe", namespace=ns, gpus=1, scheduling=PodScheduling(scheduler_name="gputopo-scheduler"))
    pod["metadata"]["annotations"] = {"gputopo.io/nvlink": "required"}
    pod["metadata"]["uid"] = f"probe-{secrets.token_hex(4)}"
    body = json.dumps({"Pod": pod, "NodeNames": [node]}).encode()
    req = urllib.request.Request(f"{url}/filter", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        out = json.loads(r.read())
    if node in (out.get("NodeNames") or []):
        return ""
    failed = {**(out.get("FailedNodes") or {}), **(out.get("FailedAndUnresolvableNodes") or {})}
    return str(failed.get(node) or out.get("Error") or "no verdict")


# --------------------------------------------------------------------------- API server restart


def test_apiserver_restart_mid_stream_every_pod_ends_bound_and_no_gpu_is_double_booked(
    control_plane: ControlPlane, kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    names = nodes.add(*[GpuNode(f"f{i}", "dgx-h100") for i in range(3)])
    pods = [f"s{i}" for i in range(12)]  # 12 x 2 GPUs fill the 24 GPUs exactly
    for name in pods[:6]:
        kube.create_pod(gpu_pod(namespace, test_id, name, 2))
    control_plane.restart(APISERVER)
    for name in pods[6:]:
        create_retrying(kube, gpu_pod(namespace, test_id, name, 2))
    placed = assert_every_pod_bound_once_and_no_gpu_held_twice(kube, namespace, pods, names)
    assert sum(len(g) for _, g in placed.values()) == 24


# --------------------------------------------------------------------------- watch expired: 410 Gone


def _etcd(cp: ControlPlane, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{cp.etcd_port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def test_watch_expired_after_compaction_the_extender_relists_and_keeps_placing(
    control_plane: ControlPlane, kube: KubeClient, stack: Stack, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(*[GpuNode(f"f{i}", "dgx-h100") for i in range(1)])
    # The extender may still be relisting after the previous test's API server restart (with its backoff);
    # a pod it refused meanwhile would wait for kube-scheduler's next cluster event, which a quiet test
    # cluster does not make.
    url = stack.extender_url
    wait_until(lambda: filter_verdict(url, node, namespace) == "", "the extender to know the new node", 60)
    kube.create_pod(gpu_pod(namespace, test_id, "before", 4))
    kube.wait_pod_bound(namespace, "before", timeout=60)
    # Writes the extender does not watch move etcd's revision past the last one it saw; compacting
    # there makes every older resourceVersion unusable. The API server then dies without the
    # bookmarks of a graceful shutdown, and comes back with an empty watch cache: the extender's
    # watches resume from versions that are gone and get 410.
    for i in range(5):
        kube.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/configmaps",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"bump-{i}"}},
        )
    rev = int(_etcd(control_plane, "/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
    _etcd(control_plane, "/v3/kv/compaction", {"revision": rev, "physical": True})
    log = control_plane.log_path(stack.pods[0].extender)
    seen = log.read_text(errors="replace").count("410 Gone")
    control_plane.kill(APISERVER)
    control_plane.start_component(APISERVER)
    wait_until(lambda: log.read_text(errors="replace").count("410 Gone") > seen, "the extender to relist after 410", 90)
    kube.create_pod(gpu_pod(namespace, test_id, "after", 4))
    placed = assert_every_pod_bound_once_and_no_gpu_held_twice(kube, namespace, ["before", "after"], [node])
    assert placed["before"][1].isdisjoint(placed["after"][1]), "the relisted cache still knows the first pod"


# --------------------------------------------------------------------------- agent killed


def test_killed_agent_makes_its_node_stale_within_stale_after_and_fresh_again_when_back(
    control_plane: ControlPlane, stack: Stack, nodes: StackNodes, namespace: str
) -> None:
    (node,) = nodes.add(*[GpuNode(f"f{i}", "dgx-h100") for i in range(1)])
    url = stack.extender_url
    # The extender may still be relisting after an earlier test's API server restart (with its backoff).
    wait_until(lambda: filter_verdict(url, node, namespace) == "", "the extender to know the new node", 60)
    control_plane.kill(stack.agent_component(node))
    took = wait_until(lambda: "GPU topology stale" in filter_verdict(url, node, namespace), "stale", 60)
    # The Lease was renewed at most one heartbeat before the kill.
    assert took <= STALE_AFTER + HEARTBEAT + 3, f"stale only after {took:.1f}s"
    control_plane.start_component(stack.agent_component(node))
    wait_until(lambda: filter_verdict(url, node, namespace) == "", "the node to be fresh again", 60)


# --------------------------------------------------------------------------- extender killed during a bind


class HoldingProxy:
    """A TCP proxy in front of the API server. While ``holding``, bytes a client sends are kept back
    until ``release(forward)``: sent on (the request reaches the API server after its client died),
    or dropped with the connection (it never does)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.holding = False
        self.held: list[bytes] = []
        self._released = threading.Event()
        self._forward = True
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._released.clear()
        self.holding = True

    def release(self, *, forward: bool) -> None:
        self._forward = forward
        self.holding = False
        self._released.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=self._downstream, args=(server, client), daemon=True).start()

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                if self.holding:
                    with self._lock:
                        self.held.append(data)
                    self._released.wait()
                    if not self._forward:
                        self._close(client, server)
                        return
                server.sendall(data)
        except OSError:
            self._close(client, server)
        # The client is gone. The server side stays open until it answers (downstream closes it):
        # a closed connection would cancel the request it is still serving.

    def _downstream(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        self._close(client, server)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.release(forward=False)
        self.sock.close()
        with self._lock:
            self._close(*self._open)


class ProxiedExtenderStack(Stack):
    """The extender sidecar reaches the API server through a ``HoldingProxy``; its scheduler does not."""

    def __init__(self, *args: Any, proxy: HoldingProxy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proxy = proxy

    def extender_kubeconfig(self, pod: SchedulerPod) -> Path:
        path = super().extender_kubeconfig(pod)
        doc = json.loads(path.read_text())
        for cluster in doc["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.proxy.port}"
        proxied = path.with_name(f"{pod.extender}-proxied.kubeconfig")
        proxied.write_text(json.dumps(doc))
        proxied.chmod(0o600)
        return proxied


@pytest.mark.parametrize("binding_arrives", [True, False], ids=["binding-arrives-late", "binding-lost"])
def test_extender_killed_during_a_bind_the_pod_ends_bound_once_and_no_gpu_is_held_twice(
    control_plane: ControlPlane,
    kube: KubeClient,
    nodes: StackNodes,
    namespace: str,
    test_id: str,
    binding_arrives: bool,
) -> None:
    (node,) = nodes.add(*[GpuNode(f"f{i}", "dgx-h100") for i in range(1)])
    proxy = HoldingProxy(control_plane.apiserver_port)
    s = ProxiedExtenderStack(
        control_plane,
        kube,
        proxy=proxy,
        timing=StackTiming(stale_after_seconds=STALE_AFTER),
        scheduler=SchedulerPods(scheduler_name="gputopo-bindkill", extender_name="gputopo-extender-bindkill"),
    )
    try:
        s.start()
        # A first pod warms the extender's connection pool: the Binding below then travels on a kept-alive
        # connection (a new one would be held at its TLS handshake, before any request exists).
        kube.create_pod(gpu_pod(namespace, test_id, "warm", 2, scheduler="gputopo-bindkill"))
        kube.wait_pod_bound(namespace, "warm", timeout=60)
        kube.wait_pod_event(namespace, "warm", "TopologyPlacement", timeout=30)
        proxy.hold()
        kube.create_pod(gpu_pod(namespace, test_id, "first", 4, scheduler="gputopo-bindkill"))
        # The extender's only request after the pod appears is the Binding (its watches send nothing).
        wait_until(lambda: bool(proxy.held), "the extender to send the Binding", 60)
        assert not kube.get_pod(namespace, "first")["spec"].get("nodeName")
        control_plane.kill(s.pods[0].extender)
        proxy.release(forward=binding_arrives)
        uid = kube.get_pod(namespace, "first")["metadata"]["uid"]
        # Delivered or lost, the restarted extender must end with the pod bound once: kube-scheduler
        # retries a bind that failed, and a pod the late Binding already bound is not scheduled again.
        control_plane.start_component(s.pods[0].extender)
        kube.create_pod(gpu_pod(namespace, test_id, "second", 2, scheduler="gputopo-bindkill"))
        placed = assert_every_pod_bound_once_and_no_gpu_held_twice(kube, namespace, ["warm", "first", "second"], [node])
        assert kube.get_pod(namespace, "first")["metadata"]["uid"] == uid
        assert sum(len(g) for _, g in placed.values()) == 8
    except Exception as e:
        # This stack's processes are gone by the time the report's log tails are taken: say it here.
        raise AssertionError(f"{e}\n{_diagnosis(control_plane, kube, namespace, s)}") from e
    finally:
        s.stop()
        proxy.close()


def _diagnosis(cp: ControlPlane, kube: KubeClient, ns: str, s: Stack) -> str:
    lines = []
    for obj in kube.list_pods(ns):
        name = obj["metadata"]["name"]
        events = [f"{e.reason}: {e.message}" for e in kube.pod_events(ns, name)][-4:]
        placed = PLACEMENT_ANNOTATION in obj["metadata"].get("annotations", {})
        lines.append(f"pod {name}: nodeName={obj['spec'].get('nodeName')} placement={placed} events={events}")
    for pod in s.pods:
        for name in (pod.scheduler, pod.extender):
            if name in cp.components():
                lines.append(f"--- {name}:\n{cp.log_tail(name, 25)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- leader failover


def test_leader_failover_under_a_stream_of_pods_binds_every_pod_and_double_books_no_gpu(
    control_plane: ControlPlane, kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    names = nodes.add(*[GpuNode(f"f{i}", "dgx-h100") for i in range(4)])
    ha = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=STALE_AFTER),
        scheduler=SchedulerPods(
            scheduler_name="gputopo-ha",
            extender_name="gputopo-extender-ha",
            replicas=2,
            lease_name=f"gputopo-ha-{test_id[-6:]}",
        ),
    )
    try:
        ha.start()
        leader = ha.wait_leader()
        pods = [f"ha{i}" for i in range(16)]  # 16 x 2 GPUs fill the 32 GPUs exactly
        for name in pods[:6]:
            kube.create_pod(gpu_pod(namespace, test_id, name, 2, scheduler="gputopo-ha"))

        def bound() -> int:
            return sum(1 for p in kube.list_pods(namespace) if p["spec"].get("nodeName"))

        wait_until(lambda: bound() >= 3, "the leader to bind the first pods", 60)
        ha.kill_pod(leader)
        for name in pods[6:]:
            kube.create_pod(gpu_pod(namespace, test_id, name, 2, scheduler="gputopo-ha"))
        standby = ha.wait_leader(exclude=leader, timeout=90)
        assert standby != leader
        placed = assert_every_pod_bound_once_and_no_gpu_held_twice(kube, namespace, pods, names)
        assert sum(len(g) for _, g in placed.values()) == 32
    finally:
        ha.stop()
