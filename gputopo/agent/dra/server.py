"""The DRA driver's two unix sockets: the DRA service and the registration service.

- `<plugins>/gpu.gputopo.io/dra.sock` serves DRAPlugin v1 and v1beta1;
- `<plugins_registry>/gpu.gputopo.io-reg.sock` serves Registration. The kubelet's plugin watcher
  notices a socket appearing there (at its start too), calls GetInfo and dials the endpoint it names.

The DRA socket is served first, so the endpoint answers by the time the kubelet reads it. A stale
socket of an earlier agent is removed before serving; a socket removed under us is served again by
the watch thread (the registration one then makes the kubelet register us again). Both servers are
bounded: message sizes and concurrent RPCs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from gputopo.agent.dra.api import pluginregistration_pb2_grpc
from gputopo.agent.dra.driver import DraDriver
from gputopo.agent.dra.service import RegistrationServicer, add_dra_services

log = logging.getLogger(__name__)

DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DRA_SOCKET = "dra.sock"
MAX_RECEIVE_BYTES = 4 * 1024 * 1024  # a Prepare of hundreds of claims is a few KiB
MAX_SEND_BYTES = 16 * 1024 * 1024
MAX_CONCURRENT_RPCS = 16  # the kubelet calls per pod; more waiting callers get RESOURCE_EXHAUSTED
# One worker per admitted RPC: a call never queues for a thread behind Prepares blocked on the API
# server (the driver caps those at MAX_API_READS, below this).
_WORKERS = MAX_CONCURRENT_RPCS


def plugin_dir(plugins_dir: Path, driver: str) -> Path:
    """The driver's own directory: its DRA socket and its checkpoint."""
    return plugins_dir / driver


def registration_socket(registry_dir: Path, driver: str) -> Path:
    return registry_dir / f"{driver}-reg.sock"


@dataclass(frozen=True)
class _FileId:
    dev: int
    ino: int


def _file_id(path: Path) -> _FileId | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return _FileId(st.st_dev, st.st_ino)


def _check_socket_path(path: Path) -> None:
    # sockaddr_un holds 108 bytes including the terminating NUL.
    if len(os.fsencode(path.absolute())) > 107:
        raise ValueError(f"DRA socket path is too long for a unix socket: {path}")


class _Served:
    """One gRPC server on one socket file, served again when the file goes."""

    def __init__(self, path: Path, name: str, add: Callable[[grpc.Server], None]) -> None:
        self.path = path
        self.name = name
        self._add = add
        self.server: grpc.Server | None = None
        self.file: _FileId | None = None
        self.serves = 0

    def serve(self) -> None:
        self.stop(None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # an earlier agent's socket blocks bind()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix=f"gputopo-{self.name}"),
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        self._add(server)
        server.add_insecure_port(f"unix://{self.path.absolute()}")
        server.start()
        self.server = server
        self.file = _file_id(self.path)
        self.serves += 1
        log.info("DRA driver serving", extra={"socket": str(self.path), "service": self.name})

    def gone(self) -> bool:
        return _file_id(self.path) != self.file

    def stop(self, grace_s: float | None) -> None:
        if self.server is not None:
            self.server.stop(grace=grace_s).wait((grace_s or 0.0) + 1.0)
            self.server = None
        if self.file is not None and _file_id(self.path) == self.file:
            self.path.unlink(missing_ok=True)
        self.file = None


class DraServer:
    def __init__(
        self,
        driver: DraDriver,
        *,
        on_status: Callable[[bool, str], None] | None = None,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        registry_dir: Path = DEFAULT_REGISTRY_DIR,
        poll_s: float = 1.0,
    ) -> None:
        self.dra_socket = plugin_dir(plugins_dir, driver.driver) / DRA_SOCKET
        self.registration_socket = registration_socket(registry_dir, driver.driver)
        self.registration = RegistrationServicer(driver.driver, str(self.dra_socket.absolute()), on_status)
        self._dra = _Served(self.dra_socket, "dra", lambda s: add_dra_services(driver, s))
        reg = self.registration
        self._reg = _Served(
            self.registration_socket,
            "registration",
            lambda s: pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(reg, s),
        )
        self._poll = poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def serves(self) -> tuple[int, int]:
        """How often each socket was served: (DRA, registration)."""
        return self._dra.serves, self._reg.serves

    def start(self) -> None:
        _check_socket_path(self.dra_socket)
        _check_socket_path(self.registration_socket)
        with self._lock:
            self._dra.serve()
            self._reg.serve()
        self._thread = threading.Thread(target=self._watch, name="gputopo-dra-sockets", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            if self._dra.gone():
                log.warning("the DRA socket was removed; serving it again", extra={"socket": str(self.dra_socket)})
                self._dra.serve()
            if self._reg.gone():
                log.warning(
                    "the registration socket was removed; serving it again",
                    extra={"socket": str(self.registration_socket)},
                )
                self._reg.serve()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self.tick()
            except Exception:
                log.exception("DRA socket watch failed; retrying")

    def stop(self, grace_s: float = 1.0) -> None:
        """Registration first: the kubelet stops calling a driver whose registration socket is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            self._reg.stop(grace_s)
            self._dra.stop(grace_s)
