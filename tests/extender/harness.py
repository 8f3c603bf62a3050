"""Test support for tests/extender: builders for Node, Pod and Lease objects shaped as
the API server returns them, a fake clock, and the `env` fixture: the extender's listeners wired to the in-memory
FakeSource with the informers driven synchronously, its verbs called through the door (`Door.answer`, no HTTP).
Lives under tests/: the wheel carries no test code."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvicorn

from gputopo.extender.app import Listeners, create_listeners
from gputopo.extender.http.verbserver import VerbServer
from gputopo.extender.main import ListenerServer, _loop_factory, listener_config, serve
from gputopo.extender.metrics import Metrics
from gputopo.extender.settings import ListenerLimits, Settings
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.verbs.door import Door
from gputopo.extender.verbs.service import Extender
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.source import Informer
from gputopo.kube import KIND_NAMES
from gputopo.model import (
    DEFAULT_NAMESPACE,
    GPU_RESOURCE,
    GPUS_IN_USE_ANNOTATION,
    SCHEDULER_NAME,
    TOPOLOGY_ANNOTATION,
    GpusInUse,
    agent_lease_name,
)
from gputopo.systems import build_system
from tests.extender.fake import FakeSource

NS = DEFAULT_NAMESPACE
T0 = 1_800_000_000.0  # the fake clock's start (2027-01-15)
JSON = dict[str, Any]


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_obj(
    name: str,
    fixture: str | None = "dgx-h100",
    *,
    in_use: list[int] | None = None,
    report: GpusInUse | None = None,
    leaf: str | None = None,
    spine: str | None = None,
    topology_text: str | None = None,
) -> JSON:
    ann: dict[str, str] = {}
    if topology_text is not None:
        ann[TOPOLOGY_ANNOTATION] = topology_text
    elif fixture is not None:
        ann[TOPOLOGY_ANNOTATION] = build_system(fixture, name).to_annotation()
    if in_use:
        ann[GPUS_IN_USE_ANNOTATION] = json.dumps(in_use)  # version 1, as older agents publish it
    if report is not None:
        ann[GPUS_IN_USE_ANNOTATION] = report.to_annotation()
    labels = {"kubernetes.io/hostname": name}
    if leaf:
        labels["gputopo.io/network-leaf"] = leaf
    if spine:
        labels["gputopo.io/network-spine"] = spine
    return {"metadata": {"name": name, "labels": labels, "annotations": ann}, "spec": {}, "status": {}}


def two_leaves() -> list[JSON]:
    """gpu-1 and gpu-2 under leaf-a, gpu-3 and gpu-4 under leaf-b, one spine above both."""
    return [
        node_obj("gpu-1", leaf="leaf-a", spine="s1"),
        node_obj("gpu-2", leaf="leaf-a", spine="s1"),
        node_obj("gpu-3", leaf="leaf-b", spine="s1"),
        node_obj("gpu-4", leaf="leaf-b", spine="s1"),
    ]


def lease_obj(node: str, renew: float, namespace: str = NS) -> JSON:
    return {
        "metadata": {"name": agent_lease_name(node), "namespace": namespace},
        "spec": {"holderIdentity": node, "renewTime": rfc3339(renew), "leaseDurationSeconds": 120},
    }


def pod_obj(
    name: str,
    gpus: int = 8,
    annotations: Mapping[str, str] | None = None,
    *,
    namespace: str = "default",
    uid: str | None = None,
    node: str | None = None,
    phase: str = "Pending",
) -> JSON:
    spec: JSON = {
        "schedulerName": SCHEDULER_NAME,
        "containers": [
            {
                "name": "main",
                "image": "busybox",
                "resources": {"limits": {GPU_RESOURCE: str(gpus)}, "requests": {GPU_RESOURCE: str(gpus)}},
            }
        ],
    }
    if node:
        spec["nodeName"] = node
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def gputopo_pod(name: str, gpus: int = 8, **ann: str) -> JSON:
    annotations = {"gputopo.io/nvlink": "required"}
    annotations.update({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()})
    return pod_obj(name, gpus, annotations)


def args(pod: JSON, names: list[str], *, lower: bool = False) -> JSON:
    """ExtenderArgs as kube-scheduler sends them (Go field names, Nodes: null) or old-style lower case."""
    if lower:
        return {"pod": pod, "nodenames": names}
    return {"Pod": pod, "Nodes": None, "NodeNames": names}


def sync(cache: ClusterCache, source: FakeSource) -> None:
    """One full list of every kind, as the informers do on start."""
    for kind in KIND_NAMES:
        Informer(source, kind, cache).relist()


@dataclass(frozen=True)
class Reply:
    """What the door answered one call: HTTP status and JSON body."""

    status: int
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def call(door: Door, verb: str, json: Any = None, *, content: bytes | None = None) -> Reply:
    """One call of `verb` through the door, its body `json` encoded (Go clients write compact JSON) or
    `content` as it is."""
    body = content if content is not None else b"" if json is None else orjson.dumps(json)
    return Reply(*door.answer(verb, body))


@dataclass
class Env:
    source: FakeSource
    clock: FakeClock
    listeners: Listeners
    settings: Settings

    @property
    def door(self) -> Door:
        return self.listeners.door

    @property
    def extender(self) -> Extender:
        return self.listeners.extender

    @property
    def metrics(self) -> Metrics:
        return self.listeners.prometheus

    @property
    def cache(self) -> ClusterCache:
        return self.listeners.cache

    @property
    def ledger(self) -> Ledger:
        return self.cache.ledger

    def add_nodes(self, *nodes: JSON, lease: bool = True) -> None:
        for n in nodes:
            self.source.put("nodes", n)
            if lease:
                self.source.put("leases", lease_obj(n["metadata"]["name"], self.clock.now))
        self.resync()

    def add_pods(self, *pods: JSON) -> None:
        for p in pods:
            self.source.put("pods", p)
        self.resync()

    def renew_leases(self) -> None:
        """Every agent heartbeats now."""
        for name in list(self.cache.nodes):
            self.source.put("leases", lease_obj(name, self.clock.now))
        self.resync()

    def resync(self) -> None:
        sync(self.cache, self.source)

    def call(self, verb: str, json: Any = None, *, content: bytes | None = None) -> Reply:
        """One call of `verb` through the door (`call`)."""
        return call(self.door, verb, json, content=content)

    def filter(self, pod: JSON, names: list[str], *, lower: bool = False) -> JSON:
        r = self.call("filter", args(pod, names, lower=lower))
        assert r.status == 200, r.text
        out: JSON = r.json()
        return out

    def passed(self, pod: JSON, names: list[str]) -> list[str]:
        """The nodes the pod's filter passes."""
        return list(self.filter(pod, names)["NodeNames"])

    def reasons(self, pod: JSON, names: list[str]) -> set[str]:
        """Why the pod's filter passes no node: every distinct message, resolvable or not."""
        out = self.filter(pod, names)
        assert out["NodeNames"] == []
        return set(out["FailedNodes"].values()) | set(out["FailedAndUnresolvableNodes"].values())

    def prioritize(self, pod: JSON, names: list[str], *, lower: bool = False) -> dict[str, int]:
        r = self.call("prioritize", args(pod, names, lower=lower))
        assert r.status == 200, r.text
        body = r.json()
        assert isinstance(body, list)
        # What kube-scheduler adds per node: a node missing from the answer gets 0.
        return {**dict.fromkeys(names, 0), **{h["Host"]: h["Score"] for h in body}}

    def bind(self, pod: JSON, node: str) -> str:
        meta = pod["metadata"]
        r = self.call(
            "bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
        )
        assert r.status == 200, r.text
        self.extender.flush_events()
        error: str = r.json()["Error"]
        return error


