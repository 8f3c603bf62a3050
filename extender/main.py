"""`gputopo-extender`: settings from flags and GPUTOPO_* environment variables (pydantic-settings, flags win;
docs/configuration.md), then one asyncio loop serving three listeners over one cache and service:

- the scheduling verbs on `--host`/`--port` (plain HTTP, loopback only: kube-scheduler in the same pod);
- the mutating webhook on `--webhook-host`/`--webhook-port` over TLS (off unless `--webhook-port` is set);
- Prometheus metrics on `--metrics-host`/`--metrics-port` (0 turns it off).

Every socket is bound before anything starts, so a port in use is one line naming its flag, not a half-started
process. The lifespan (informers, `Listeners.running`) is entered once for all three servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError

from extender.bounded import ListenerLimits, bounded_protocol
from extender.settings import PROG, Settings, describe_error, load_settings
from gputopo.clusterfile import ClusterFileError
from gputopo.jsonlog import configure_logging

if TYPE_CHECKING:  # the app (cache, engine) is imported only once the settings are valid
    from extender.app import Listeners
    from extender.limits import ASGIApp

__all__ = [
    "Endpoint",
    "ListenError",
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


def endpoints(settings: Settings) -> list[Endpoint]:
    """The enabled listeners, verbs first."""
    out = [Endpoint("verbs", settings.host, settings.port, "--host/--port")]
    if settings.webhook_port:
        assert settings.tls_cert_file is not None and settings.tls_key_file is not None  # Settings checks it
        tls = (settings.tls_cert_file, settings.tls_key_file)
        out.append(
            Endpoint("webhook", settings.webhook_host, settings.webhook_port, "--webhook-host/--webhook-port", tls)
        )
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


def listener_config(app: ASGIApp, limits: ListenerLimits, tls: tuple[Path, Path] | None = None) -> uvicorn.Config:
    """uvicorn's configuration for the webhook or metrics listener: its protocol holds `limits`, and sends
    100 Continue only for the POST paths the app serves."""
    state = getattr(app, "state", None)
    posts: frozenset[str] = getattr(state, "post_paths", frozenset())  # set by extender.app
    return uvicorn.Config(
        app,
        lifespan="off",  # entered once in `serve`, for all listeners
        log_config=None,
        access_log=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        http=bounded_protocol(limits, posts),  # head cap, read deadline, idle timeout, connection cap
        ws="none",
    )


class _Server(uvicorn.Server):
    """A uvicorn server whose signals `serve` handles once for all listeners (uvicorn's own handler would
    stop only the server that installed it last)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(listeners: Listeners, settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve every enabled listener until SIGTERM/SIGINT (or `stop`), or until one of them fails.

    Raises ListenError before anything starts when a socket cannot be bound or the webhook's certificate
    cannot be loaded."""
    apps = {"webhook": listeners.webhook, "metrics": listeners.metrics}  # the verbs have their own server
    eps = endpoints(settings)
    from extender.verbserver import VerbServer  # with the app: only once the settings are valid

    limits = ListenerLimits.of(settings)
    servers: list[tuple[_Serving, socket.socket]] = []
    try:
        for ep in eps:
            sock = _bind(ep)
            if ep.name == "verbs":  # kube-scheduler's calls: the door on its own server (extender/verbserver.py)
                servers.append((VerbServer(listeners.door, limits), sock))
                continue
            config = listener_config(apps[ep.name], limits, ep.tls)
            servers.append((_Server(config), sock))
            try:
                config.load()  # loads the certificate now, so a bad one is an error before serving starts
            except (OSError, ssl.SSLError) as e:
                raise ListenError(
                    f"cannot load the webhook certificate (--tls-cert-file/--tls-key-file): {e}"
                ) from None
    except ListenError:
        for _, s in servers:
            s.close()
        raise

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread (tests): no signals
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        with listeners.running():
            tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in servers]
            stopper = asyncio.create_task(stop.wait())
            # One listener failing (or a signal) stops them all: a pod that half-serves is worse than a restart.
            await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for server, _ in servers:
                server.should_exit = True
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

    from extender.app import create_listeners

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
