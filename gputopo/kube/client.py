"""The client: raw-JSON requests by path, paged lists, watches, and the project's typed writes.

Every request, watches included, goes over the layer's own lean transport (`transport`: one pool of
kept-alive connections, one write per request, orjson bodies); the `kubernetes` package loads the
configuration (kubeconfig or in-cluster, token refresh, exec plugins) and carries every request only
when the configuration names a proxy (then its urllib3 pool is the one pool). Bodies and results
stay plain JSON dicts, as the API server speaks them, so no typed model objects are built (a
5,000-node list stays cheap) and one error type covers every call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from gputopo.kube import jsonbody
from gputopo.kube.config import client_configuration
from gputopo.kube.errors import KubeError, status_error
from gputopo.kube.paths import (
    JSON,
    binding_path,
    events_path,
    lease_path,
    micro_time,
    node_path,
    resourceclaim_path,
)
from gputopo.kube.transport import (
    MAX_BODY_BYTES,
    RECV_BYTES,
    Stream,
    TooLong,
    Transport,
    past_deadline,
    total_seconds,
    unsupported_reason,
)
from gputopo.kube.watch import MAX_LINE_BYTES, WatchEvent, decode_event, iter_lines

Query = Mapping[str, object] | Sequence[tuple[str, str]]

LIST_PAGE_SIZE = 500
# A list follows continue tokens for at most this many pages (500,000 objects at LIST_PAGE_SIZE, over
# three times the 150,000 pods Kubernetes supports in one cluster), and keeps at most that many
# objects however the server pages: a server that never stops answering a continue token would
# otherwise be asked for ever, and every page kept.
MAX_LIST_PAGES = 1000
# A watch connects within WATCH_CONNECT_S and asks the server to end it after timeoutSeconds; one
# still streaming WATCH_GRACE_S later is broken (each read on time, the whole not), and is cut.
WATCH_CONNECT_S = 10.0
WATCH_GRACE_S = 30.0
# A watch refused with an error answer: its Status is small; more is not read.
ERROR_BODY_BYTES = 1024 * 1024
USER_AGENT = "gputopo"


class _ApiClientStream:
    """A watch through the ApiClient (a proxy is configured): its urllib3 response, as a `Stream`."""

    def __init__(self, resp: Any, path: str, total_s: float) -> None:
        self.raw = resp.response  # the urllib3 response, not yet read
        self.status = int(resp.status)
        self.path = path
        self.total_s = total_s
        self.deadline = time.monotonic() + total_s

    def _failed(self, e: Exception) -> KubeError:
        return KubeError(0, f"{type(e).__name__}: {e}", method="GET", path=self.path)

    def chunks(self) -> Iterator[bytes]:
        try:
            for chunk in self.raw.stream(65536, decode_content=True):
                if time.monotonic() >= self.deadline:  # checked between reads; each read has its timeout
                    raise past_deadline(self.total_s)
                yield chunk
        except Exception as e:  # the stream broke (or close() aborted it)
            raise self._failed(e) from None

    def read(self, limit: int) -> bytes:
        try:
            return bytes(self.raw.read(limit) or b"")
        except Exception as e:
            raise self._failed(e) from None

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            getattr(self.raw, "shutdown", self.raw.close)()

    def close(self, finished: bool) -> None:
        if not finished:
            with contextlib.suppress(Exception):
                self.raw.close()
        self.raw.release_conn()


def _plain(body: Mapping[str, Any] | list[Any]) -> JSON | list[Any]:
    """A request body as the client encodes it: an object (a dict), or a JSON patch's list of operations."""
    return body if isinstance(body, list) else dict(body)


def _pairs(query: Query | None) -> list[tuple[str, str]]:
    if query is None:
        return []
    if isinstance(query, Mapping):
        return [(str(k), str(v)) for k, v in query.items()]
    return [(str(k), str(v)) for k, v in query]