@contextmanager
def make_env(source: FakeSource, clock: FakeClock, settings: Settings) -> Iterator[Env]:
    """An `Env` over `source` with its listeners running (listed once), stopped after."""
    listeners = create_listeners(settings, cluster=source, clock=clock, watch=False)
    with listeners.running():
        e = Env(source, clock, listeners, settings)
        e.resync()
        yield e


@pytest.fixture
def env() -> Iterator[Env]:
    settings = Settings(namespace=NS, stale_after_seconds=120, reservation_timeout_seconds=120)
    with make_env(FakeSource(NS), FakeClock(), settings) as e:
        yield e


def start_server(
    app: Any, limits: ListenerLimits | None = None, tls: tuple[Path, Path] | None = None
) -> tuple[uvicorn.Server | VerbServer, threading.Thread, str]:
    """`app` (the door, or the webhook's or metrics' app) served in a thread on the server production gives
    it (the verbs listener's own, uvicorn for the others, under `limits`, over TLS with `tls` =
    (certificate, key)), on a free loopback port: (server, thread, base URL). Stop it with
    `server.should_exit = True`."""
    limits = limits or ListenerLimits()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server: uvicorn.Server | VerbServer
    if isinstance(app, Door):
        verbs = server = VerbServer(app, limits)

        def target() -> None:  # on uvloop where installed, as `gputopo-extender` runs it
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(verbs.serve([sock]))

    else:
        uv = server = ListenerServer(listener_config(app, limits, tls), limits)

        def target() -> None:
            uv.run(sockets=[sock])

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    scheme = "https" if tls else "http"
    return server, thread, f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"


def certificate(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for 127.0.0.1 (what the API server would verify against caBundle)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found: the webhook listener needs a certificate")
    ca_key, ca, key, csr, crt, ext = (tmp / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    steps = [
        f"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca -keyout {ca_key} -out {ca}",
        f"req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout {key} -out {csr}",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -days 1 -out {crt} -extfile {ext}",
    ]
    for step in steps:
        subprocess.run([openssl, *step.split()], check=True, capture_output=True)
    return ca, crt, key


@contextmanager
def serving(settings: Settings, ready: Callable[[], bool], what: str) -> Iterator[None]:
    """`gputopo-extender`'s own `serve` for `settings` in a thread, entered once `ready()` is true (polled,
    not a fixed wait; `ready` may raise OSError while nothing answers yet); stopped on exit."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(serve(create_listeners(settings), settings, stop))
        except BaseException as e:  # reported by the readiness wait below
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for _ in range(400):
        assert not failure, failure
        try:
            if ready():
                break
        except OSError:
            pass
        threading.Event().wait(0.05)
    else:
        pytest.fail(f"{what} did not become ready")
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        assert not thread.is_alive()
