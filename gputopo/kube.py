"""The project's one Kubernetes access layer: configuration, raw-JSON requests, list+watch, retries.

Everything that talks to an API server goes through here: the extender (`extender.kube`), the node
agent, the local control plane's client and the benchmarks. The maintained `kubernetes` package
loads the configuration and carries the requests (TLS, bearer tokens and their refresh, the
connection pool); bodies and results stay plain JSON dicts, as the API server speaks them, so no
typed model objects are built (a 5,000-node list stays cheap) and one error type covers every call.

`kubernetes.watch.Watch` is not used for watches: it wants a typed API function, reads a key it
never sets for ERROR events when asked not to deserialize, and buffers an unbounded line. The watch
here decodes the stream line by line with a bounded line length and raises `Gone` on 410 (as an
HTTP status or an ERROR event) so the caller relists.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

JSON = dict[str, Any]
Query = Mapping[str, object] | Sequence[tuple[str, str]]
T = TypeVar("T")

log = logging.getLogger("gputopo.kube")

# A watch line is one event holding one object; etcd refuses objects over 1.5 MiB, so a longer line
# is a broken stream, and reading it whole would only cost memory.
MAX_LINE_BYTES = 16 * 1024 * 1024
MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"
LIST_PAGE_SIZE = 500


# --------------------------------------------------------------------------------------------------
# Errors


class KubeError(RuntimeError):
    """A non-2xx answer from the API server, or none at all (status 0: refused, TLS, timeout).

    `reason` and `message` come from the Status body when there is one; `method` and `path` name the
    request when it is known (a watch ERROR event has neither)."""

    def __init__(
        self, status: int, message: str, reason: str = "", *, method: str = "", path: str = "", body: str = ""
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.method = method
        self.path = path
        self.body = body
        text = f"{status} {reason}: {message}" if reason else f"{status}: {message}"
        super().__init__(f"{method} {path}: {text}" if method else text)


class Gone(KubeError):
    """410 Gone: the resourceVersion a watch started from was compacted away; relist."""


def status_error(status: int, body: bytes | str, *, method: str = "", path: str = "") -> KubeError:
    """The error for a non-2xx answer: reason and message parsed from a Status body, `Gone` for 410."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    reason, message = "", text
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        reason = str(doc.get("reason", "") or "")
        message = str(doc.get("message", text))
    cls = Gone if status == 410 else KubeError
    return cls(status, message, reason, method=method, path=path, body=text)


# --------------------------------------------------------------------------------------------------
# Retries: the one backoff


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff: `base_s`, `base_s*factor`, … never over `cap_s`. `attempts` bounds
    `retry`; loops that retry for ever use `delay(n)` for their n-th consecutive failure."""

    base_s: float = 0.5
    factor: float = 2.0
    cap_s: float = 8.0
    attempts: int = 4

    def delay(self, failures: int) -> float:
        return float(min(self.cap_s, self.base_s * self.factor ** max(0, failures)))

    def delays(self) -> list[float]:
        """The waits between `attempts` tries."""
        return [self.delay(i) for i in range(self.attempts - 1)]


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status", None)
    return status if isinstance(status, int) else None


def is_retryable(e: BaseException) -> bool:
    """Server-side and throttling errors and lost connections are retried; other client errors
    (403 RBAC, 422 invalid) would only fail again the same way."""
    status = _status(e)
    if status is None or status == 0:
        return True
    return status in (408, 409, 429) or status >= 500


def short_error(e: BaseException) -> str:
    """One line for a log: the Status reason when there is one."""
    reason = getattr(e, "reason", None)
    return str(reason) if reason else (str(e).splitlines() or [type(e).__name__])[0]


def retry(fn: Callable[[], T], backoff: Backoff, sleep: Callable[[float], bool], what: str) -> T:
    """Run fn, retrying retryable errors after each delay; `sleep` returns True when told to stop."""
    delays = backoff.delays()
    for attempt in range(backoff.attempts):
        try:
            return fn()
        except Exception as e:
            if attempt == backoff.attempts - 1 or not is_retryable(e):
                raise
            log.warning(
                "API call failed; retrying",
                extra={"call": what, "status": _status(e), "attempt": attempt + 1, "error": short_error(e)},
            )
            if sleep(delays[attempt]):
                raise
    raise AssertionError("unreachable")  # the loop either returns or raises


def run_list_watch(
    *,
    stop: threading.Event,
    needs_list: Callable[[], bool],
    relist: Callable[[], None],
    watch_once: Callable[[], None],
    backoff: Backoff,
    context: Mapping[str, str],
    min_watch_s: float = 0.0,
) -> None:
    """The body of a list+watch thread: list when `needs_list()`, then watch until the watch ends;
    failures wait `backoff` (doubling, capped) and try again until `stop` is set. A watch that ends
    in under `min_watch_s` also waits, so a server that closes watches at once is not hammered.
    (`watch_once` handles 410 Gone itself by relisting: it is not a failure.)"""
    failures = 0
    while not stop.is_set():
        try:
            if needs_list():
                relist()
            started = time.monotonic()
            watch_once()
            if time.monotonic() - started >= min_watch_s:
                failures = 0
                continue
            wait = backoff.delay(failures)
        except Exception as e:
            if stop.is_set():
                return
            wait = backoff.delay(failures)
            log.warning(
                "list/watch failed; serving what was last seen, retrying",
                extra={**context, "error": str(e), "retry_in_s": round(wait, 2)},
            )
        failures += 1
        if stop.wait(wait):
            return


# --------------------------------------------------------------------------------------------------
# Configuration


def find_kubeconfig(explicit: str | Path | None) -> Path | None:
    """The kubeconfig to use: `explicit`, else the first of $KUBECONFIG, else ~/.kube/config when it
    exists; None means in-cluster configuration."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if env:
        return Path(env)
    home = Path.home() / ".kube" / "config"
    return home if home.exists() else None


