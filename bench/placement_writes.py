"""What a bound pod's `gputopo.io/placement` annotation and TopologyPlacement Event cost, against a real
kube-apiserver (`localcluster`: etcd and kube-apiserver from the locally built binaries, loopback only).

The extender's `Binder` runs in this process over an in-memory ledger of `--nodes` DGX H100 nodes (the
runner-up ties: its `why` is "scored the same; the first name wins") and binds 4-GPU pods that exist in
the API server, as in production: the pod comes from filter's memory (no GET), one Binding carries the
annotation, the Event is posted by the `EventPoster` pool. Each variant is one annotation form (as
written today; `compact`: `runnerUp.why` empty, the sentence says it already; `none`: a Binding without
annotations, the floor) with the Event on or off. Two parts:

- binds: `--pods` pods per variant, bound in blocks of `--block` that alternate between the variants (a
  neighbour's load falls on all alike). Per bound pod: kube-apiserver's own request counts (its
  `apiserver_request_total`, scraped around each block), the request bytes of those writes, and the CPU
  of this process (`time.process_time`: the bind, its Event post, nothing else runs here then).
- life: `--lives` pods per variant, one at a time, through a pod's life as a kubelet writes it (created,
  bound, two status updates, a graceful delete, the final status, the delete), with two pod watches open:
  JSON (the extender's) and protobuf (kube-scheduler's, the kubelet's, the controllers'). Per pod: its
  object's bytes once bound, and what each watcher receives over its life. The first pod of each variant
  is shown by the real `kubectl describe pod`: its Annotations and Events, and whether they read as today's.

kube-scheduler is not running: its own `Scheduled` Event (one POST per pod, in every variant) is not here.

    GPUTOPO_BIN_DIR=~/.cache/gputopo/k8s-v1.37.2_etcd-v3.6.13_helm-v3.22.0/bin \\
        .venv/bin/python bench/placement_writes.py               # 300 binds and 20 lives per variant
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import re
import ssl
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives under tests/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # api_counts, beside this script

from api_counts import apiserver_calls, between

from gputopo.extender.settings import Settings
from gputopo.extender.verbs.binder import Binder
from gputopo.extender.verbs.events import EventPoster
from gputopo.extender.watch.source import KubeSource
from gputopo.extender.wire import PodInfo, pod_info
from gputopo.localcluster import ControlPlane, find_binaries, pod_manifest
from gputopo.model import PLACEMENT_ANNOTATION, Placement
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, FakeClock, make_env, node_obj

NAMESPACE = "placement-writes"
NODE = "gpu-00"
MAX_PODS = 2000
FORMS = ("today", "compact", "none")
WRITES = ("POST", "PUT", "PATCH", "DELETE")
JSON_T = dict[str, Any]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Variant:
    form: str  # one of FORMS
    event: bool

    @property
    def label(self) -> str:
        return f"{self.form}, {'Event' if self.event else 'no Event'}"


VARIANTS = tuple(Variant(f, e) for f in FORMS for e in (True, False))


@dataclass
class Tally:
    pods: int = 0
    cpu_s: float = 0.0
    calls: dict[str, float] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)  # request body bytes by call
    annotation: int = 0  # the placement annotation's value, characters
    pod_json: int = 0
    pod_proto: int = 0
    lives: int = 0
    watch_json: int = 0
    watch_events: int = 0
    watch_proto: int = 0
    describe: str = ""


# ------------------------------------------------------------------------------- the annotation's forms

TODAY = Placement.to_annotation


def compact(self: Placement) -> str:
    """Today's annotation with the runner-up's `why` empty: the placement sentence (`reason`) already says
    it, no reader shows it, and every reader version still parses it (`why` is a required string)."""
    if self.runner_up is None:
        return TODAY(self)
    return TODAY(self.model_copy(update={"runner_up": self.runner_up.model_copy(update={"why": ""})}))


@contextmanager
def written_as(form: str) -> Iterator[None]:
    Placement.to_annotation = {"today": TODAY, "compact": compact, "none": TODAY}[form]  # type: ignore[method-assign]
    try:
        yield
    finally:
        Placement.to_annotation = TODAY  # type: ignore[method-assign]


class NoEvents:
    def placed(self, *_a: object) -> None:
        pass

    def flush(self, timeout: float = 10.0) -> None:
        pass


class Counted(KubeSource):
    """The extender's API source, counting the request bytes it sends by call; `bare` drops the
    Binding's annotations (the `none` form)."""

    def __init__(self, kubeconfig: Path) -> None:
        super().__init__(kubeconfig, NAMESPACE)
        self.sent: dict[str, int] = {}
        self.bare = False
        send = self.api.request

        def request(method: str, path: str, body: Any = None, **kw: Any) -> JSON_T:
            if body is not None:
                key = f"{method} {path.rsplit('/', 1)[-1] if path.endswith('/binding') else 'events'}"
                self.sent[key] = self.sent.get(key, 0) + len(orjson.dumps(body))
            return send(method, path, body, **kw)

        self.api.request = request  # type: ignore[method-assign]

    def create_binding(self, namespace: str, name: str, uid: str, node: str, *, annotations: Any = None) -> None:
        super().create_binding(namespace, name, uid, node, annotations=None if self.bare else annotations)


