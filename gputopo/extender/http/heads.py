"""What a webhook or metrics listener decides from a request's head alone, before any byte of its body is read
(`HeadPolicy`), and the bytes of request bodies a listener holds at once, over all its connections (`BodyBudget`).

`BoundedHttpTools.on_headers_complete` (gputopo/extender/http/uvicornprotocol.py) asks `HeadPolicy.decide` with the
method, the path, the headers and the connection's TLS extension. A refusal is answered there, the connection closes,
and the body is never read (nor is a `100 Continue` sent):

- a body sent to a path that reads none: 404 for a path the listener does not serve, 405 for a body path asked
  with another method, 413 for a path that takes no body (`GET /healthz` with 8 MiB);
- a guarded path (`/mutate` with `--webhook-client-ca-file`) without an allowed client certificate: 401 / 403,
  whether or not a body follows;
- a declared length over `--max-request-bytes` (or unreadable): 413;
- a declared length the listener's `BodyBudget` cannot hold now, in all or of the caller's address: 503
  (bodies of other connections are being read; the client retries). A chunked body takes from the budget as
  it streams in and is refused the same way the moment it does not fit.
"""

from __future__ import annotations

import collections
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputopo.extender.http.clientauth import ClientAuth

__all__ = ["BodyBudget", "HeadDecision", "HeadPolicy", "budget_full"]


def budget_full(limit: int) -> str:
    return f"request bodies being read on this listener would pass {limit} bytes (--max-body-bytes-in-flight)"


@dataclass(frozen=True)
class HeadDecision:
    """`refusal`: (status, text) to answer without reading the body, or None; `declared`: the body's declared
    length (0 without one); `chunked`: its length is unknown until it ends."""

    refusal: tuple[int, str] | None = None
    declared: int = 0
    chunked: bool = False


def _declared(headers: Sequence[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """(declared Content-Length, -1 when unreadable; chunked) from lower-cased headers."""
    length: int | None = None
    chunked = False
    for name, value in headers:
        if name == b"content-length":
            try:
                length = int(value) if len(value) <= 20 and value.strip().isdigit() else -1
            except ValueError:
                length = -1
        elif name == b"transfer-encoding":
            chunked = True
    return length, chunked


@dataclass(frozen=True)
class HeadPolicy:
    """One listener's rules for request heads (see the module doc).

    - `paths`: every path the listener serves; `body_paths`: those whose POST body it reads;
    - `guarded`: the body paths only some clients may call, with who (`ClientAuth`);
    - `max_request_bytes`: `--max-request-bytes`;
    - `refused`: told (path, status) of every request refused from its head (the app's decision counters)."""

    paths: frozenset[str] = frozenset()
    body_paths: frozenset[str] = frozenset()
    guarded: Mapping[str, ClientAuth] = field(default_factory=dict)
    max_request_bytes: int = 8 * 1024 * 1024
    refused: Callable[[str, int], None] | None = None

    def decide(
        self, method: bytes, path: str, headers: Sequence[tuple[bytes, bytes]], tls: Mapping[str, Any] | None
    ) -> HeadDecision:
        if "%" in path:  # as uvicorn routes it: "/mut%61te" is /mutate
            path = urllib.parse.unquote(path)
        declared, chunked = _declared(headers)
        has_body = chunked or (declared is not None and declared != 0)
        wants_body = method == b"POST" and path in self.body_paths
        auth = self.guarded.get(path)
        if auth is not None and method == b"POST":
            refused = auth.refusal({"extensions": {"tls": tls}} if tls is not None else {})
            if refused is not None:
                return HeadDecision(refused)
        if has_body and not wants_body:
            if path not in self.paths:
                return HeadDecision((404, f"{path[:200]} is not served on this listener"))
            if path in self.body_paths:
                return HeadDecision((405, f"{path} takes POST"))
            return HeadDecision((413, f"{method.decode('latin-1')[:16]} {path} takes no request body"))
        if declared is not None and (declared < 0 or declared > self.max_request_bytes):
            return HeadDecision(
                (413, f"request body is larger than {self.max_request_bytes} bytes (--max-request-bytes)")
            )
        return HeadDecision(None, max(declared or 0, 0), chunked)

    def trusted(self, tls: Mapping[str, Any] | None) -> bool:
        """Whether the connection's client certificate is one a guarded path answers (the API server's)."""
        if tls is None or not self.guarded:
            return False
        scope = {"extensions": {"tls": tls}}
        return any(auth.refusal(scope) is None for auth in self.guarded.values())


class BodyBudget:
    """The bytes of request bodies one listener holds at once, over all its connections: each request takes
    its declared length at its head (a chunked one as it arrives) and gives it back once it is answered or its
    connection ends. With `per_peer`, one client address holds at most that much of it, so a flood from a few
    addresses leaves room for the API server's reviews. Used on one event loop only: no lock."""

    def __init__(self, limit: int, per_peer: int | None = None) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self.held = 0
        self.peak = 0
        self.by_peer: collections.Counter[str] = collections.Counter()

    def refusal(self, size: int, peer: str | None = None) -> str | None:
        """Take `size` bytes for `peer`; or the refusal's text when they do not fit (nothing taken)."""
        if self.held + size > self.limit:
            return budget_full(self.limit)
        if peer is not None and self.per_peer is not None and self.by_peer[peer] + size > self.per_peer:
            return (
                f"request bodies from {peer[:64]} being read would pass {self.per_peer} bytes "
                "(its share of --max-body-bytes-in-flight)"
            )
        self.held += size
        self.peak = max(self.peak, self.held)
        if peer is not None and size:
            self.by_peer[peer] += size
        return None

    def take(self, size: int, peer: str | None = None) -> bool:
        return self.refusal(size, peer) is None

    def give(self, size: int, peer: str | None = None) -> None:
        self.held -= size
        if peer is not None and size:
            self.by_peer[peer] -= size
            if self.by_peer[peer] <= 0:
                del self.by_peer[peer]
