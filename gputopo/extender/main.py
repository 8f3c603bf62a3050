"""`gputopo-extender`: settings from flags and GPUTOPO_* environment variables (pydantic-settings, flags win;
docs/configuration.md), then three listeners over one cache and service:

- the scheduling verbs on `--host`/`--port` (plain HTTP, loopback only: kube-scheduler in the same pod), on
  the main thread's event loop;
- the mutating webhook on `--webhook-host`/`--webhook-port` over TLS (off unless `--webhook-port` is set);
- Prometheus metrics on `--metrics-host`/`--metrics-port` (0 turns it off).

The webhook and the metrics, reachable from the pod network, each run on an event loop of their own in their
own thread, at a lower CPU priority: a flood of connections or TLS handshakes on the webhook holds up neither
the loop that answers kube-scheduler nor the metrics listener, where the kubelet's probes go (OpenSSL's
handshake work runs without the GIL).

Every socket is bound before anything starts, so a port in use is one line naming its flag, not a half-started
process. The lifespan (informers, `Listeners.running`) is entered once for all three servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import resource
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError

from gputopo.clusterfile import ClusterFileError
from gputopo.extender.http.heads import BodyBudget, HeadPolicy
from gputopo.extender.http.refusals import TOO_MANY, TOO_MANY_FROM_PEER, refusal
from gputopo.extender.http.uvicornprotocol import BoundedHttpTools, bounded_protocol
from gputopo.extender.settings import (
    DEFAULT_MAX_REQUEST_BYTES,
    PROG,
    ListenerLimits,
    Settings,
    describe_error,
    load_settings,
)
from gputopo.jsonlog import configure_logging
from gputopo.listenguard.acceptgate import Full, Gate, Slots

if TYPE_CHECKING:  # the app (cache, engine) is imported only once the settings are valid
    from gputopo.extender.app import Listeners
    from gputopo.extender.http.bodylimit import ASGIApp

__all__ = [
    "Endpoint",
    "ListenError",
    "ListenerServer",
    "endpoints",
    "listener_config",
    "load_settings",
    "main",
    "raise_nofile_limit",
    "serve",
]

log = logging.getLogger("gputopo.extender")


class ListenError(Exception):
    """A listener cannot start: the message names the flags that configure it."""


@dataclass(frozen=True)
class Endpoint:
    name: str  # verbs | webhook | metrics
    host: str
    port: int
    flags: str  # the flags that set host and port, for error messages
    tls: tuple[Path, Path] | None = None  # (certificate, key)
    client_ca: Path | None = None  # CA of the client certificates the webhook asks for (optional ones)


def endpoints(settings: Settings) -> list[Endpoint]:
    """The enabled listeners, verbs first."""
    out = [Endpoint("verbs", settings.host, settings.port, "--host/--port")]
    if settings.webhook_port:
        assert settings.tls_cert_file is not None and settings.tls_key_file is not None  # Settings checks it
        tls = (settings.tls_cert_file, settings.tls_key_file)
        flags = "--webhook-host/--webhook-port"
        client_ca = settings.webhook_client_ca_file  # the webhook's client authentication
        out.append(Endpoint("webhook", settings.webhook_host, settings.webhook_port, flags, tls, client_ca))
    if settings.metrics_port:
        out.append(Endpoint("metrics", settings.metrics_host, settings.metrics_port, "--metrics-host/--metrics-port"))
    return out


def _bind(ep: Endpoint) -> socket.socket:
    family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP,
    # and with proto 0 every small answer waited for the client's delayed ACK (about 40 ms per call).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # Restarted in place (a container restart) the port may still hold TIME_WAIT connections.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ep.host.strip("[]"), ep.port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {ep.host}:{ep.port} ({ep.flags}): {e.strerror or e}") from None
    return sock


class _Serving(Protocol):
    """What `serve` needs of a listener's server: uvicorn's, or the verbs listener's own."""

    should_exit: bool

    async def serve(self, sockets: list[socket.socket]) -> None: ...