# ------------------------------------------------------------------------------- the API server, raw


class Raw:
    """GETs and watches as bytes, with the admin token (loopback, self-signed: no verification)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.server, self.token = cp.server, cp.admin_token
        self.ctx = ssl.create_default_context()
        self.ctx.check_hostname = False
        self.ctx.verify_mode = ssl.CERT_NONE

    def open(self, path: str, accept: str, timeout: float = 30.0) -> Any:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": accept}
        return urllib.request.urlopen(
            urllib.request.Request(self.server + path, headers=headers), timeout=timeout, context=self.ctx
        )

    def size(self, path: str, accept: str) -> int:
        with self.open(path, accept) as resp:
            return len(resp.read())


PROTOBUF = "application/vnd.kubernetes.protobuf"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


class Watches:
    """A JSON pod watch (bytes and events per pod name) and a protobuf one (bytes in all)."""

    def __init__(self, raw: Raw) -> None:
        self.by_pod: dict[str, list[int]] = {}  # name -> [bytes, events]
        self.deleted: set[str] = set()
        self.proto = 0
        self.lock = threading.Lock()
        with raw.open(PODS + "?limit=1", "application/json") as resp:  # from now: not the pods there already
            rv = orjson.loads(resp.read())["metadata"]["resourceVersion"]
        query = f"?watch=true&resourceVersion={rv}&timeoutSeconds=900&allowWatchBookmarks=false"
        self._json = raw.open(PODS + query, "application/json", timeout=660)
        self._pb = raw.open(PODS + query, f"{PROTOBUF};stream=watch", timeout=660)
        for target in (self._read_json, self._read_proto):
            threading.Thread(target=target, daemon=True).start()

    def _read_json(self) -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):  # the server stopped, or `close`
            for line in self._json:
                self._count(line)

    def _count(self, line: bytes) -> None:
        ev = orjson.loads(line)
        name = ev["object"]["metadata"]["name"]
        with self.lock:
            got = self.by_pod.setdefault(name, [0, 0])
            got[0] += len(line)
            got[1] += 1
            if ev["type"] == "DELETED":
                self.deleted.add(name)

    def _read_proto(self) -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):
            while chunk := self._pb.read1(65536):
                with self.lock:
                    self.proto += len(chunk)

    def settled(self, name: str, timeout: float = 30.0) -> int:
        """Wait for `name`'s DELETED on the JSON watch and the protobuf stream to go quiet; its bytes so far."""
        end = time.monotonic() + timeout
        while name not in self.deleted and time.monotonic() < end:
            time.sleep(0.01)
        last = -1
        while last != self.proto and time.monotonic() < end:
            last = self.proto
            time.sleep(0.2)
        return self.proto


