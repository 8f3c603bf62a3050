"""Simulated GPU nodes, nodes run by a real kubelet, and the gputopo agent that runs for each."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.kube import parse_time
from gputopo.localcluster.controlplane import ControlPlane
from gputopo.localcluster.kube import KubeApiError, KubeClient, SimNode
from gputopo.localcluster.kubelet import RealKubelet
from gputopo.localcluster.nvmlmock import PROFILE_ENV, Profile, build_library, profile_for_system, write_profile
from gputopo.model import (
    AGENT_COMPONENT,
    GPU_RESOURCE,
    TOPOLOGY_ANNOTATION,
    GpusInUse,
    NodeTopology,
    agent_lease_name,
)
from gputopo.model.dra import DRIVER as DRA_DRIVER
from gputopo.systems import build_system

if TYPE_CHECKING:
    from gputopo.localcluster.chart import RenderedChart


@dataclass
class GpuNode:
    """A simulated GPU node: a named system (`fixture`) or an explicit topology (file backend). With
    `nvml`, the agent reads the named system through nvidia-ml-py from the NVML mock library
    (`--backend nvml`), whose profile `NodeAgents.set_nvml_profile` changes under it."""

    name: str
    fixture: str | None = None
    topology: NodeTopology | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    in_use: Sequence[int] = ()
    nvml: bool = False

    def resolved(self) -> NodeTopology:
        if self.topology is not None:
            return self.topology
        return build_system(self.fixture or "dgx-h100", self.name)


@dataclass(frozen=True, kw_only=True)
class KubeletAgent:
    """How the agent of a node run by a real kubelet serves its GPUs: as the kubelet's device plugin
    (`preferred_allocation` mode, under `resource_name`), or with `dra` as the node's DRA driver (the
    list attribute when `dra_list_attributes`, in best-fit order when `dra_best_fit_order`, with the
    clique blocks when `dra_blocks`). With `nvml` it reads its system through nvidia-ml-py from the NVML
    mock library."""

    preferred_allocation: str = "placement"
    resource_name: str = GPU_RESOURCE
    dra: bool = False
    dra_list_attributes: bool = False
    dra_best_fit_order: bool = False
    dra_blocks: bool = False
    nvml: bool = False


DEVICE_PLUGIN_AGENT = KubeletAgent()


class NodeAgents:
    """The nodes-and-agents half of ``Stack``, split off to keep each concern readable.
    ``Stack.__init__`` sets the attributes declared below; ``Stack.chart`` names the agents' service account."""

    cp: ControlPlane
    kube: KubeClient
    namespace: str
    interval_seconds: float
    heartbeat_seconds: float
    nodes: dict[str, GpuNode]
    kubelets: dict[str, RealKubelet]
    _plugin_options: dict[str, tuple[str, str]]
    # kubelet nodes whose agent is the DRA driver -> (list attributes, best fit, blocks)
    _dra: dict[str, tuple[bool, bool, bool]]
    dir: Path
    _progress: Callable[[str], None] | None

    if TYPE_CHECKING:

        @property
        def chart(self) -> RenderedChart: ...

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)

    @staticmethod
    def _exe(name: str) -> str:
        """The console script next to this interpreter (the project's venv), else on PATH."""
        local = Path(sys.executable).with_name(name)
        if local.exists():
            return str(local)
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH; pip install -e .")
        return found

    def _token_kubeconfig(self, sa: str, name: str, *, bound_node: str | None = None) -> Path:
        token = self.kube.create_token(self.namespace, sa, bound_node=bound_node)
        return self.cp.write_kubeconfig(self.dir / f"{name}.kubeconfig", token=token, user=name)

    def _node_files(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.topology.json", self.dir / f"{name}.in-use.json"

    def nvml_profile_path(self, node: str) -> Path:
        return self.dir / f"{node}.nvml-profile"

    def set_nvml_profile(self, node: str, profile: Profile) -> None:
        """What the NVML mock library now reports to `node`'s agent (a link down, a GPU lost): the
        library reads the new profile on the agent's next call."""
        write_profile(self.nvml_profile_path(node), profile)

    def _nvml_agent(self, node: str) -> tuple[list[str], dict[str, str]]:
        """The flags and environment of an agent reading `node` through the NVML mock library."""
        n = self.nodes[node]
        path = self.nvml_profile_path(node)
        if not path.exists():
            self.set_nvml_profile(node, profile_for_system(n.fixture or "dgx-h100", node))
        sysfs = self.dir / f"{node}.sysfs"  # no NICs, no PCI NUMA files: the host's /sys is not the node's
        sysfs.mkdir(exist_ok=True)
        env = {"LD_LIBRARY_PATH": str(build_library()), PROFILE_ENV: str(path)}
        return ["--backend=nvml", f"--sysfs-root={sysfs}"], env

    def add_nodes(self, nodes: Sequence[GpuNode], *, extra_labels: Mapping[str, str] | None = None) -> None:
        """Create the Node objects (capacity from the topology), then start one agent per node."""
        sims = []
        for n in nodes:
            topo = n.resolved()
            self.nodes[n.name] = n
            topo_file, in_use_file = self._node_files(n.name)
            topo_file.write_text(topo.to_annotation())
            in_use_file.write_text(json.dumps(list(n.in_use)))
            sims.append(SimNode(name=n.name, gpus=len(topo.gpus), labels={**n.labels, **(extra_labels or {})}))
        self.kube.create_nodes(sims)
        for n in nodes:
            self.start_agent(n.name)

    def set_topology(self, node: str, topology: NodeTopology) -> None:
        """What `node`'s GPUs now are (a GPU failing, a link going down): its agent reads the file each
        interval. A kubelet node's agent, started on its fixture, is restarted once onto the file."""
        n = self.nodes[node]
        self._node_files(node)[0].write_text(topology.to_annotation())
        on_fixture = n.fixture is not None and n.topology is None
        n.topology = topology
        if on_fixture and self.agent_component(node) in self.cp.components():
            self.cp.remove(self.agent_component(node), grace=3)
            self.start_agent(node)

    def agent_component(self, node: str) -> str:
        return f"agent-{node}"

    def start_agent(self, node: str) -> None:
        n = self.nodes[node]
        topo_file, in_use_file = self._node_files(node)
        kubeconfig = self._token_kubeconfig(self.chart.agent_service_account, f"agent-{node}", bound_node=node)
        backend = f"fixture:{n.fixture}" if n.fixture and n.topology is None else f"file:{topo_file}"
        backend_args, env = self._nvml_agent(node) if n.nvml else ([f"--backend={backend}"], {})
        argv = [
            self._exe(AGENT_COMPONENT),
            f"--node-name={node}",
            f"--namespace={self.namespace}",
            *backend_args,
            *self._in_use_args(node, in_use_file),
            f"--interval-seconds={self.interval_seconds}",
            f"--heartbeat-seconds={self.heartbeat_seconds}",
            f"--kubeconfig={kubeconfig}",
            "--metrics-port=0",
        ]
        how = "nvml backend, through the NVML mock library" if n.nvml else f"{backend.split(':')[0]} backend"
        self._say(f"starting gputopo-agent for {node} ({how})")
        self.cp.start_process(self.agent_component(node), argv, ready=lambda: True, env=env)

    def _in_use_args(self, node: str, in_use_file: Path) -> list[str]:
        """A simulated node's agent reads GPUs in use from a file; a real kubelet's agent is its
        device plugin and reads them from the kubelet's PodResources."""
        kubelet = self.kubelets.get(node)
        if kubelet is None:
            return [f"--in-use-file={in_use_file}"]
        if node in self._dra:
            return [
                f"--podresources-socket={kubelet.podresources_socket}",
                "--dra",
                f"--dra-plugins-dir={kubelet.dra_plugins_dir}",
                f"--dra-registry-dir={kubelet.plugins_registry_dir}",
                f"--cdi-dir={kubelet.cdi_dir}",
                *(["--dra-list-attributes"] if self._dra[node][0] else []),
                *(["--dra-best-fit-order"] if self._dra[node][1] else []),
                *(["--dra-blocks"] if self._dra[node][2] else []),
            ]
        mode, resource = self._plugin_options[node]
        return [
            f"--podresources-socket={kubelet.podresources_socket}",
            "--device-plugin",
            f"--device-plugin-dir={kubelet.device_plugin_dir}",
            f"--resource-name={resource}",
            f"--preferred-allocation={mode}",
        ]

    def add_kubelet_node(
        self,
        name: str,
        system: str,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[str] = (),
        agent: KubeletAgent = DEVICE_PLUGIN_AGENT,
        timeout: float = 120.0,
    ) -> RealKubelet:
        """A node run by a real kubelet (``RealKubelet``, needs root) next to the simulated ones. Its
        agent has the fixture backend ``system`` (GPU UUIDs derived from the node name) and serves
        the kubelet as its device plugin. Returns once the kubelet advertises every GPU.

        With `agent.dra`, the agent is the node's DRA driver instead (`--dra`), and this returns once
        the node's ResourceSlice lists every GPU. With `agent.nvml`, the agent reads `system` through
        nvidia-ml-py from the NVML mock library instead."""
        kubelet = RealKubelet(self.cp, name, labels=labels, taints=taints, progress=self._progress)
        self.kubelets[name] = kubelet
        self._plugin_options[name] = (agent.preferred_allocation, agent.resource_name)
        dra = agent.dra
        if dra:
            self._dra[name] = (agent.dra_list_attributes, agent.dra_best_fit_order, agent.dra_blocks)
        self.nodes[name] = GpuNode(name, system, labels=dict(labels or {}), nvml=agent.nvml)
        kubelet.start(timeout=timeout)
        # The agent's token is bound to the Node object, which the kubelet has just registered.
        self.start_agent(name)
        gpus = len(self.nodes[name].resolved().gpus)
        if dra:
            self.wait_resource_slice(name, gpus, timeout=timeout)
        else:
            kubelet.wait_allocatable(agent.resource_name, gpus, timeout=timeout)
        return kubelet

    def resource_slices(self, node: str) -> list[dict[str, Any]]:
        """The ResourceSlices of gputopo's DRA driver on `node`."""
        out = self.kube.kubectl("get", "resourceslices", "-o", "json", f"--field-selector=spec.nodeName={node}")
        return [s for s in json.loads(out)["items"] if s["spec"].get("driver") == DRA_DRIVER]

    def wait_resource_slice(self, node: str, devices: int, *, timeout: float = 60.0) -> dict[str, Any]:
        """Until the node's agent has published `devices` single GPUs: one ResourceSlice with that many
        devices, or (`--dra-blocks`) the slice of its pool whose devices start with that many GPUs."""
        deadline = time.monotonic() + timeout
        last: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            last = self.resource_slices(node)
            if len(last) == 1 and len(last[0]["spec"].get("devices", [])) == devices:
                return last[0]
            for found in last if len(last) > 1 else []:
                names = [d["name"] for d in found["spec"].get("devices", [])]
                if sum(n.startswith("gpu-") for n in names) == devices:
                    return found
            time.sleep(0.5)
        raise TimeoutError(
            f"no ResourceSlice of {DRA_DRIVER} with {devices} devices on {node} in {timeout:.0f}s (saw {last}); "
            "agent log tail:\n" + self.cp.log_tail(self.agent_component(node), 30)
        )

    def set_preferred_allocation(self, node: str, mode: str) -> None:
        """Restart a kubelet node's agent with another ``--preferred-allocation`` mode."""
        self._plugin_options[node] = (mode, self._plugin_options[node][1])
        self.cp.remove(self.agent_component(node), grace=3)
        self.start_agent(node)

    def remove_kubelet_node(self, node: str) -> None:
        """Stop the node's agent and kubelet, and delete the Node."""
        if self.agent_component(node) in self.cp.components():
            self.cp.remove(self.agent_component(node), grace=3)
        kubelet = self.kubelets.pop(node, None)
        if kubelet is not None:
            kubelet.stop()
        self.nodes.pop(node, None)
        self._plugin_options.pop(node, None)
        self._dra.pop(node, None)
        try:
            self.kube.delete_node(node)
        except KubeApiError as e:
            if e.status != 404:
                raise

    def stop_agent(self, node: str) -> None:
        self.cp.stop(self.agent_component(node), grace=3)

    def set_in_use(
        self, node: str, gpus: Sequence[int] = (), *, pods: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        """What the kubelet would report as allocated; the agent republishes it within an interval.

        `gpus` alone writes the plain list (every GPU unattributed); with `pods` (pod UID to indices)
        it writes the per-pod version 2 form with `gpus` as `other`."""
        if pods is None:
            text = json.dumps(list(gpus))
        else:
            text = GpusInUse(pods={u: frozenset(g) for u, g in pods.items()}, other=frozenset(gpus)).to_annotation()
        self._node_files(node)[1].write_text(text)

    def wait_published(self, nodes: Sequence[str] | None = None, *, timeout: float = 60.0) -> None:
        """Until every node carries its topology annotation and its agent's Lease exists."""
        want = list(nodes or self.nodes)
        deadline = time.monotonic() + timeout
        missing: list[str] = want
        while time.monotonic() < deadline:
            missing = []
            for name in want:
                node = self.kube.get_node(name)
                if TOPOLOGY_ANNOTATION not in node.get("metadata", {}).get("annotations", {}):
                    missing.append(name)
                    continue
                try:
                    self.kube.request(
                        "GET",
                        f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{agent_lease_name(name)}",
                    )
                except KubeApiError:
                    missing.append(name)
            if not missing:
                return
            time.sleep(0.3)
        raise TimeoutError(f"agents did not publish within {timeout:.0f}s: {', '.join(missing)}")

    def wait_heartbeat(self, node: str, *, after: float, timeout: float = 30.0) -> None:
        """Until the agent's Lease was renewed later than `after` (epoch seconds)."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{agent_lease_name(node)}"
        deadline = time.monotonic() + timeout
        renewed = ""
        while time.monotonic() < deadline:
            try:
                renewed = str(self.kube.request("GET", path).get("spec", {}).get("renewTime") or "")
            except KubeApiError:
                renewed = ""
            if renewed and (parse_time(renewed) or 0.0) > after:
                return
            time.sleep(0.3)
        raise TimeoutError(f"agent of {node} did not renew its Lease within {timeout:.0f}s; last renewTime {renewed!r}")

    def wait_node_annotation(
        self, node: str, key: str, predicate: Callable[[str | None], bool], *, timeout: float = 30.0
    ) -> str | None:
        deadline = time.monotonic() + timeout
        value: str | None = None
        while time.monotonic() < deadline:
            value = self.kube.get_node(node).get("metadata", {}).get("annotations", {}).get(key)
            if predicate(value):
                return value
            time.sleep(0.3)
        raise TimeoutError(f"node {node} annotation {key} did not reach the expected value; last: {value!r}")

    def devices(self, node: str) -> list[dict[str, Any]]:
        """The devices gputopo's driver publishes on `node`, over its slices in name order (the allocator's)."""
        slices = sorted(self.resource_slices(node), key=lambda s: str(s["metadata"]["name"]))
        return [d for s in slices for d in s["spec"].get("devices") or []]
