"""The agent's /metrics listener (`--metrics-port`): prometheus_client's WSGI app on a threaded server that holds
a bounded number of connections, in all and per client address, each for a bounded time.

prometheus_client's own `start_http_server` starts a thread per connection with no cap and no timeout, so
silent connections held threads (and their stacks) for ever. Here a connection past `max_connections` (or
past `max_per_peer` from its address) gets 503 and is closed at once, without a thread; one that sends nothing
for `timeout_s` (a timeout per read: a drip keeps it) is closed. The app reads no request body: a request is
answered from its head and the connection closed (the standard library's WSGI handler serves one request per
connection), so a body is never read.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

__all__ = ["BoundedMetricsServer", "serve_metrics"]

BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 37\r\n"
    b"connection: close\r\n\r\ntoo many open connections to /metrics"
)


class _Handler(WSGIRequestHandler):
    timeout = 10.0  # per read of the request (StreamRequestHandler sets it as the socket's timeout)

    def log_message(self, format: str, *args: Any) -> None:  # the standard library's names
        """Log nothing (a scrape every few seconds)."""


class BoundedMetricsServer(ThreadingWSGIServer):
    """`ThreadingWSGIServer` under `max_connections` and `max_per_peer` (see the module doc)."""

    max_connections = 32
    max_per_peer = 8

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.held = 0
        self.per_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0]) if isinstance(client_address, tuple) else "?"
        with self._lock:
            full = self.held >= self.max_connections or self.per_peer[peer] >= self.max_per_peer
            if not full:
                self.held += 1
                self.per_peer[peer] += 1
        if full:
            self.refused += 1
            with contextlib.suppress(OSError):  # a few bytes: the socket's buffer takes them
                request.sendall(BUSY)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or left: nothing to report (the standard library prints a traceback)."""

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            peer = str(client_address[0]) if isinstance(client_address, tuple) else "?"
            with self._lock:
                self.held -= 1
                self.per_peer[peer] -= 1
                if not self.per_peer[peer]:
                    del self.per_peer[peer]


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