class Kube:
    """One API server: raw-JSON requests by path, paged lists, watches, and the project's typed writes.

    `kubeconfig` None means in-cluster configuration (`find_kubeconfig` does the usual lookup first).
    `request_timeout` applies to calls that name none (None: wait as long as it takes): a call's
    timeout bounds it whole, from connecting to the answer's last byte. `pool_size` bounds the idle
    connections its one pool keeps; `max_body_bytes` an answer read whole; `max_list_pages` the
    pages one list follows (`MAX_LIST_PAGES`). One `Kube` per process: its parts share it (and so
    its pool)."""

    def __init__(
        self,
        kubeconfig: str | Path | None,
        *,
        request_timeout: float | None = 10.0,
        pool_size: int = 64,
        max_line_bytes: int = MAX_LINE_BYTES,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_list_pages: int = MAX_LIST_PAGES,
    ) -> None:
        self.configuration: Any = client_configuration(kubeconfig, pool_size=pool_size)
        # None for a proxy or another scheme: the ApiClient's urllib3 pool tunnels; `unsupported_reason`.
        self.transport: Transport | None = None
        self.api_client: Any = None
        if unsupported_reason(self.configuration):
            from kubernetes import client as k8s_client

            self.api_client = k8s_client.ApiClient(configuration=self.configuration)
            self._api_exception: type[Exception] = k8s_client.ApiException
        else:
            self.transport = Transport(
                self.configuration, pool_size=pool_size, user_agent=USER_AGENT, max_body_bytes=max_body_bytes
            )
        self.request_timeout = request_timeout
        self.max_line_bytes = max_line_bytes
        self.max_body_bytes = max_body_bytes
        self.max_list_pages = max_list_pages
        self._streams_lock = threading.Lock()
        self._streams: set[Any] = set()  # `Stream`s, or the ApiClient's urllib3 responses

    # ------------------------------------------------------------------ raw requests

    def _send(
        self,
        method: str,
        path: str,
        body: JSON | list[Any] | None,
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
        body: Mapping[str, Any] | list[Any] | None = None,
        *,
        query: Query | None = None,
        content_type: str = "application/json",
        timeout: float | tuple[float, float] | None = None,
    ) -> JSON:
        """One call, done within `timeout` (else `request_timeout`) from connecting to the answer's
        last byte; the decoded JSON answer ({} when empty). Raises `KubeError` (`Gone` for 410)."""
        timeout = timeout or self.request_timeout
        if self.transport is not None:
            payload = orjson.dumps(_plain(body)) if body is not None else None
            status, data = self.transport.request(method, path, _pairs(query), payload, content_type, timeout)
        else:
            seconds = total_seconds(timeout)
            deadline = None if seconds is None else time.monotonic() + seconds
            resp = self._send(method, path, _plain(body) if body is not None else None, query, content_type, timeout)
            data = self._read_body(resp.response, deadline, seconds, method, path)
            status = int(resp.status)
        if not 200 <= status <= 299:
            raise status_error(status, data, method=method, path=path)
        if not data:
            return {}
        try:
            out = jsonbody.loads(data)  # one tenant's deeply nested value never makes a whole list unreadable
        except orjson.JSONDecodeError as e:
            raise KubeError(status, f"the answer is not JSON: {e}", method=method, path=path) from None
        if not isinstance(out, dict):
            raise KubeError(status, f"the answer is JSON {type(out).__name__}, not an object", method=method, path=path)
        return out

    def _read_body(self, raw: Any, deadline: float | None, seconds: float | None, method: str, path: str) -> bytes:
        """An ApiClient answer's body (its urllib3 response), read as it arrives: at most
        `max_body_bytes`, and no read begun after `deadline` (urllib3's timeouts bound each read)."""
        out = bytearray()
        read = getattr(raw, "read1", None) or raw.read  # read1 (urllib3 2): what has arrived, not `n` bytes
        try:
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    raise past_deadline(seconds)
                chunk = read(RECV_BYTES)
                if not chunk:
                    break
                out += chunk
                if len(out) > self.max_body_bytes:
                    raise TooLong(f"an answer over the limit of {self.max_body_bytes} bytes")
        except Exception as e:  # the connection broke while the body streamed in, or ran too long
            with contextlib.suppress(Exception):
                raw.close()
            raise KubeError(0, f"{type(e).__name__}: {e}", method=method, path=path) from None
        with contextlib.suppress(Exception):
            raw.release_conn()
        return bytes(out)

    def get(self, path: str, *, query: Query | None = None) -> JSON:
        return self.request("GET", path, query=query)

    def create(self, path: str, body: Mapping[str, Any]) -> JSON:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> JSON:
        """JSON merge patch: only the named fields change (a None value removes one)."""
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def json_patch(self, path: str, ops: list[dict[str, Any]]) -> JSON:
        """JSON patch (RFC 6902): the operations in order, all or none (a failed `test` gets 422)."""
        return self.request("PATCH", path, ops, content_type="application/json-patch+json")

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
        """Every item at a collection path, in pages, and the list's resourceVersion (to watch from).
        `timeout` bounds each page. A list still unfinished after `max_list_pages` pages (or with
        more items than those pages hold) raises `KubeError` status 0, naming the path and the cap."""
        items: list[JSON] = []
        cont, rv = "", ""
        cap = self.max_list_pages
        for _page in range(cap):
            query = [("limit", str(LIST_PAGE_SIZE))]
            query += [("labelSelector", label_selector)] if label_selector else []
            query += [("fieldSelector", field_selector)] if field_selector else []
            query += [("continue", cont)] if cont else []
            doc = self.request("GET", path, query=query, timeout=timeout)
            items.extend(doc.get("items") or [])
            meta = doc.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            cont = str(meta.get("continue") or "")
            if len(items) > cap * LIST_PAGE_SIZE:
                break
            if not cont:
                return items, rv
        raise KubeError(
            0,
            f"the list did not end within {cap} pages of {LIST_PAGE_SIZE} objects ({len(items)} so far); "
            "stopped following its continue tokens",
            method="GET",
            path=path,
        )

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
        # Each read waits at most past the server's own end of the watch (a stalled stream); the
        # whole stream at most WATCH_GRACE_S past it (one that never stops dripping).
        timeout = (WATCH_CONNECT_S, timeout_seconds + WATCH_GRACE_S)
        total_s = WATCH_CONNECT_S + timeout_seconds + WATCH_GRACE_S
        stream: Stream | _ApiClientStream
        if self.transport is not None:
            stream = self.transport.stream("GET", path, query, timeout, total_s)
        else:
            resp = self._send("GET", path, None, query, "application/json", timeout)
            stream = _ApiClientStream(resp, path, total_s)
        with self._streams_lock:
            self._streams.add(stream)
        finished = False
        try:
            if not 200 <= stream.status <= 299:
                raise status_error(stream.status, stream.read(ERROR_BODY_BYTES), method="GET", path=path)
            for line in iter_lines(stream.chunks(), self.max_line_bytes):
                event = decode_event(line)
                if event is not None:
                    yield event
            finished = True
        finally:
            with self._streams_lock:
                self._streams.discard(stream)
            # Left mid-stream (the caller stopped, or an error): the connection still carries the
            # rest of the watch, so it must not go back to the pool for another request.
            stream.close(finished)

    def abort_watches(self) -> None:
        """Abort watches in progress: a thread blocked reading one wakes with `KubeError` status 0.
        The pool stays open for other requests."""
        with self._streams_lock:
            streams = list(self._streams)
        for stream in streams:
            stream.abort()

    def close(self) -> None:
        """Abort watches in progress and close the pool."""
        self.abort_watches()
        if self.transport is not None:
            self.transport.close()
        if self.api_client is not None:
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
        self.create(binding_path(namespace, name), body)

    def get_resource_claim(self, namespace: str, name: str) -> JSON:
        """A resource.k8s.io/v1 ResourceClaim; `KubeError` 404 when there is none."""
        return self.get(resourceclaim_path(namespace, name))

    def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        """A core/v1 Event."""
        self.create(events_path(namespace), event)

    def patch_node_metadata(
        self, name: str, *, annotations: Mapping[str, str] | None = None, labels: Mapping[str, str | None] | None = None
    ) -> JSON:
        """Merge-patch a Node's annotations and labels: only the named keys change (a label None is removed)."""
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