def listener_config(
    app: ASGIApp, limits: ListenerLimits, tls: tuple[Path, Path] | None = None, client_ca: Path | None = None
) -> uvicorn.Config:
    """uvicorn's configuration for the webhook or metrics listener: its protocol holds `limits`, and decides
    from each request's head whether its body is read (`HeadPolicy`: the paths the app serves, the POST paths
    whose body it reads, the guarded ones and who may call them). With `client_ca` the TLS context asks for a
    client certificate and verifies one that is presented against it (ssl.CERT_OPTIONAL: a client without one
    still connects; the protocol and the app read the certificate from the ASGI TLS extension)."""
    state = getattr(app, "state", None)
    policy = HeadPolicy(  # what gputopo.extender.app sets on each app
        paths=getattr(state, "paths", frozenset()),
        body_paths=getattr(state, "post_paths", frozenset()),
        guarded=getattr(state, "guarded", {}),
        max_request_bytes=getattr(state, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        refused=getattr(state, "head_refused", None),
    )
    return uvicorn.Config(
        app,
        lifespan="off",  # entered once in `serve`, for all listeners
        log_config=None,
        access_log=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        ssl_ca_certs=str(client_ca) if tls and client_ca else None,
        ssl_cert_reqs=ssl.CERT_OPTIONAL if tls and client_ca else ssl.CERT_NONE,
        http=bounded_protocol(limits, policy),  # head cap and policy, read deadline, idle timeout, body budget
        ws="none",
    )


class ListenerServer(uvicorn.Server):
    """uvicorn's server for the webhook or metrics listener, accepting through `gputopo.listenguard.acceptgate.Gate`:
    each
    connection counts against `limits` from its accept, and the webhook's TLS handshake runs under the
    handshake timeout (uvicorn hands the TLS context to the loop's server, which counts a connection only
    after a handshake it gives 60 s). Its signals `serve` handles once for all listeners (uvicorn's own
    handler would stop only the server that installed it last)."""

    def __init__(self, config: uvicorn.Config, limits: ListenerLimits) -> None:
        super().__init__(config)
        self.slots = Slots(limits)
        self.budget = BodyBudget(limits.max_body_bytes_in_flight, limits.body_bytes_per_peer)
        self.slots.on_idle = self._idle
        self._trim: asyncio.TimerHandle | None = None
        self._trimmed_at = (0, 0)  # the connections and bytes counted at the last trim

    def _idle(self) -> None:
        """The listener holds no connection: in a second (unless one comes meanwhile), give what the last
        ones freed back to the system (`trim_freed_memory`), but only after a flood's worth of connections
        or bytes since the last trim: a trim holds glibc's heap locks, which the verbs' threads share, so
        probes and scrapes alone never cause one."""
        slots = self.slots
        busy = slots.accepted - self._trimmed_at[0] >= TRIM_AFTER_CONNECTIONS
        busy = busy or slots.bytes_received - self._trimmed_at[1] >= TRIM_AFTER_BYTES
        if busy and self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(1.0, self._trimmed)

    def _trimmed(self) -> None:
        self._trim = None
        if self.slots.total == 0:
            self._trimmed_at = (self.slots.accepted, self.slots.bytes_received)
            trim_freed_memory()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if not sockets:
            raise ValueError("a listener serves the sockets it is given")
        config = self.config

        def make() -> BoundedHttpTools:
            make_protocol = config.http_protocol_class
            protocol = make_protocol(config=config, server_state=self.server_state, app_state=self.lifespan.state)  # type: ignore[call-arg]
            made = cast(BoundedHttpTools, protocol)
            made.budget = self.budget
            return made

        gates = []
        for sock in sockets:
            sock.listen(config.backlog)
            gate = Gate(self.slots, make, config.ssl, refuse=_busy)
            gate.start(sock)
            gates.append(gate)
        self.servers = cast(Any, gates)  # uvicorn's shutdown calls close() and wait_closed() on each
        self.started = True


def _busy(full: Full) -> bytes:
    """The 503 a plain TCP connection gets when its listener has no room for it (`Gate`)."""
    return refusal(503, TOO_MANY if full is Full.LISTENER else TOO_MANY_FROM_PEER)


GIL_SWITCH_INTERVAL_S = 0.0005
# What a listener takes in before it trims glibc's heaps once idle (`ListenerServer._idle`): a flood, not
# the kubelet's probes and Prometheus' scrapes.
TRIM_AFTER_CONNECTIONS = 64
TRIM_AFTER_BYTES = 16 * 1024 * 1024
SIDE_NICE = 10  # how much lower the webhook's and metrics' thread runs than the verbs' (CFS: about 1/10 the weight)


class _SideLoop:
    """Servers on their own event loop in a thread (uvloop where installed), done when they all are; one
    failing stops the others."""

    def __init__(self, servers: list[tuple[_Serving, socket.socket]]) -> None:
        self.servers = servers
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, name="gputopo-listeners", daemon=True)

    def _run(self) -> None:
        # A lower CPU priority for this thread (Linux: the nice value is per thread, and the threads it
        # starts inherit it): a TLS handshake flood takes the CPU the verbs thread does not need.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + SIDE_NICE)
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self._serve())
        except BaseException as e:
            self.done.set_exception(e)
        else:
            self.done.set_result(None)

    async def _serve(self) -> None:
        tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in self.servers]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        self.stop()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        for server, _ in self.servers:  # each polls its flag (uvicorn every 0.1 s)
            server.should_exit = True