# ------------------------------------------------------------------------------- a pod's life


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def container_status(state: JSON_T, ready: bool) -> JSON_T:
    return {
        "name": "main", "state": state, "ready": ready, "restartCount": 0, "started": ready,
        "image": "registry.k8s.io/pause:3.10", "imageID": "registry.k8s.io/pause@sha256:" + "0" * 64,
        "containerID": "containerd://" + "a" * 64,
    }  # fmt: skip


def statuses(phase: str) -> JSON_T:
    """The pod status a kubelet writes: starting, running, terminated."""
    up = phase == "Running"
    conds = [
        {"type": t, "status": "True" if up or t in ("Initialized", "PodScheduled") else "False",
         "lastTransitionTime": now()}
        for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
    ]  # fmt: skip
    states: dict[str, JSON_T] = {
        "Pending": {"waiting": {"reason": "ContainerCreating"}},
        "Running": {"running": {"startedAt": now()}},
        "Succeeded": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}},
    }
    state = states[phase]
    return {
        "status": {
            "phase": phase, "conditions": conds, "hostIP": "10.0.0.10", "hostIPs": [{"ip": "10.0.0.10"}],
            "podIP": "10.244.0.17", "podIPs": [{"ip": "10.244.0.17"}], "startTime": now(), "qosClass": "Guaranteed",
            "containerStatuses": [container_status(state, up)],
        }
    }  # fmt: skip


