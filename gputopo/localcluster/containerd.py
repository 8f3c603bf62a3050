"""A node of the local control plane that runs containers: the upstream kubelet on containerd + runc.

Next to the simulated nodes (Node objects only) and ``RealKubelet`` (a real kubelet on the fake
CRI, where nothing runs), ``ContainerdNode`` is a real kubelet whose CRI is containerd (Debian's
1.6, with runc and the CNI bridge plugin). Pods run from images imported beforehand from OCI
archives (``images.ensure_images``); nothing is ever pulled (the sandbox image is the imported
pause, and pods should say ``imagePullPolicy: Never``).

containerd and the kubelet share one private mount namespace, whose first process is containerd:

- a directory of this node is bind-mounted over ``/var/lib/kubelet`` and the kubelet runs with
  ``--root-dir=/var/lib/kubelet``, so the default host paths pods mount (the device-plugin
  directory, PodResources) are this node's, and runc sees every volume the kubelet mounts;
- tmpfs over ``/run/containerd`` (containerd 1.6 puts shim sockets, fifos and runc state there,
  whatever its ``state`` says), ``/var/log`` (``/var/log/pods``) and ``/var/lib/cni`` (libcni's
  result cache).

Pods reach the API server as in a cluster: the kubelet gives them ``KUBERNETES_SERVICE_HOST`` (the
``kubernetes`` Service's cluster IP, 10.0.0.1, which the apiserver's certificate names) and their
service-account token (the control plane must run with ``service_account_admission=True`` and
kube-controller-manager). The node gives that IP to an interface of its own (a bridge without ports) and forwards it
to the loopback apiserver (``svcproxy``); nothing listens on any other address.

Changes outside the control plane's directory, all undone by ``stop()``: the CNI bridge and the
interface (deleted), ``net.ipv4.ip_forward`` (set by the bridge plugin) and the kubelet's
kernel tunables (restored), empty mount points (``/var/lib/kubelet``, ``/run/containerd``,
``/var/lib/cni`` when missing) and empty ``k8s.io`` cgroup directories (removed). Needs root,
hybrid or v1 cgroups as found, and no ``CAP_SYS_RESOURCE`` (``restrict_oom_score_adj``). Only
one containerd node per machine at a time: the cluster IP is a host address while it runs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gputopo.localcluster.controlplane import HOST, ControlPlane, ControlPlaneError
from gputopo.localcluster.images import Image
from gputopo.localcluster.kubelet import RealKubelet, _http_ok, _restore_tunables, _save_tunables, in_private_mounts

CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
FIXED_KUBELET_ROOT = Path("/var/lib/kubelet")
# Debian packages that provide what this node runs (besides the kubelet binary).
RUNTIME_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iproute2")
_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "unshare", "nsenter", "mount", "ip")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "k8s.io"  # where containerd puts containers when the kubelet names no parent

# Runs as the namespace's first process: $0 is this node's kubelet root directory, "$@" the
# containerd command line. The mounts vanish with the namespace's last process. The root is shared
# before the kubelet starts, so the kubelet does not bind-mount it onto itself while creating its
# sockets under it (the race kubelet.py's setup explains).
_NAMESPACE_SETUP = (
    'set -e; for d in /run/containerd /var/log /var/lib/cni; do mount -t tmpfs -o mode=0755 tmpfs "$d"; done; '
    f'mount --bind "$0" {FIXED_KUBELET_ROOT}; mount --make-rshared {FIXED_KUBELET_ROOT}; exec "$@"'
)

_CONTAINERD_CONFIG = """version = 2
root = "{dir}/root"
state = "{dir}/state"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # Pod netns files under the state directory, not the host's /run/netns.
  netns_mounts_under_state_dir = true
  # Without CAP_SYS_RESOURCE runc cannot lower oom_score_adj below containerd's own (the pause
  # container's -998): every sandbox failed with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{dir}/net.d"
