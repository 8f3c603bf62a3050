"""Serve the device plugin on its socket in the kubelet's device-plugin directory and stay registered.

The directory is polled (stat, no inotify in the standard library): when `kubelet.sock` is a new file the
kubelet restarted and forgot its plugins, so register again; when our own socket is gone (the kubelet
deletes plugin sockets when it starts) serve on a new one and register again. A stale socket of ours
left by a previous agent is removed before serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from gputopo.agent.deviceplugin import api_pb2, api_pb2_grpc
from gputopo.agent.deviceplugin.servicer import DevicePluginServicer
from gputopo.kube import Backoff

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")


def socket_name(resource_name: str) -> str:
    """`gputopo-<suffix>.sock` for `<domain>/<suffix>` (nvidia.com/gpu → gputopo-gpu.sock)."""
    suffix = resource_name.rsplit("/", 1)[-1]
    clean = "".join(c if c.isalnum() or c in "-_." else "-" for c in suffix) or "device"
    return f"gputopo-{clean}.sock"


@dataclass(frozen=True)
class _FileId:
    dev: int
    ino: int
    ctime_ns: int


def _file_id(path: Path) -> _FileId | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return _FileId(st.st_dev, st.st_ino, st.st_ctime_ns)


class PluginServer:
    """The gRPC server on `<dir>/gputopo-<suffix>.sock` plus the registration with the kubelet."""

    def __init__(
        self,
        servicer: DevicePluginServicer,
        resource_name: str,
        plugin_dir: Path = DEFAULT_PLUGIN_DIR,
        *,
        poll_s: float = 1.0,
        register_timeout_s: float = 5.0,
        retry_max_s: float = 30.0,
        max_workers: int = 8,
    ) -> None:
        self._servicer = servicer
        self.resource_name = resource_name
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / socket_name(resource_name)
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._poll = poll_s
        self._register_timeout = register_timeout_s
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._served: _FileId | None = None  # our socket file as we created it
        self._registered_with: _FileId | None = None  # kubelet.sock as it was when we registered
        self._retry_at = 0.0
        # Failed registrations wait poll_s, then twice that, … up to retry_max_s.
        self._backoff = Backoff(base_s=poll_s, cap_s=retry_max_s)
        self._failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.registrations = 0
        self.serves = 0

    def start(self) -> None:
        """Serve now and try to register; the watch thread keeps both true until stop()."""
        self._check_path()
        with self._lock:
            self._serve()
            self._try_register()
        self._thread = threading.Thread(target=self._watch, name="gputopo-device-plugin", daemon=True)
        self._thread.start()

    def _check_path(self) -> None:
        # sockaddr_un holds 108 bytes including the terminating NUL.
        if len(os.fsencode(self.socket_path.absolute())) > 107:
            raise ValueError(f"device plugin socket path is too long for a unix socket: {self.socket_path}")

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        # A socket left by an earlier agent (or one the kubelet already replaced) blocks bind().
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="gputopo-dp"))
        api_pb2_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path.absolute()}")
        server.start()
        self._server = server
        self._served = _file_id(self.socket_path)
        self._registered_with = None
        self.serves += 1
        log.info("device plugin serving", extra={"socket": str(self.socket_path), "resource": self.resource_name})

    def _try_register(self) -> bool:
        kubelet = _file_id(self.kubelet_socket)
        if kubelet is None:
            return False
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_path.name,
            resource_name=self.resource_name,
            options=api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
        )
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket.absolute()}") as channel:
                api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=self._register_timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            log.warning(
                "registration with the kubelet failed; retrying",
                extra={"socket": str(self.kubelet_socket), "code": str(code), "error": _details(e)},
            )
            return False
        self._registered_with = kubelet
        self.registrations += 1
        log.info("registered with the kubelet", extra={"resource": self.resource_name, "endpoint": request.endpoint})
        return True

    def _tick(self, now: float) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            if _file_id(self.socket_path) != self._served:
                log.info("device plugin socket was removed (kubelet restart?); serving again")
                self._serve()
                self._retry_at = 0.0
            kubelet = _file_id(self.kubelet_socket)
            if kubelet is None or kubelet == self._registered_with or now < self._retry_at:
                return
            if self._registered_with is not None:
                log.info("kubelet.sock was re-created (kubelet restart); registering again")
            if self._try_register():
                self._failures = 0
            else:
                self._retry_at = now + self._backoff.delay(self._failures)
                self._failures += 1

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self._tick(time.monotonic())
            except Exception:
                log.exception("device plugin watch failed; retrying")

    @property
    def registered(self) -> bool:
        return self._registered_with is not None and self._registered_with == _file_id(self.kubelet_socket)

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            if self._server is not None:
                self._server.stop(grace=grace_s).wait(grace_s + 1.0)
                self._server = None
            if self._served is not None and _file_id(self.socket_path) == self._served:
                self.socket_path.unlink(missing_ok=True)


def _details(e: grpc.RpcError) -> str:
    details = e.details() if hasattr(e, "details") else None
    return str(details or e)