def client_configuration(kubeconfig: str | Path | None, *, pool_size: int = 64) -> Any:
    """A `kubernetes.client.Configuration` from this kubeconfig file, or in-cluster when None."""
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    cfg: Any = k8s_client.Configuration()
    if kubeconfig is not None:
        k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    else:
        k8s_config.load_incluster_config(client_configuration=cfg)
    # The extender binds on many server threads at once, each making several calls: a smaller pool
    # discards connections under load, and every new one costs a TLS handshake on both sides.
    cfg.connection_pool_maxsize = pool_size
    # The kubeconfig loader's refresh hook re-assigns `host` before every request, and the client
    # then re-reads the proxy settings from the whole environment each time. Pin the proxy it
    # resolved at start-up (the same value) so requests skip that scan.
    cfg.proxy = cfg.proxy
    return cfg


# --------------------------------------------------------------------------------------------------
# Paths


def node_path(name: str = "") -> str:
    return f"/api/v1/nodes/{quote(name)}" if name else "/api/v1/nodes"


def pods_path(namespace: str = "") -> str:
    """All namespaces' pods when `namespace` is empty."""
    return f"/api/v1/namespaces/{quote(namespace)}/pods" if namespace else "/api/v1/pods"


def pod_path(namespace: str, name: str) -> str:
    return f"{pods_path(namespace)}/{quote(name)}"