"""


def containerd_unavailable(bin_dir: Path) -> str | None:
    """Why a ``ContainerdNode`` cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "a containerd node needs root (a private mount namespace, containers, a CNI bridge)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    missing += [f"{CNI_BIN_DIR}/{p}" for p in ("bridge", "host-local") if not (CNI_BIN_DIR / p).is_file()]
    if missing:
        return (
            f"a containerd node needs {', '.join(missing)}: apt-get install {' '.join(RUNTIME_PACKAGES)} "
            "(gputopo/localcluster/build_images.sh installs them when run as root)"
        )
    if not (bin_dir / "kubelet").is_file():
        return f"kubelet not built in {bin_dir}; run gputopo/localcluster/build_binaries.sh"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.233.0.0/16 that no route of this host touches (pods' addresses)."""
    routes = subprocess.run(["ip", "-4", "-o", "route", "show", "table", "all"], capture_output=True, text=True)
    used = routes.stdout
    for third in [secrets.randbelow(256) for _ in range(64)]:
        net = ipaddress.IPv4Network(f"10.233.{third}.0/24")
        if f"10.233.{third}." not in used:
            return net
    raise ControlPlaneError("no free /24 in 10.233.0.0/16 for the containerd node's pods")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ControlPlaneError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


class ContainerdNode(RealKubelet):
    """One upstream kubelet on its own containerd, registering the Node ``node``.

    ``images``: OCI archives imported into containerd before the kubelet starts; the one named
    ``pause`` is the pod sandbox image (required). ``labels`` and ``taints`` as for
    ``RealKubelet``. ``wait_ready``, ``wait_allocatable``, ``plugin_connections``, ``paused`` and
    ``restart`` work as there; ``device_plugin_dir`` and ``podresources_socket`` are the host's view
    of ``/var/lib/kubelet/device-plugins`` and ``/var/lib/kubelet/pod-resources/kubelet.sock``.
    """

    def __init__(
        self,
        cp: ControlPlane,
        node: str,
        *,
        images: Sequence[Image],
        labels: Mapping[str, str] | None = None,
        taints: Sequence[str] = (),
        progress: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(cp, node, labels=labels, taints=taints, progress=progress)
        pauses = [i for i in images if i.name == "pause"]
        if len(pauses) != 1:
            raise ControlPlaneError(f"a containerd node needs exactly one pause image among {images}")
        self.images = tuple(images)
        self.pause_ref = pauses[0].ref
        self.device_plugin_dir = self.root_dir / "device-plugins"
        self.podresources_socket = self.root_dir / "pod-resources" / "kubelet.sock"
        self.containerd_dir = self.dir / "containerd"
        self.containerd_socket = self.containerd_dir / "containerd.sock"
        self.cri_component = f"containerd-{node}"
        self.proxy_component = f"svcproxy-{node}"
        suffix = secrets.token_hex(3)
        self.bridge = f"gtopo{suffix}"
        self.service_link = f"gtsvc{suffix}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.service_ip = ""
        self._made_dirs: list[Path] = []
        self._ip_forward: str | None = None
        self._ctr_pid: int | None = None

    @staticmethod
    def unavailable(bin_dir: Path) -> str | None:
        return containerd_unavailable(bin_dir)

    # ---------------------------------------------------------------- lifecycle

    def start(self, *, timeout: float = 120.0) -> None:
        """Start the service forwarder, containerd (importing the images) and the kubelet, and
        wait until the Node is Ready."""
        for d in (self.root_dir, self.dir / "pod-logs", self.dir / "volume-plugins", self.containerd_dir / "net.d"):
            d.mkdir(parents=True, exist_ok=True)
        for p in (FIXED_KUBELET_ROOT, Path("/run/containerd"), Path("/var/lib/cni")):
            if not p.exists():
                p.mkdir(parents=True)
                self._made_dirs.append(p)
        _save_tunables()
        self._ip_forward = IP_FORWARD.read_text().strip()
        try:
            self._start_network()
            self._start_containerd()
            self._import_images()
            kubelet = self._kubelet_argv(f"unix://{self.containerd_socket}", root_dir=FIXED_KUBELET_ROOT)
            argv = ["nsenter", "-t", str(self._ctr_pid), "-m", "--", *kubelet]
            self._say(f"starting a real kubelet on containerd for {self.node}")
            healthz = f"http://{HOST}:{self.healthz_port}/healthz"
            self.cp.start_process(self.kubelet_component, argv, ready=lambda: _http_ok(healthz))
            self.wait_ready(after=0.0, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        self._say(f"containerd node {self.node} Ready")

    def _start_network(self) -> None:
        with self._client() as kube:
            svc = kube.request("GET", "/api/v1/namespaces/default/services/kubernetes")
        self.service_ip = str(svc["spec"]["clusterIP"])
        port = int(svc["spec"]["ports"][0]["port"])
        taken = _ip("-o", "addr", "show", "to", f"{self.service_ip}/32").stdout.strip()
        if taken:
            raise ControlPlaneError(
                f"{self.service_ip} (the kubernetes Service) is already an address of this host ({taken}); "
                "is another containerd node running?"
            )
        self.subnet = _free_subnet()
        # The bridge plugin accepts an existing bridge but only its gateway as the IPv4 address, so
        # the cluster IP goes onto a link of its own (a bridge without ports: kernels without the
        # dummy module have bridges).
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        _ip("link", "add", self.service_link, "type", "bridge")
        _ip("addr", "add", f"{self.service_ip}/32", "dev", self.service_link)
        _ip("link", "set", self.service_link, "up")
        conflist = {
            "cniVersion": "0.4.0",
            "name": f"gputopo-{self.node}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    # Pods talk to this host only (the API server through the forwarder), so no
                    # masquerading and no iptables rules.
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(self.subnet)}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.containerd_dir / "ipam"),
                    },
                }
            ],
        }
        (self.containerd_dir / "net.d" / "10-gputopo.conflist").write_text(json.dumps(conflist, indent=1) + "\n")
        target = self.cp.apiserver_port

        self.cp.start_process(
            self.proxy_component,
            [
                sys.executable,
                "-m",
                "gputopo.localcluster.svcproxy",
                self.service_ip,
                str(port),
                HOST,
                str(target),
            ],
            ready=lambda: _accepts(self.service_ip, port),
        )

    def _start_containerd(self) -> None:
        cfg = self.containerd_dir / "config.toml"
        cfg.write_text(
            _CONTAINERD_CONFIG.format(
                dir=self.containerd_dir, sock=self.containerd_socket, pause=self.pause_ref, cni_bin=CNI_BIN_DIR
            )
        )
        self.containerd_socket.unlink(missing_ok=True)
        argv = in_private_mounts(_NAMESPACE_SETUP, self.root_dir, ["containerd", "--config", str(cfg)])
        self._say(f"starting containerd for {self.node}")
        self.cp.start_process(self.cri_component, argv, ready=self.containerd_socket.exists)
        # unshare and sh exec, so the component's PID is containerd's, in the namespace.
        self._ctr_pid = self.cp.pid(self.cri_component)

    def ctr(self, *args: str, check: bool = True, timeout: float = 300.0) -> str:
        """Run ``ctr`` against this node's containerd (namespace ``k8s.io``, the CRI's), inside its
        mount namespace (the client makes its fifos under ``/run/containerd``)."""
        if self._ctr_pid is None:
            raise ControlPlaneError(f"containerd of {self.node} is not running")
        argv = ["nsenter", "-t", str(self._ctr_pid), "-m", "--", "ctr", "--address", str(self.containerd_socket)]
        proc = subprocess.run([*argv, "-n", "k8s.io", *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"ctr {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def _import_images(self) -> None:
        for image in self.images:
            t0 = time.monotonic()
            self.ctr("images", "import", str(image.archive))
            self._say(f"imported {image.ref} ({image.bytes / 1e6:.1f} MB) in {time.monotonic() - t0:.1f}s")
        listed = set(self.ctr("images", "ls", "-q").split())
        missing = [i.ref for i in self.images if i.ref not in listed]
        if missing:
            raise ControlPlaneError(f"containerd of {self.node} lists no {', '.join(missing)} after the import")

    def tasks(self) -> list[str]:
        """IDs of the containers (pause included) that have a running or stopped task."""
        if self._ctr_pid is None or not self.cp.is_running(self.cri_component):
            return []
        return self.ctr("tasks", "ls", "-q", check=False, timeout=30).split()

    def stop(self) -> None:
        """Stop the kubelet, every container, containerd and the forwarder; undo the host changes.
        Pods bound to the node stay in the API (delete them first for an orderly end)."""
        if self.kubelet_component in self.cp.components():
            self.cp.remove(self.kubelet_component, grace=5)
        with contextlib.suppress(Exception):
            tasks = self.tasks()
            for t in tasks:
                self.ctr("tasks", "kill", "-s", "SIGKILL", t, check=False, timeout=30)
            deadline = time.monotonic() + 10
            while self.tasks() and time.monotonic() < deadline:
                for t in tasks:
                    self.ctr("tasks", "delete", t, check=False, timeout=30)
                time.sleep(0.3)
        for name in (self.cri_component, self.proxy_component):
            if name in self.cp.components():
                self.cp.remove(name, grace=5)
        self._kill_shims()
        self._ctr_pid = None
        for link in (self.bridge, self.service_link):
            _ip("link", "del", link, check=False)
        _restore_tunables()
        if self._ip_forward is not None:
            with contextlib.suppress(OSError):
                if IP_FORWARD.read_text().strip() != self._ip_forward:
                    IP_FORWARD.write_text(self._ip_forward + "\n")
        with contextlib.suppress(OSError):
            for ctl in CGROUP_ROOT.iterdir():
                with contextlib.suppress(OSError):
                    (ctl / CGROUP_PARENT).rmdir()  # only when empty
        for p in reversed(self._made_dirs):
            with contextlib.suppress(OSError):
                p.rmdir()
        self._made_dirs.clear()

    def _kill_shims(self) -> None:
        """containerd's shims outlive it (they keep the namespace and its mounts alive): find
        this node's by the socket in their command line and kill them by PID."""
        mine = str(self.containerd_socket).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(b"containerd-shim-runc-v2") and mine in argv:
                    os.kill(int(proc.name), signal.SIGKILL)

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """A container's log as the kubelet wrote it (CRI format, one line per write), read from the
        host: the API server cannot reach a kubelet on loopback for ``kubectl logs``."""
        logs = sorted((self.dir / "pod-logs").glob(f"{namespace}_{pod}_*/{container}/*.log"))
        return "".join(p.read_text(errors="replace") for p in logs)


def _accepts(host: str, port: int) -> bool:
    """True once something accepts TCP on ``host:port`` (the forwarder; TLS is the apiserver's)."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