def live(admin: Any, name: str, bind: Callable[[], None], raw: Raw, tally: Tally, first: bool) -> None:
    """One pod through its life: created, bound, started, running, deleted gracefully, terminated, gone."""
    path = f"{PODS}/{name}"
    bind()
    if first:
        with raw.open(path, "application/json") as resp:
            body = resp.read()
        tally.pod_json = len(body)
        tally.annotation = len(orjson.loads(body)["metadata"]["annotations"].get(PLACEMENT_ANNOTATION, ""))
        tally.pod_proto = raw.size(path, PROTOBUF)
        tally.describe = admin.describe_pod(NAMESPACE, name)
    for phase in ("Pending", "Running"):
        admin.request("PATCH", f"{path}/status", statuses(phase), content_type="application/merge-patch+json")
    admin.request("DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 30})
    admin.request("PATCH", f"{path}/status", statuses("Succeeded"), content_type="application/merge-patch+json")
    admin.request("DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})


# ------------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, cp: ControlPlane, admin: Any, ledger: Any) -> None:
        self.cp, self.admin, self.ledger = cp, admin, ledger
        self.source = Counted(cp.kubeconfig)
        self.infos: dict[str, PodInfo] = {}
        self.poster = EventPoster(lambda: self.source)
        self.binder = Binder(ledger, lambda: self.source, self.poster, recall=lambda _u, ref: self.infos.get(ref))
        self.tallies = {v: Tally() for v in VARIANTS}

    def create(self, names: list[str]) -> None:
        ann = {"gputopo.io/nvlink": "required"}
        made: list[JSON_T] = []

        def one(name: str) -> None:
            made.append(self.admin.create_pod(pod_manifest(name, namespace=NAMESPACE, gpus=4, annotations=ann)))

        def several(ns: list[str]) -> None:
            for n in ns:
                one(n)

        threads = [threading.Thread(target=several, args=(names[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for pod in made:  # what filter carried to the bind (recentpods): no GET at bind
            info = pod_info(pod)
            self.infos[info.ref] = info

    def bind(self, v: Variant, name: str) -> None:
        info = self.infos[f"{NAMESPACE}/{name}"]
        self.binder.events = self.poster if v.event else NoEvents()  # type: ignore[assignment]
        self.source.bare = v.form == "none"
        with written_as(v.form):
            err = self.binder.bind(NAMESPACE, name, info.uid, NODE)
            self.binder.events.flush()
        if err:
            raise RuntimeError(f"bind {name}: {err}")

    def free(self, name: str) -> None:
        """The bound pod leaves the ledger: every bind finds the same node state."""
        self.ledger.put_pod(self.infos[f"{NAMESPACE}/{name}"].uid, None)

    def binds(self, pods: int, block: int, deadline: float) -> None:
        names = {v: [f"b-{i}-{v.form}-{int(v.event)}" for i in range(pods)] for v in VARIANTS}
        self.create([n for ns in names.values() for n in ns])
        say(f"{pods * len(VARIANTS)} pending pods created")
        for v in VARIANTS:  # warm-up: connections open, code paths run once
            self.bind(v, names[v].pop())
            self.free(f"b-{pods - 1}-{v.form}-{int(v.event)}")
        done = 0
        while done < pods - 1 and time.monotonic() < deadline:
            for v in VARIANTS:
                batch = names[v][done : done + block]
                tally = self.tallies[v]
                sent0, calls0 = dict(self.source.sent), apiserver_calls(self.cp)
                cpu0 = time.process_time()
                for name in batch:
                    self.bind(v, name)
                    tally.cpu_s += time.process_time() - cpu0
                    self.free(name)
                    cpu0 = time.process_time()
                got = between(apiserver_calls(self.cp), calls0)
                tally.calls = {k: tally.calls.get(k, 0.0) + got.get(k, 0.0) for k in {*tally.calls, *got}}
                for k, n in self.source.sent.items():
                    tally.sent[k] = tally.sent.get(k, 0) + n - sent0.get(k, 0)
                tally.pods += len(batch)
            done += block

    def lives(self, lives: int, raw: Raw, deadline: float) -> None:
        watches = Watches(raw)
        time.sleep(0.5)  # both watches open before the first create
        for v in VARIANTS:
            tally = self.tallies[v]
            for i in range(lives):
                if time.monotonic() > deadline:
                    break
                name = f"l-{i}-{v.form}-{int(v.event)}"
                proto0 = watches.settled(name, timeout=0)
                self.create([name])
                live(self.admin, name, functools.partial(self.bind, v, name), raw, tally, i == 0)
                self.free(name)
                tally.watch_proto += watches.settled(name) - proto0
                got = watches.by_pod.get(name, [0, 0])
                tally.watch_json += got[0]
                tally.watch_events += got[1]
                tally.lives += 1
        # The watches stay open: closing a response another thread reads blocks until that read returns
        # (the buffered reader's lock), so they end with the control plane (daemon threads).


# ------------------------------------------------------------------------------- the report


def per(n: float, pods: int) -> str:
    return f"{n / max(pods, 1):,.1f}"


def section(describe: str, head: str) -> list[str]:
    """One top-level part of `kubectl describe` (its head line and the indented lines under it), ages as AGE."""
    lines = describe.splitlines()
    out: list[str] = []
    for line in lines:
        if out and line and not line[0].isspace():
            break
        if out or line.startswith(head):
            out.append(re.sub(r"\b\d+(m\d+)?s\b|<invalid>", "AGE", re.sub(r"l-0-\w+-\d", "POD", line)).rstrip())
    return out


def report(tallies: dict[Variant, Tally]) -> None:
    # kube-apiserver's count of every request; its own /metrics (`GET apiserver`: the scrapes) left out
    # (leases: kube-apiserver's own identity Lease, renewed on its clock, not per pod)
    keys = sorted({k for t in tallies.values() for k in t.calls if k.split()[0] in WRITES and "leases" not in k})
    rows: list[tuple[str, Callable[[Tally], str]]] = [
        *((f"{k} per pod", lambda t, k=k: per(t.calls.get(k, 0), t.pods)) for k in keys),
        ("API writes per pod", lambda t: per(sum(t.calls.get(k, 0) for k in keys), t.pods)),
        (
            "other API requests per pod",
            lambda t: per(
                sum(v for k, v in t.calls.items() if k not in keys and "apiserver" not in k and "leases" not in k),
                t.pods,
            ),
        ),
        ("bytes sent: Binding", lambda t: per(t.sent.get("POST binding", 0), t.pods)),
        ("bytes sent: Event", lambda t: per(t.sent.get("POST events", 0), t.pods)),
        ("extender CPU ms per bind", lambda t: f"{t.cpu_s * 1e3 / max(t.pods, 1):.3f}"),
        ("placement annotation, characters", lambda t: f"{t.annotation:,}"),
        ("pod object bytes, JSON", lambda t: f"{t.pod_json:,}"),
        ("pod object bytes, protobuf", lambda t: f"{t.pod_proto:,}"),
        ("watch events per life", lambda t: per(t.watch_events, t.lives)),
        ("one JSON watcher, bytes per life", lambda t: per(t.watch_json, t.lives)),
        ("one protobuf watcher, bytes per life", lambda t: per(t.watch_proto, t.lives)),
    ]
    print(f"\nPer bound pod ({tallies[VARIANTS[0]].pods} binds, {tallies[VARIANTS[0]].lives} lives per variant)")
    print(f"  {'':<38}" + "".join(f" {v.label:>18}" for v in VARIANTS))
    for label, cell in rows:
        print(f"  {label:<38}" + "".join(f" {cell(tallies[v]):>18}" for v in VARIANTS))
    base = tallies[VARIANTS[0]]
    print("\nkubectl describe pod, Annotations and Events (ages as AGE), each against today's with the Event:")
    for v in VARIANTS:
        t = tallies[v]
        parts = [
            (head, section(t.describe, head), section(base.describe, head)) for head in ("Annotations:", "Events:")
        ]
        print(f"-- {v.label}: " + "; ".join(f"{h[:-1]} {'the same' if g == w else 'different'}" for h, g, w in parts))
        for _, got, _ in parts:
            for line in got:
                print(f"   {line}")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh first", file=sys.stderr)
        return 2
    settings = Settings(namespace=NS, stale_after_seconds=10**6, reservation_timeout_seconds=10**6)
    with ControlPlane(bin_dir) as cp, make_env(FakeSource(NS), FakeClock(), settings) as env, cp.client() as admin:
        say(f"control plane up in {cp.dir} ({bin_dir})")
        deadline = time.monotonic() + args.deadline
        nodes = [f"gpu-{i:02d}" for i in range(args.nodes)]
        env.add_nodes(*(node_obj(n, leaf=f"leaf-{i // 4}", spine="s1") for i, n in enumerate(nodes)))
        admin.create_namespace(NAMESPACE)
        bench = Bench(cp, admin, env.ledger)
        try:
            bench.binds(args.pods, args.block, deadline)
            say("binds measured")
            bench.lives(args.lives, Raw(cp), deadline + args.deadline / 2)
            say("lives measured")
        finally:
            bench.poster.close()
            bench.source.close()
        report(bench.tallies)
        if time.monotonic() >= deadline:
            print(f"\nstopped at the --deadline ({args.deadline:.0f}s): fewer pods than asked")
    return 0


def bounded(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"between 1 and {limit}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="What the placement annotation and the TopologyPlacement Event cost.")
    p.add_argument("--pods", type=bounded(MAX_PODS), default=300, help="binds per variant (default 300)")
    p.add_argument("--lives", type=bounded(MAX_PODS), default=20, help="pod lives per variant (default 20)")
    p.add_argument("--nodes", type=bounded(512), default=16, help="nodes in the ledger (default 16)")
    p.add_argument("--block", type=bounded(MAX_PODS), default=25, help="binds per variant before the next")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds for the binds, at most (lives: half)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
