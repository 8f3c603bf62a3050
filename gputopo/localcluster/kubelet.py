"""A real, upstream kubelet as a node of the local control plane, with no container engine.

The kubelet built next to the control plane (``build_binaries.sh``) runs against ``fakecri``, the
fake CRI runtime that Kubernetes' own kubelet tests use: pods become Running without anything
being executed, while everything in front of the runtime is the real kubelet. In particular its
device manager registers device plugins, asks them ``GetPreferredAllocation`` and ``Allocate``
when it admits a pod, checkpoints the result and serves it over PodResources.

Root is needed. The kubelet's device-plugin directory is fixed at
``/var/lib/kubelet/device-plugins``, and it writes ``/var/log/pods``. So each kubelet runs in a
private mount namespace, where a directory of its own is bind-mounted over the fixed path and a
tmpfs covers ``/var/log``. A device plugin for this node serves in ``device_plugin_dir`` on the
host side. The only changes outside the control plane's directory are these:

- an empty ``/var/lib/kubelet/device-plugins`` is created if it is missing, to mount onto;
- the kubelet sets six kernel tunables, as it does on any node (``vm.overcommit_memory``,
  ``kernel.panic`` and others). ``stop()`` puts back the values found before the first start.

Processes are components of the ``ControlPlane`` (``kubelet-<node>``, ``fakecri-<node>``). Their
logs sit in its directory, and teardown stops them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gputopo.kube import parse_time
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.controlplane import HOST, ControlPlane, ControlPlaneError, free_port
from gputopo.localcluster.kube import KubeApiError, KubeClient

KUBELET_BINARIES = ("kubelet", "fakecri")
# Fixed in the kubelet (pluginapi.KubeletSocket's directory); not configurable.
FIXED_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
# What the kubelet's container manager sets on start (pkg/kubelet/cm, setupKernelTunables).
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# Runs as the namespace's first process: $0 is this kubelet's directory (its device-plugin
# directory and root dir inside), "$@" the kubelet command line. The mounts vanish with the namespace
# when the kubelet exits. The root dir is made a shared mount point here, before the kubelet starts:
# a kubelet whose root is not on a shared mount bind-mounts it onto itself at start (setupDataDirs,
# MakeRShared) while its PodResources and pods-API goroutines already create their sockets under it
# by a rename in one directory; a mount landing between the rename's two path lookups fails it with
# EXDEV ("invalid cross-device link"), and the kubelet exits. Shared already, the kubelet mounts
# nothing, as on a systemd host whose / is shared.
_NAMESPACE_SETUP = (
    "set -e; mount -t tmpfs -o mode=0755 tmpfs /var/log; "
    f'mount --bind "$0/device-plugins" {FIXED_DEVICE_PLUGIN_DIR}; '
    'mount --bind "$0/root" "$0/root"; mount --make-rshared "$0/root"; exec "$@"'
)
# The values found before this process started its first kubelet. Kubelets set the tunables only
# when they start, so putting these back whenever one stops is safe while others still run.
_original_tunables: dict[str, str] = {}


def in_private_mounts(setup: str, arg: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run in a new mount namespace (private propagation) after the shell script ``setup``,
    which gets ``arg`` as $0 and ``argv`` as "$@" (and execs it, so the PID stays the command's)."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", setup, str(arg), *argv]


def kubelet_unavailable(bin_dir: Path) -> str | None:
    """Why a ``RealKubelet`` cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "a real kubelet needs root (a private mount namespace for its fixed device-plugin directory)"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"a real kubelet needs the {tool} command (util-linux)"
    missing = [b for b in KUBELET_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        return (
            f"{' and '.join(missing)} not built in {bin_dir}; run gputopo/localcluster/build_binaries.sh "
            "(builds only what is missing)"
        )
    return None


def kubelet_configuration(
    *, port: int, healthz_port: int, cri_endpoint: str, pod_logs_dir: Path, volume_plugin_dir: Path
) -> dict[str, Any]:
    """A KubeletConfiguration for a kubelet on loopback with the fake CRI and no cgroup management."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": HOST,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": HOST,
        "healthzPort": healthz_port,
        # Only this machine reaches the loopback port; the apiserver never calls it here.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        # No container engine creates cgroups, so the kubelet must not manage per-QoS ones either.
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        # Otherwise the container manager writes the ephemeral-storage capacity into a map while
        # the DRA plugin manager's startup goroutine may iterate it (v1.34.4 kubelet dies with
        # "concurrent map iteration and map write" in GetCapacity; seen once in about 80 starts).
        # That write is the map's only one after construction; nothing here needs the capacity.
        "localStorageCapacityIsolation": False,
        "failSwapOn": False,
        # From 1.35 the kubelet refuses to start on a cgroup v1 host unless told otherwise (the
        # default turned true); it manages no cgroups here, so the host's cgroup version is moot.
        "failCgroupV1": False,
        "containerRuntimeEndpoint": cri_endpoint,
        "imageServiceEndpoint": cri_endpoint,
        "registerNode": True,
        # Fast status updates: device capacity shows up about one period after a plugin registers.
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        # A shared test machine may be nearly full; the kubelet must not evict the fake pods.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "resolvConf": "",
        "serializeImagePulls": False,
        "podLogsDir": str(pod_logs_dir),
        # The default (/usr/libexec/kubernetes/...) would be created on the host.
        "volumePluginDir": str(volume_plugin_dir),
    }


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _ready_heartbeat(node: Mapping[str, Any]) -> float | None:
    """Epoch seconds of the Ready condition's last heartbeat when the node is Ready, else None."""
    for c in node.get("status", {}).get("conditions", []):
        if c.get("type") == "Ready" and c.get("status") == "True":
            stamp = str(c.get("lastHeartbeatTime") or "")
            return (parse_time(stamp) or 0.0) if stamp else 0.0
    return None


class RealKubelet:
    """One upstream kubelet (plus its fake CRI) registering the Node ``node``.

    ``labels`` and ``taints`` (``key=value:Effect``) go onto the Node at registration
    (``--node-labels``, ``--register-with-taints``). The kubelet authenticates
    with the control plane's admin credential: the local control plane has no CA that signs
    kubelet client certificates, and the node registers itself either way.
    """

    def __init__(
        self,
        cp: ControlPlane,
        node: str,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[str] = (),
        progress: Callable[[str], None] | None = None,
    ) -> None:
        reason = self.unavailable(cp.bin_dir)
        if reason is not None:
            raise ControlPlaneError(reason)
        self.cp = cp
        self.node = node
        self.labels = dict(labels or {})
        self.taints = tuple(taints)
        self._progress = progress
        # Short paths: unix socket paths are limited to 107 bytes.
        self.dir = cp.dir / "kubelets" / node
        self.root_dir = self.dir / "root"
        self.device_plugin_dir = self.dir / "device-plugins"
        self.podresources_socket = self.root_dir / "pod-resources" / "kubelet.sock"
        # Where a DRA driver registers (the kubelet's plugin watcher) and serves (its own socket dir):
        # both under the root dir, which the kubelet's mount namespace sees at the same path.
        self.plugins_registry_dir = self.root_dir / "plugins_registry"
        self.dra_plugins_dir = self.root_dir / "plugins"
        self.cdi_dir = self.dir / "cdi"
        self.cri_socket = self.dir / "cri.sock"
        self.kubelet_component = f"kubelet-{node}"
        self.cri_component = f"fakecri-{node}"
        self.port = free_port()
        self.healthz_port = free_port()

    @staticmethod
    def unavailable(bin_dir: Path) -> str | None:
        """Why this kind of node cannot run here, or None (``kubelet_unavailable``)."""
        return kubelet_unavailable(bin_dir)

    @property
    def registration_socket(self) -> Path:
        """Where a device plugin registers (``kubelet.sock`` in the plugin directory)."""
        return self.device_plugin_dir / "kubelet.sock"

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)

    def _client(self) -> KubeClient:
        return self.cp.client()

    # ---------------------------------------------------------------- lifecycle

    def start(self, *, timeout: float = 120.0) -> None:
        """Start the fake CRI and the kubelet, and wait until the Node is registered and Ready."""
        for d in (
            self.root_dir,
            self.device_plugin_dir,
            self.plugins_registry_dir,
            self.dra_plugins_dir,
            self.cdi_dir,
            self.dir / "images",
            self.dir / "pod-logs",
        ):
            d.mkdir(parents=True, exist_ok=True)
        (self.dir / "volume-plugins").mkdir(exist_ok=True)
        FIXED_DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        _save_tunables()
        endpoint = f"unix://{self.cri_socket}"
        self.cri_socket.unlink(missing_ok=True)
        self.cp.start_process(
            self.cri_component,
            [
                str(self.cp.bin_dir / "fakecri"),
                f"-endpoint={endpoint}",
                f"-imagefs={self.dir / 'images'}",
            ],
            ready=self.cri_socket.exists,
        )
        kubelet = self._kubelet_argv(endpoint, root_dir=self.root_dir)
        # $0 of the setup: device_plugin_dir and root_dir are its "device-plugins" and "root".
        argv = in_private_mounts(_NAMESPACE_SETUP, self.dir, kubelet)
        self._say(f"starting a real kubelet for {self.node}")
        healthz = f"http://{HOST}:{self.healthz_port}/healthz"
        self.cp.start_process(self.kubelet_component, argv, ready=lambda: _http_ok(healthz))
        self.wait_ready(after=0.0, timeout=timeout)
        self._say(f"kubelet node {self.node} Ready")

    def _kubelet_argv(self, cri_endpoint: str, *, root_dir: Path) -> list[str]:
        """Write this kubelet's configuration and kubeconfig; return its command line, whose
        ``--root-dir`` is ``root_dir`` as the kubelet's mount namespace sees it."""
        cfg = kubelet_configuration(
            port=self.port,
            healthz_port=self.healthz_port,
            cri_endpoint=cri_endpoint,
            pod_logs_dir=self.dir / "pod-logs",
            volume_plugin_dir=self.dir / "volume-plugins",
        )
        if kubernetes_version(self.cp.bin_dir)[:2] < (1, 35):
            # The 1.34 kubelet may try an in-place resize of a pod it has just started and, managing no
            # pod cgroups here, dies on a nil pointer (kuberuntime doPodResizeAction). The gate is beta
            # there and GA (locked on) from 1.35, whose kubelet does not do this.
            cfg["featureGates"] = {"InPlacePodVerticalScaling": False}
        cfg_path = self.dir / "kubelet-config.json"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        kubeconfig = self.cp.write_kubeconfig(
            self.dir / "kubelet.kubeconfig", token=self.cp.admin_token, user="kubelet"
        )
        kubelet = [
            str(self.cp.bin_dir / "kubelet"),
            f"--config={cfg_path}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={root_dir}",
            f"--cert-dir={self.dir / 'pki'}",
            f"--hostname-override={self.node}",
            # --node-ip=127.0.0.1 is refused (loopback); the kubelet picks the host's address.
            "--v=2",
        ]
        if self.labels:
            kubelet.append("--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(self.labels.items())))
        if self.taints:
            kubelet.append("--register-with-taints=" + ",".join(self.taints))
        return kubelet

    def wait_ready(self, *, after: float, timeout: float = 60.0) -> None:
        """Until the Node is Ready with a heartbeat later than ``after`` (epoch seconds)."""
        deadline = time.monotonic() + timeout
        last = "not registered"
        with self._client() as kube:
            while time.monotonic() < deadline:
                if not self.cp.is_running(self.kubelet_component):
                    break
                try:
                    beat = _ready_heartbeat(kube.get_node(self.node))
                except KubeApiError as e:
                    if e.status != 404:
                        raise
                    beat = None
                else:
                    last = "not Ready" if beat is None else f"last heartbeat {beat:.0f}"
                if beat is not None and beat >= after:
                    return
                time.sleep(0.3)
        raise ControlPlaneError(
            f"kubelet node {self.node} not Ready ({last}); log {self.log_path}:\n"
            + self.cp.log_tail(self.kubelet_component, 40)
        )

    def wait_allocatable(self, resource: str, count: int, *, timeout: float = 60.0) -> None:
        """Until the Node's allocatable ``resource`` is ``count``: a device plugin registered and
        reported that many healthy devices (the kubelet updates the Node every 2 s)."""
        deadline = time.monotonic() + timeout
        have = None
        with self._client() as kube:
            while time.monotonic() < deadline:
                have = kube.get_node(self.node).get("status", {}).get("allocatable", {}).get(resource)
                if have == str(count):
                    return
                time.sleep(0.3)
        raise ControlPlaneError(
            f"kubelet node {self.node}: allocatable {resource} is {have!r}, not {count}, after {timeout:.0f}s "
            "(did the device plugin register?); kubelet log tail:\n" + self.cp.log_tail(self.kubelet_component, 30)
        )

    def restart(self, *, timeout: float = 60.0) -> None:
        """Stop and start the kubelet (the fake CRI keeps running, as a container engine would),
        and wait for a Ready heartbeat from the new process. Device plugins must register again."""
        # Heartbeats carry whole seconds, so only one in a later second surely comes from the new
        # process (it reports at start, then every nodeStatusUpdateFrequency).
        began = float(int(time.time()) + 1)
        self.cp.restart(self.kubelet_component)
        self.wait_ready(after=began, timeout=timeout)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The kubelet stopped (SIGSTOP to its process group) for the block, then continued: what the
        API server sends it meanwhile waits in its watch, in order, as on a node too busy to keep up."""
        pid = self.cp.pid(self.kubelet_component)
        if pid is None:
            raise ControlPlaneError(f"kubelet node {self.node} is not running")
        os.killpg(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the kubelet and the fake CRI and forget them; restore the kernel tunables.
        The Node object stays (delete it separately)."""
        for name in (self.kubelet_component, self.cri_component):
            if name in self.cp.components():
                self.cp.remove(name, grace=5)
        _restore_tunables()

    @property
    def log_path(self) -> Path:
        return self.cp.log_path(self.kubelet_component)

    def plugin_connections(self, resource: str) -> int:
        """How often this kubelet (all its runs) connected to a device plugin for ``resource``: the
        count grows when a plugin (re-)registers and the kubelet has reached its socket."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return 0
        return text.count(f'"Connected to new client" resource="{resource}"')


def _save_tunables() -> None:
    if _original_tunables:
        return
    for key in KERNEL_TUNABLES:
        with contextlib.suppress(OSError):
            _original_tunables[key] = (Path("/proc/sys") / key).read_text().strip()
    # Also when a caller never stops its kubelets (the control plane's teardown kills them).
    atexit.register(_restore_tunables)


def _restore_tunables() -> None:
    for key, value in _original_tunables.items():
        path = Path("/proc/sys") / key
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value + "\n")
