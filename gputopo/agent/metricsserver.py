"""The agent's /metrics listener (`--metrics-port`): prometheus_client's WSGI app on a threaded server that holds
a bounded number of connections, in all and per client address, each for a bounded time, and shares them fairly
across addresses.

prometheus_client's own `start_http_server` starts a thread per connection with no cap and no timeout, so
silent connections held threads (and their stacks) for ever. Here every connection is counted at its accept by
the same `gputopo.listenguard.acceptgate.Slots` as the extender's listeners: when the listener holds
`max_connections`, a connection from an address holding fewer than the address that holds the most takes the
place of that address's oldest connection whose request head is not in yet (it is closed), so a few addresses
holding silent or dripping connections cannot starve Prometheus. One that finds no room (its address holds
`max_per_peer`, or as many as the most) gets 503 and is closed at once, without a thread; one that sends
nothing for `timeout_s` (a timeout per read: a drip keeps it, until a newcomer needs its place) is closed.
The app reads no request body: a request is answered from its head and the connection closed (the standard
library's WSGI handler serves one request per connection), so a body is never read.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from gputopo.listenguard.acceptgate import Slots

__all__ = ["BoundedMetricsServer", "serve_metrics"]

BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 37\r\n"
    b"connection: close\r\n\r\ntoo many open connections to /metrics"
)


@dataclass(frozen=True)
class _Limits:
    """`Slots`' limits for a plain HTTP listener (no TLS handshakes)."""

    max_connections: int
    max_connections_per_peer: int
    handshake_timeout_s: float = 0.0
    handshakes_per_peer_per_s: float = 0.0
    handshakes_per_s: float = 0.0


class _Connection:
    """One connection's place in the server's `Slots`, from its accept until its thread ends or it is evicted."""

    def __init__(self, server: BoundedMetricsServer, request: socket.socket, peer: str) -> None:
        self.server = server
        self.request = request
        self.peer = peer
        self.held = True
        self.answering = False  # its request head is in: it is answered now, and never evicted

    def evictable(self) -> bool:
        return not self.answering

    def evict(self) -> None:
        """Give the place back (under the server's lock, as `Slots.take` runs) and close the connection: its
        thread's read ends and the thread with it."""
        self.server.give_back(self)
        self.server.evicted += 1
        with contextlib.suppress(OSError):
            self.request.shutdown(socket.SHUT_RDWR)


class _Handler(WSGIRequestHandler):
    timeout = 10.0  # per read of the request (StreamRequestHandler sets it as the socket's timeout)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:  # the head is in: from now on the request is answered, not evicted
            server: Any = self.server
            server.answering(self.request)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:  # the standard library's names
        """Log nothing (a scrape every few seconds)."""


def _peer(client_address: Any) -> str:
    return str(client_address[0]) if isinstance(client_address, tuple) else "?"


class BoundedMetricsServer(ThreadingWSGIServer):
    """`ThreadingWSGIServer` under `max_connections` and `max_per_peer`, shared fairly across addresses (see
    the module doc)."""

    max_connections = 32
    max_per_peer = 8
    # The kernel's accept queue: socketserver's 5 made a scrape's SYN wait a 1 s retransmit behind a burst of
    # connections the server had not yet accepted (and counted, or evicted).
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slots = Slots(_Limits(self.max_connections, self.max_per_peer))
        self.connections: dict[socket.socket, _Connection] = {}
        self.refused = 0
        self.evicted = 0
        self._lock = threading.Lock()  # the slots are taken on the accepting thread, given back on the handlers'
        super().__init__(*args, **kwargs)

    @property
    def held(self) -> int:
        return self.slots.total

    @property
    def per_peer(self) -> Counter[str]:
        return self.slots.per_peer

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = _peer(client_address)
        with self._lock:
            full = self.slots.take(peer)  # may evict another address's connection (`_Connection.evict`)
            if full is None:
                held = self.connections[request] = _Connection(self, request, peer)
                self.slots.hold(held)
        if full is not None:
            self.refused += 1
            with contextlib.suppress(OSError):  # a few bytes: the socket's buffer takes them
                request.sendall(BUSY)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def answering(self, request: socket.socket) -> None:
        with self._lock:
            held = self.connections.get(request)
            if held is not None:
                held.answering = True

    def give_back(self, held: _Connection) -> None:
        """Under `_lock`: `held`'s place, once."""
        if held.held:
            held.held = False
            self.connections.pop(held.request, None)
            self.slots.drop(held)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out, left or was evicted: nothing to report (the standard library prints a
        traceback)."""

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                held = self.connections.get(request)
                if held is not None:
                    self.give_back(held)


def serve_metrics(
    port: int, registry: CollectorRegistry, host: str = "0.0.0.0", timeout_s: float | None = None
) -> tuple[BoundedMetricsServer, threading.Thread]:
    """Serve `registry` on `host`:`port` in a daemon thread; (server, thread). Stop with `server.shutdown()`."""
    handler: type[_Handler] = _Handler
    if timeout_s is not None:
        handler = type("_Handler", (_Handler,), {"timeout": timeout_s})
    server_class: type[BoundedMetricsServer] = BoundedMetricsServer
    if ":" in host:
        server_class = type("BoundedMetricsServer6", (BoundedMetricsServer,), {"address_family": socket.AF_INET6})
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=handler)
    thread = threading.Thread(target=server.serve_forever, name="gputopo-metrics", daemon=True)
    thread.start()
    return server, thread