async def serve(listeners: Listeners, settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve every enabled listener until SIGTERM/SIGINT (or `stop`), or until one of them fails.

    Raises ListenError before anything starts when a socket cannot be bound or the webhook's certificate
    cannot be loaded."""
    apps = {"webhook": listeners.webhook, "metrics": listeners.metrics}  # the verbs have their own server
    eps = endpoints(settings)
    from gputopo.extender.http.verbserver import VerbServer  # with the app: only once the settings are valid

    limits = ListenerLimits.of(settings)
    servers: list[tuple[_Serving, socket.socket]] = []
    try:
        for ep in eps:
            sock = _bind(ep)
            if (
                ep.name == "verbs"
            ):  # kube-scheduler's calls: the door on its own server (gputopo/extender/http/verbserver.py)
                servers.append((VerbServer(listeners.door, limits), sock))
                continue
            config = listener_config(apps[ep.name], limits, ep.tls, ep.client_ca)
            servers.append((ListenerServer(config, limits), sock))
            try:
                config.load()  # loads the certificate now, so a bad one is an error before serving starts
            except (OSError, ssl.SSLError) as e:
                flags = "--tls-cert-file/--tls-key-file" + ("/--webhook-client-ca-file" if ep.client_ca else "")
                raise ListenError(f"cannot load the webhook certificate ({flags}): {e}") from None
    except ListenError:
        for _, s in servers:
            s.close()
        raise

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread (tests): no signals
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    # The verbs here; the listeners on the pod network on their own loop (see the module doc).
    here = [(server, sock) for server, sock in servers if isinstance(server, VerbServer)]
    # Each listener on the pod network on a loop of its own: the webhook's TLS work and reviews never hold up
    # the metrics listener, where the kubelet's probes go.
    sides = [_SideLoop([(server, sock)]) for server, sock in servers if not isinstance(server, VerbServer)]
    try:
        with listeners.running():
            tasks: list[asyncio.Future[None]] = [
                asyncio.create_task(server.serve(sockets=[sock])) for server, sock in here
            ]
            for side in sides:
                side.thread.start()
                tasks.append(asyncio.wrap_future(side.done))
            stopper: asyncio.Future[Any] = asyncio.create_task(stop.wait())
            # One listener failing (or a signal) stops them all: a pod that half-serves is worse than a restart.
            await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for server, _ in here:
                server.should_exit = True
            for side in sides:
                side.stop()
            stopper.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
        for _, sock in servers:
            sock.close()


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard one; returns (before, after). Each listener holds at
    most `--max-connections`, and a soft limit of 256 or 1024 with three listeners would otherwise let
    silent connections starve kube-scheduler's and the informers'."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:  # a hard limit of infinity past the kernel's nr_open
        log.warning("cannot raise the open-files limit", extra={"soft": soft, "hard": hard, "error": str(e)})
        return soft, soft
    return soft, hard


# glibc's mallopt parameter (malloc.h): allocations from this size up are mmapped and given back to the system
# when freed. Setting it also stops glibc raising it after every large free (its default, up to 32 MiB), which
# left the buffers of a flood's connections (TLS reads of 256 KiB each, request bodies) held once they closed.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_freed_memory() -> bool:
    """Make large freed buffers go back to the system (glibc only; elsewhere nothing changes): True if set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def trim_freed_memory() -> None:
    """Give the free pages inside glibc's heaps back to the system (`malloc_trim(0)`; ctypes drops the GIL
    for it): what many small buffers of closed connections leave, which no threshold returns."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (a dependency on Linux): the verbs listener handles three requests per
    scheduled pod, and uvloop's transport and loop cost a fraction of asyncio's per request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        print(f"{PROG}: invalid settings: {describe_error(e)}", file=sys.stderr)
        return 2
    except SettingsError as e:  # an unknown flag or a flag without its value
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    raise_nofile_limit()
    return_freed_memory()
    # The verbs thread waits for the GIL at most this long behind the webhook's and metrics' thread or the
    # informers (Python's default is 5 ms): under a flood on the webhook the verbs' p99 went from 2.4-5.0 ms
    # to 0.8-0.9 ms with it (bench/listener_limits.py --part floods); at most 2,000 switches a second.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    from gputopo.extender.app import create_listeners

    try:
        listeners = create_listeners(settings)
    except ClusterFileError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(listeners, settings))
    except ListenError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
