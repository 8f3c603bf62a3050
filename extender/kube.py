"""The extender's only seam to the API server: the `ClusterSource` protocol and its real implementation.

`KubeSource` uses the maintained `kubernetes` client for configuration (kubeconfig or in-cluster, TLS,
tokens, connection pool) but speaks raw JSON: list, then watch from the list's resourceVersion,
decoding the watch stream line by line into plain dicts. No typed model classes are built, which
keeps a 5,000-node list cheap. `Informer` runs one list+watch loop per resource kind in a thread
and hands objects to a handler (the cache, which locks): 410 Gone relists, any other failure
reconnects with capped exponential backoff, and the cache keeps serving meanwhile.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import quote

JSON = dict[str, Any]
Kind = Literal["nodes", "pods", "leases"]
KINDS: tuple[Kind, ...] = ("nodes", "pods", "leases")

log = logging.getLogger("gputopo.extender.kube")


class ApiError(RuntimeError):
    """A non-2xx answer (or no answer: status 0) from the API server."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}" if reason else f"{status}: {message}")


class GoneError(ApiError):
    """410 Gone: the resourceVersion a watch started from was compacted away; relist."""


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    object: JSON


class ClusterSource(Protocol):
    """Everything the extender asks of the API server."""

    def list_objects(self, kind: Kind) -> tuple[list[JSON], str]:
        """All objects of `kind` (leases: only the agents' namespace) and the list's resourceVersion."""
        ...

    def watch(self, kind: Kind, resource_version: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        """Changes after `resource_version`; ends after `timeout_seconds`; raises GoneError on 410."""
        ...

    def get_pod(self, namespace: str, name: str) -> JSON: ...

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
        """POST pods/binding. The API server copies the Binding's annotations onto the pod in the same
        update that sets spec.nodeName (the pod registry's BindingREST), so one call places and binds."""
        ...

    def create_event(self, namespace: str, event: JSON) -> None: ...

    def close(self) -> None: ...


def _status_error(status: int, body: bytes) -> ApiError:
    text = body.decode(errors="replace")
    reason, message = "", text
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            reason = str(doc.get("reason", ""))
            message = str(doc.get("message", text))
    except ValueError:
        pass
    cls = GoneError if status == 410 else ApiError
    return cls(status, message, reason)


def _path(kind: Kind, namespace: str) -> str:
    if kind == "nodes":
        return "/api/v1/nodes"
    if kind == "pods":
        return "/api/v1/pods"
    return f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"


class KubeSource:
    """ClusterSource over the `kubernetes` client: kubeconfig file, or in-cluster config when None."""

    def __init__(self, kubeconfig: Path | None, namespace: str, *, request_timeout: float = 10.0) -> None:
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config

        cfg: Any = k8s_client.Configuration()
        if kubeconfig is not None:
            k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        else:
            k8s_config.load_incluster_config(client_configuration=cfg)
        # Binds run on the server's worker threads (anyio's default limit is 40), each making several
        # API calls: a smaller pool discards connections under load, and every new one costs a TLS
        # handshake on both sides.
        cfg.connection_pool_maxsize = 64
        # The kubeconfig loader's refresh hook re-assigns `host` before every request, and the client
        # then re-reads the proxy settings from the whole environment each time. Pin the proxy it
        # resolved at start-up (the same value) so requests skip that scan.
        cfg.proxy = cfg.proxy
        self._client: Any = k8s_client.ApiClient(configuration=cfg)
        self._api_exception: type[Exception] = k8s_client.ApiException
        self.namespace = namespace
        self.request_timeout = request_timeout

    # ------------------------------------------------------------------ raw requests

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: JSON | None = None,  # a dict: the client encodes it (a pre-encoded str would be sent as a JSON string)
        content_type: str = "application/json",
        timeout: float | tuple[float, float] | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        m, url, hdrs, b, _ = self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            return self._client.call_api(
                m, url, header_params=hdrs, body=b, _request_timeout=timeout or self.request_timeout
            )
        except self._api_exception as e:
            status = int(getattr(e, "status", 0) or 0)
            raise _status_error(status, str(getattr(e, "body", "") or getattr(e, "reason", "")).encode()) from None
        except Exception as e:  # connection refused, TLS, timeouts: urllib3's many exception types
            raise ApiError(0, f"{type(e).__name__}: {e}") from None

    def _json(self, method: str, path: str, **kw: Any) -> JSON:
        resp = self._call(method, path, **kw)
        data: bytes = resp.read() or b""
        if not 200 <= int(resp.status) <= 299:
            raise _status_error(int(resp.status), data)
        if not data:
            return {}
        out: JSON = json.loads(data)
        return out

    # ------------------------------------------------------------------ ClusterSource

    def list_objects(self, kind: Kind) -> tuple[list[JSON], str]:
        items: list[JSON] = []
        cont = ""
        rv = ""
        while True:
            query = [("limit", "500")] + ([("continue", cont)] if cont else [])
            doc = self._json("GET", _path(kind, self.namespace), query=query, timeout=60.0)
            items.extend(doc.get("items") or [])
            meta = doc.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv)
            cont = str(meta.get("continue") or "")
            if not cont:
                return items, rv

    def watch(self, kind: Kind, resource_version: str, *, timeout_seconds: int) -> Iterator[WatchEvent]:
        query = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        resp = self._call("GET", _path(kind, self.namespace), query=query, timeout=(10.0, timeout_seconds + 30.0))
        raw = resp.response  # the urllib3 response, not yet read
        try:
            if not 200 <= int(resp.status) <= 299:
                raise _status_error(int(resp.status), resp.read() or b"")
            buf = b""
            for chunk in raw.stream(65536, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield from self._events(line)
            if buf.strip():
                yield from self._events(buf)
        finally:
            raw.release_conn()

    @classmethod
    def _events(cls, line: bytes) -> Iterator[WatchEvent]:
        """The line's event; none for a line that is not a JSON object (skipped and logged: raising
        would reconnect from the same resourceVersion and meet the same line again)."""
        try:
            doc = json.loads(line)
        except ValueError as e:
            log.warning("skipped a watch line that is not JSON", extra={"error": str(e)[:200]})
            return
        if not isinstance(doc, dict):
            log.warning("skipped a watch line that is not a JSON object")
            return
        yield cls._event(doc)

    @staticmethod
    def _event(doc: JSON) -> WatchEvent:
        etype = str(doc.get("type", ""))
        obj = doc.get("object") or {}
        if etype == "ERROR" and isinstance(obj, dict):
            code = int(obj.get("code", 0) or 0)
            err = ApiError(code, str(obj.get("message", "")), str(obj.get("reason", "")))
            if code == 410:
                raise GoneError(code, err.message, err.reason)
            raise err
        return WatchEvent(etype, obj)

    def get_node(self, name: str) -> JSON:
        return self._json("GET", f"/api/v1/nodes/{quote(name)}")

    def get_lease(self, name: str) -> JSON:
        return self._json(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{quote(self.namespace)}/leases/{quote(name)}"
        )

    def get_pod(self, namespace: str, name: str) -> JSON:
        return self._json("GET", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}")

    def list_pods(self, *, field_selector: str = "") -> list[JSON]:
        """Pods matching a field selector (`gputopo topo` reads a node's pods)."""
        query = [("fieldSelector", field_selector)] if field_selector else []
        items: list[JSON] = self._json("GET", "/api/v1/pods", query=query).get("items") or []
        return items

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
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
        self._json("POST", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}/binding", body=body)

    def create_event(self, namespace: str, event: JSON) -> None:
        self._json("POST", f"/api/v1/namespaces/{quote(namespace)}/events", body=dict(event))

    def close(self) -> None:
        self._client.close()


# --------------------------------------------------------------------------------------------------
# list + watch loop


class WatchHandler(Protocol):
    def replace(self, kind: Kind, items: list[JSON]) -> None: ...

    def apply(self, kind: Kind, event_type: str, obj: JSON) -> None: ...

    def heard_from_api(self) -> None: ...


class Informer:
    """One kind's list+watch loop. `run()` is the thread body; `relist()`/`watch_once()` are its steps."""

    def __init__(
        self,
        source: ClusterSource,
        kind: Kind,
        handler: WatchHandler,
        *,
        watch_timeout_seconds: int = 300,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.source = source
        self.kind = kind
        self.handler = handler
        self.watch_timeout_seconds = watch_timeout_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.resource_version = ""
        self.relists = 0
        self.synced = threading.Event()
        self.stop = threading.Event()

    def relist(self) -> None:
        items, rv = self.source.list_objects(self.kind)
        self.handler.replace(self.kind, items)
        self.handler.heard_from_api()
        self.resource_version = rv
        self.relists += 1
        self.synced.set()

    def watch_once(self, timeout_seconds: int | None = None) -> None:
        """Consume one watch until it ends; a 410 Gone relists (the next watch starts from there)."""
        try:
            timeout = self.watch_timeout_seconds if timeout_seconds is None else timeout_seconds
            for ev in self.source.watch(self.kind, self.resource_version, timeout_seconds=timeout):
                if self.stop.is_set():
                    return
                meta = ev.object.get("metadata") if isinstance(ev.object, dict) else None
                rv = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
                if ev.type != "BOOKMARK":
                    self.handler.apply(self.kind, ev.type, ev.object)
                self.handler.heard_from_api()
                if rv:
                    self.resource_version = rv
        except GoneError:
            log.info("watch expired (410 Gone); relisting", extra={"kind": self.kind})
            self.relist()

    def run(self) -> None:
        delay = self.backoff_initial
        while not self.stop.is_set():
            try:
                if not self.synced.is_set() or not self.resource_version:
                    self.relist()
                self.watch_once()
                delay = self.backoff_initial
            except Exception as e:
                log.warning(
                    "list/watch failed; serving from cache, retrying",
                    extra={"kind": self.kind, "error": str(e), "retry_in_s": round(delay, 2)},
                )
                if self.stop.wait(delay):
                    return
                delay = min(self.backoff_max, delay * 2)


def start_informers(
    source: ClusterSource, handler: WatchHandler, *, kinds: tuple[Kind, ...] = KINDS, **kw: Any
) -> list[tuple[Informer, threading.Thread]]:
    out = []
    for kind in kinds:
        inf = Informer(source, kind, handler, **kw)
        t = threading.Thread(target=inf.run, name=f"gputopo-watch-{kind}", daemon=True)
        t.start()
        out.append((inf, t))
    return out
