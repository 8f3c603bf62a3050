"""The kube transport's connections (`gputopo.kube.transport`): which configurations it carries, their TLS
context and socket options, the timeouts of one request (per socket operation and as a whole), and one
kept-alive socket with its whole-deadline `recv`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

Timeout = float | tuple[float, float] | None

# Failures that mean a kept-alive connection was already dead when this request reached it (the
# server closed it while idle, or a middlebox reset it): nothing of an answer arrived.
DROPPED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
# A socket's timeout is cut to what is left of a request's deadline only once that is this much
# shorter: a quick request changes no timeout (a system call each), and a deadline is overrun by at
# most this much.
DEADLINE_SLACK_S = 0.01


def unsupported_reason(configuration: Any) -> str:
    """Why this configuration must stay on the ApiClient ('' when the lean transport carries it)."""
    parts = urlsplit(str(configuration.host))
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r}"
    if configuration.proxy:
        from kubernetes.client import rest

        bypass: Any = getattr(rest, "should_bypass_proxies", None)
        if bypass is None or not bypass(configuration.host, configuration.no_proxy or ""):
            return "a proxy"  # CONNECT tunnels and SOCKS are urllib3's, not worth repeating here
    if isinstance(getattr(configuration, "assert_hostname", None), str):
        return "assert_hostname names a host"  # urllib3 checks that name apart from SNI; this checks SNI's
    return ""


def ssl_context(configuration: Any) -> ssl.SSLContext:
    """Built once, as urllib3 builds it from the same settings."""
    if configuration.verify_ssl:
        cadata = getattr(configuration, "ca_cert_data", None)
        ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert, cadata=cadata)
        if getattr(configuration, "assert_hostname", None) is False:
            ctx.check_hostname = False
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        ctx.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    # HTTP/1.1 only: the API server would otherwise be free to pick h2, which this does not speak.
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def socket_options(configuration: Any) -> list[tuple[int, int, int]]:
    """The configuration's own socket options, else TCP keepalive when it asks for that."""
    options = getattr(configuration, "socket_options", None)
    if options is not None:
        return list(options)
    if getattr(configuration, "keep_alive", False):
        from kubernetes.utils import keepalive

        return list(keepalive.tcp_keepalive_socket_options())
    return []


def split_timeout(timeout: Timeout) -> tuple[float | None, float | None]:
    """(connect, read) timeouts; one number bounds each socket operation."""
    if isinstance(timeout, tuple):
        return timeout[0], timeout[1]
    return timeout, timeout


def total_seconds(timeout: Timeout) -> float | None:
    """How long a whole request may take: the number, or connect + read for a pair (None: no bound)."""
    if isinstance(timeout, tuple):
        return None if timeout[0] is None or timeout[1] is None else timeout[0] + timeout[1]
    return timeout


def past_deadline(seconds: float | None) -> TimeoutError:
    """A request, or a stream, ran past its whole deadline (however timely each read was)."""
    return TimeoutError(f"not done within {seconds:g} s, its whole deadline")


class Conn:
    """One kept-alive connection: its socket, and a poller that tells whether it died while idle."""

    __slots__ = ("poller", "sock", "timeout")

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self.sock = sock
        self.timeout = timeout
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def set_timeout(self, timeout: float | None) -> None:
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout

    def receiver(self, deadline: float | None, seconds: float | None) -> Callable[[int], bytes]:
        """`recv` bounded by `deadline` (time.monotonic) as a whole: each call waits at most what is
        left, so a body dripped a byte at a time cannot outlast it (one number per socket operation
        would let it run for ever)."""
        if deadline is None:
            return self.sock.recv
        recv = self.sock.recv

        def bounded(n: int) -> bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise past_deadline(seconds)
            if self.timeout is None or left < self.timeout - DEADLINE_SLACK_S:
                self.set_timeout(left)
            try:
                return recv(n)
            except TimeoutError:
                if time.monotonic() >= deadline:  # the wait was cut to what was left: say so
                    raise past_deadline(seconds) from None
                raise

        return bounded

    def idle_closed(self) -> bool:
        # An idle connection has nothing to read: readable means EOF (the server closed it) or a
        # stray byte, and either way it cannot carry the next request. One poll(2), no blocking.
        return bool(self.poller.poll(0))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def within(timeout: float | None, deadline: float | None, seconds: float | None) -> float | None:
    """A socket operation's timeout, no later than the deadline; a TimeoutError when it has passed."""
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise past_deadline(seconds)
    return left if timeout is None or left < timeout - DEADLINE_SLACK_S else timeout