def lease_path(namespace: str, name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"
    return f"{base}/{quote(name)}" if name else base


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/events"


def micro_time(t: datetime) -> str:
    """A MicroTime (Lease renewTime, Event eventTime) in UTC."""
    return t.astimezone(UTC).strftime(MICROTIME)


# --------------------------------------------------------------------------------------------------
# Watch decoding


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    object: JSON


def iter_lines(chunks: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """Non-blank lines of a chunked stream. A line longer than `max_line_bytes` is dropped (logged)
    while it streams past, so one broken event costs neither memory nor the rest of the watch."""

    def too_long() -> None:
        log.warning("skipped a watch line longer than the limit", extra={"limit_bytes": max_line_bytes})

    buf = b""
    skipping = False  # inside an overlong line whose start was already dropped
    for chunk in chunks:
        buf += chunk
        while True:
            cut = buf.find(b"\n")
            if cut < 0:
                break
            line, buf = buf[:cut], buf[cut + 1 :]
            if skipping:
                skipping = False
            elif len(line) > max_line_bytes:
                too_long()
            elif line.strip():
                yield line
        if len(buf) > max_line_bytes:
            if not skipping:
                too_long()
            skipping, buf = True, b""
    if buf.strip() and not skipping:
        yield buf


def decode_event(line: bytes) -> WatchEvent | None:
    """The line's event; None for a line that is not a JSON object (skipped and logged: raising would
    reconnect from the same resourceVersion and meet the same line again). An ERROR event raises its
    Status as `KubeError` (`Gone` for 410)."""
    try:
        doc = json.loads(line)
    except ValueError as e:
        log.warning("skipped a watch line that is not JSON", extra={"error": str(e)[:200]})
        return None
    if not isinstance(doc, dict):
        log.warning("skipped a watch line that is not a JSON object")
        return None
    etype = str(doc.get("type", ""))
    obj = doc.get("object")
    obj = obj if isinstance(obj, dict) else {}
    if etype == "ERROR":
        code = int(obj.get("code", 0) or 0)
        cls = Gone if code == 410 else KubeError
        raise cls(code, str(obj.get("message", "")), str(obj.get("reason", "") or ""))
    return WatchEvent(etype, obj)


def _pairs(query: Query | None) -> list[tuple[str, str]]:
    if query is None:
        return []
    if isinstance(query, Mapping):
        return [(str(k), str(v)) for k, v in query.items()]
    return [(str(k), str(v)) for k, v in query]


# --------------------------------------------------------------------------------------------------
# The client


class Kube:
    """One API server: raw-JSON requests by path, paged lists, watches, and the project's typed writes.

    `kubeconfig` None means in-cluster configuration (`find_kubeconfig` does the usual lookup first).
    `request_timeout` applies to calls that name none (None: wait as long as it takes)."""

    def __init__(
        self,
        kubeconfig: str | Path | None,
        *,
        request_timeout: float | None = 10.0,
        pool_size: int = 64,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        from kubernetes import client as k8s_client

        self.configuration: Any = client_configuration(kubeconfig, pool_size=pool_size)
        self.api_client: Any = k8s_client.ApiClient(configuration=self.configuration)
        self._api_exception: type[Exception] = k8s_client.ApiException
        self.request_timeout = request_timeout
        self.max_line_bytes = max_line_bytes
        self._streams_lock = threading.Lock()
        self._streams: set[Any] = set()

    # ------------------------------------------------------------------ raw requests

    def _send(
        self,
        method: str,
        path: str,
        body: JSON | None,
        query: Query | None,
        content_type: str,
        timeout: float | tuple[float, float] | None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        m, url, hdrs, b, _ = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=_pairs(query) or None,
            header_params=headers,
            body=body,  # a dict: the client encodes it (a pre-encoded str would be sent as a JSON string)
            auth_settings=["BearerToken"],
        )
        try:
            return self.api_client.call_api(
                m, url, header_params=hdrs, body=b, _request_timeout=timeout or self.request_timeout
            )
        except self._api_exception as e:
            status = int(getattr(e, "status", 0) or 0)
            text = str(getattr(e, "body", "") or getattr(e, "reason", "") or e)
            raise status_error(status, text, method=method, path=path) from None
        except Exception as e:  # connection refused, TLS, timeouts: urllib3's many exception types
            raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Query | None = None,
        content_type: str = "application/json",
        timeout: float | tuple[float, float] | None = None,
    ) -> JSON:
        """One call; the decoded JSON answer ({} when empty). Raises `KubeError` (`Gone` for 410)."""
        resp = self._send(method, path, dict(body) if body is not None else None, query, content_type, timeout)
        try:
            data: bytes = resp.read() or b""
        except Exception as e:  # the connection broke while the body streamed in
            raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None
        status = int(resp.status)
        if not 200 <= status <= 299:
            raise status_error(status, data, method=method, path=path)
        if not data:
            return {}
        out: JSON = json.loads(data)
        return out

    def get(self, path: str, *, query: Query | None = None) -> JSON:
        return self.request("GET", path, query=query)

    def create(self, path: str, body: Mapping[str, Any]) -> JSON:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> JSON:
        """JSON merge patch: only the named fields change (a None value removes one)."""
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> JSON:
        return self.request("DELETE", path, body)

    def list_items(
        self,
        path: str,
        *,
        label_selector: str = "",
        field_selector: str = "",
        timeout: float | None = 60.0,
    ) -> tuple[list[JSON], str]:
        """Every item at a collection path, in pages, and the list's resourceVersion (to watch from)."""
        items: list[JSON] = []
        cont, rv = "", ""
        while True:
            query = [("limit", str(LIST_PAGE_SIZE))]
            query += [("labelSelector", label_selector)] if label_selector else []
            query += [("fieldSelector", field_selector)] if field_selector else []
            query += [("continue", cont)] if cont else []
            doc = self.request("GET", path, query=query, timeout=timeout)
            items.extend(doc.get("items") or [])
            meta = doc.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            cont = str(meta.get("continue") or "")
            if not cont:
                return items, rv

    def watch(
        self,
        path: str,
        resource_version: str,
        *,
        timeout_seconds: int,
        label_selector: str = "",
        field_selector: str = "",
        bookmarks: bool = True,
    ) -> Iterator[WatchEvent]:
        """Changes at a collection path after `resource_version` (BOOKMARK events included when
        `bookmarks`), until the server ends the watch after `timeout_seconds` or `close()` aborts it.
        Raises `Gone` on 410 and `KubeError` on any other failure."""
        query = [("watch", "true"), ("resourceVersion", resource_version), ("timeoutSeconds", str(timeout_seconds))]
        query += [("allowWatchBookmarks", "true")] if bookmarks else []
        query += [("labelSelector", label_selector)] if label_selector else []
        query += [("fieldSelector", field_selector)] if field_selector else []
        resp = self._send("GET", path, None, query, "application/json", (10.0, timeout_seconds + 30.0))
        raw = resp.response  # the urllib3 response, not yet read
        with self._streams_lock:
            self._streams.add(raw)
        finished = False
        try:
            if not 200 <= int(resp.status) <= 299:
                raise status_error(int(resp.status), resp.read() or b"", method="GET", path=path)
            try:
                for line in iter_lines(raw.stream(65536, decode_content=True), self.max_line_bytes):
                    event = decode_event(line)
                    if event is not None:
                        yield event
            except KubeError:
                raise
            except Exception as e:  # the stream broke (or close() aborted it)
                raise KubeError(0, f"{type(e).__name__}: {e}", method="GET", path=path) from None
            finished = True
        finally:
            with self._streams_lock:
                self._streams.discard(raw)
            if not finished:
                # Left mid-stream (the caller stopped, or an error): the connection still carries the
                # rest of the watch, so it must not go back to the pool for another request.
                with contextlib.suppress(Exception):
                    raw.close()
            raw.release_conn()

    def close(self) -> None:
        """Abort watches in progress (a thread blocked reading one wakes with an error) and close the pool."""
        with self._streams_lock:
            streams = list(self._streams)
        for raw in streams:
            with contextlib.suppress(Exception):
                getattr(raw, "shutdown", raw.close)()
        self.api_client.close()

    # ------------------------------------------------------------------ the project's writes

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
        """POST pods/binding. The API server copies the Binding's annotations onto the pod in the same
        update that sets spec.nodeName (the pod registry's BindingREST), so one call places and binds."""
        meta: JSON = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if annotations:
            meta["annotations"] = dict(annotations)
        body: JSON = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self.create(f"{pod_path(namespace, name)}/binding", body)

    def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        """A core/v1 Event."""
        self.create(events_path(namespace), event)

    def patch_node_metadata(
        self, name: str, *, annotations: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None
    ) -> JSON:
        """Merge-patch a Node's annotations and labels: only the named keys change."""
        metadata: JSON = {}
        if annotations:
            metadata["annotations"] = dict(annotations)
        if labels:
            metadata["labels"] = dict(labels)
        return self.merge_patch(node_path(name), {"metadata": metadata})

    def create_lease(
        self,
        namespace: str,
        name: str,
        *,
        holder: str,
        renew_time: datetime,
        duration_s: int,
        labels: Mapping[str, str] | None = None,
    ) -> JSON:
        """A coordination/v1 Lease, acquired and renewed at `renew_time`."""
        now = micro_time(renew_time)
        meta: JSON = {"name": name, "namespace": namespace}
        if labels:
            meta["labels"] = dict(labels)
        spec = {"holderIdentity": holder, "leaseDurationSeconds": duration_s, "acquireTime": now, "renewTime": now}
        body: JSON = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        return self.create(lease_path(namespace), body)

    def renew_lease(self, namespace: str, name: str, *, holder: str, renew_time: datetime, duration_s: int) -> JSON:
        """Update an existing Lease's holder, renewTime and duration; `KubeError` 404 when it does not exist."""
        spec = {"holderIdentity": holder, "renewTime": micro_time(renew_time), "leaseDurationSeconds": duration_s}
        return self.merge_patch(lease_path(namespace, name), {"spec": spec})
