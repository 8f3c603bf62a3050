"""Supervision of the local cluster's child processes: start, readiness, stop and log diagnosis, by PID only."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


class ControlPlaneError(RuntimeError):
    """A component failed to start or the control plane is used wrongly."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_ok(url: str, *, token: str | None = None, ctx: ssl.SSLContext | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGTERM to the child when the forking thread exits.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return "(no log)"


def _diagnosis(path: Path, lines: int = 40) -> str:
    """Error lines from anywhere in a log (cobra prints the error before a long usage text;
    klog's E/F lines; etcd's JSON error levels), then the tail."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [
        ln
        for ln in text
        if ln.startswith(("Error:", "error:", "E1", "E0", "F1", "F0"))
        or '"level":"error"' in ln
        or '"level":"fatal"' in ln
        or '"level":"panic"' in ln
    ][-10:]
    head = ("error lines:\n" + "\n".join(errors) + "\n--- last lines:\n") if errors else ""
    return head + "\n".join(text[-lines:])


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_pids: list[int] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True, kw_only=True)
class Lifetime:
    """How long a control plane lasts: `keep` leaves its directory (logs) on teardown; with
    `die_with_parent` the kernel stops its children when the thread that started them exits (Linux
    ``PR_SET_PDEATHSIG``); False (e.g. ``gputopo demo --keep``) for one that outlives this process,
    started from a thread that lives as long as it should."""

    keep: bool = False
    die_with_parent: bool = True


EPHEMERAL = Lifetime()


class Supervisor:
    """The process half of ``ControlPlane``: named components, each a child process with a log
    file in ``dir``, started until ready and stopped by PID. ``ControlPlane.__init__`` sets the
    attributes declared below."""

    dir: Path
    die_with_parent: bool
    startup_timeout: float
    _progress: Callable[[str], None] | None
    _components: dict[str, Component]
    _removed_pids: list[int]
    _started: bool
    _torn_down: bool

    def components(self) -> list[str]:
        return list(self._components)

    def pid(self, name: str) -> int | None:
        c = self._get(name)
        return c.proc.pid if c.running and c.proc is not None else None

    def is_running(self, name: str) -> bool:
        return self._get(name).running

    def owned_pids(self) -> list[int]:
        """Every PID this control plane has started, including stopped ones."""
        return self._removed_pids + [p for c in self._components.values() for p in c.started_pids]

    def log_path(self, name: str) -> Path:
        return self._get(name).log_path

    def log_tail(self, name: str, lines: int = 40) -> str:
        return _tail(self._get(name).log_path, lines)

    def stop(self, name: str, *, grace: float = 5.0) -> None:
        """Stop one component (SIGTERM, then SIGKILL after ``grace`` seconds). Start it again
        with ``start_component`` or ``restart``. A kube-apiserver with schedulers watching it
        usually needs the whole grace period, since its graceful shutdown waits for them."""
        self._stop(self._get(name), grace)

    def kill(self, name: str) -> None:
        """SIGKILL one component at once, as a crash or an evicted pod would end it: nothing is
        flushed or released. Start it again with ``start_component``."""
        c = self._get(name)
        if c.proc is not None and c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait(timeout=30)
        self._write_pids()

    def restart(self, name: str, *, grace: float = 5.0) -> None:
        """Stop (if running) and start one component again with the same ports, data and
        configuration, waiting until it is ready."""
        c = self._get(name)
        self._stop(c, grace)
        self._start(name)

    def start_component(self, name: str) -> None:
        """Start a stopped component again (no-op if it runs)."""
        if not self._get(name).running:
            self._start(name)

    def start_process(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready: Callable[[], bool],
        env: Mapping[str, str] | None = None,
        log_name: str | None = None,
    ) -> str:
        """Run a process (a scheduler, the extender, an agent) as a managed component: logged into
        the directory, stopped with the rest, restartable by name. Waits until ``ready()``."""
        self._require_started()
        if name in self._components:
            raise ControlPlaneError(f"component {name!r} exists; use restart()")
        safe = log_name or "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        self._components[name] = Component(
            name=name, argv=list(argv), log_path=self.dir / f"{safe}.log", ready=ready, env=dict(env or {})
        )
        try:
            self._start(name)
        except BaseException:
            c = self._components.pop(name)
            self._removed_pids.extend(c.started_pids)
            raise
        return name

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)

    def _get(self, name: str) -> Component:
        try:
            return self._components[name]
        except KeyError:
            raise ControlPlaneError(f"no component {name!r}; have {', '.join(self._components) or 'none'}") from None

    def _require_started(self) -> None:
        if not self._started or self._torn_down:
            raise ControlPlaneError("the control plane is not running; call start() first")

    def _write_pids(self) -> None:
        pids = {n: c.proc.pid for n, c in self._components.items() if c.running and c.proc is not None}
        with contextlib.suppress(OSError):
            (self.dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")

    def _start(self, name: str) -> None:
        c = self._get(name)
        if c.running:
            return
        self._say(f"starting {name}")
        with c.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(c.argv)}\n".encode())
            log.flush()
            c.proc = subprocess.Popen(
                c.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                env={**os.environ, **c.env} if c.env else None,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if self.die_with_parent else None,
            )
        c.started_pids.append(c.proc.pid)
        self._write_pids()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = c.proc.poll()
            if rc is not None:
                raise ControlPlaneError(
                    f"{name} exited with status {rc} during startup; log {c.log_path}:\n" + _diagnosis(c.log_path)
                )
            if c.ready():
                self._say(f"{name} ready (pid {c.proc.pid})")
                return
            if time.monotonic() > deadline:
                self._stop(c)
                raise ControlPlaneError(
                    f"{name} not ready after {self.startup_timeout:.0f}s; log {c.log_path}:\n" + _diagnosis(c.log_path)
                )
            time.sleep(0.1)

    def _stop(self, c: Component, timeout: float = 5.0) -> None:
        p = c.proc
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        self._write_pids()
