"""Client CPU per Kubernetes API call: `gputopo.kube`'s lean transport against the libraries it was
measured against, on the extender's calls per scheduled pod.

Starts etcd and kube-apiserver from the locally built binaries (`localcluster`, loopback only),
then, in one process against the same server:

- writes: the extender's two writes per scheduled pod (a core/v1 Event and a pods/binding POST,
  for pending pods created beforehand: no scheduler runs, so nothing else binds them) through
  (a) `kube`: `gputopo.kube.Kube`, the lean transport; (b) `urllib3`: one urllib3 pool built as the
  ApiClient builds it, and (c) `httpx`: an `httpx.Client`, each with the same TLS settings, headers
  and orjson bodies; (d) `apiclient`: the `kubernetes` package's ApiClient.
  Calls go one at a time from one thread, in blocks that alternate between the paths (a server
  warming up or a neighbour's load falls on all alike), after warm-up calls that open the
  connections. Client CPU per call is `time.process_time` (this process only; the server is a
  child process).
- watch: one pod watch per path (`kube`, `urllib3`, `httpx`) open at once while pods are created; CPU per
  event is each consuming thread's own `time.thread_time`, the stream read and split into lines.

`--extra NAME=FILE` adds a transport module with the same `Transport(configuration, pool_size=,
user_agent=).request(...)` to the writes (a candidate kept outside the tree).
Bounded by --calls, --bindings, --events and --deadline; teardown stops only what it started.

    .venv/bin/python bench/kube_writes.py                    # 400 Events, 200 Bindings, 400 watch events
    .venv/bin/python bench/kube_writes.py --calls 1000 --bindings 0 --events 0
"""

from __future__ import annotations

import argparse
import importlib.util
import ssl
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import urllib3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gputopo.kube import Kube, iter_lines
from gputopo.kube.transport import query_string
from gputopo.localcluster import ControlPlane, find_binaries, pod_manifest

NAMESPACE = "kube-writes"
MAX_CALLS = 5000
WARMUP = 20

Call = Callable[[str, str, dict[str, Any]], None]  # (method, path, body)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Tally:
    cpu_s: float = 0.0
    walls: list[float] = field(default_factory=list)

    def line(self, label: str) -> str:
        n = len(self.walls)
        walls = sorted(self.walls)
        p99 = walls[min(n - 1, round(0.99 * (n - 1)))]
        return (
            f"  {label:<10} {n:>6} {self.cpu_s / n * 1e3:>12.3f} {sum(walls) / n * 1e3:>12.3f}"
            f" {statistics.median(walls) * 1e3:>10.3f} {p99 * 1e3:>10.3f}"
        )


def event(name: str, pod: str) -> dict[str, Any]:
    """An Event shaped like the extender's TopologyPlacement event."""
    now = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": NAMESPACE, "uid": "u-1"},
        "reason": "TopologyPlacement",
        "message": "placed on GPUs 0,1,2,3 (one NVLink clique, leaf-3): score 97",
        "type": "Normal",
        "source": {"component": "gputopo-extender"},
        "reportingComponent": "gputopo-extender",
        "reportingInstance": "bench",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def binding(pod: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": pod, "namespace": NAMESPACE, "annotations": {"bench": "1"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-0"},
    }


# ----------------------------------------------------------------------------------- the paths


def tls_context(cfg: Any) -> ssl.SSLContext:
    """The TLS settings urllib3 builds from the same configuration, for httpx."""
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert, cadata=getattr(cfg, "ca_cert_data", None))
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def headers(cfg: Any, body: bool) -> dict[str, str]:
    out = {"User-Agent": "gputopo", "Accept": "application/json"}
    auth = cfg.auth_settings().get("BearerToken")
    if auth and auth.get("value"):
        out["Authorization"] = str(auth["value"])
    if body:
        out["Content-Type"] = "application/json"
    return out


class HttpxPath:
    """The same requests over one `httpx.Client` (its httpcore pool, h11 framing)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.client = httpx.Client(base_url=str(cfg.host), verify=tls_context(cfg), timeout=30.0, trust_env=False)

    def call(self, method: str, path: str, body: dict[str, Any]) -> None:
        r = self.client.request(method, path, content=orjson.dumps(body), headers=headers(self.cfg, True))
        if not 200 <= r.status_code <= 299:
            raise RuntimeError(f"{method} {path}: {r.status_code}")
        orjson.loads(r.content)

    def watch(self, path: str, query: list[tuple[str, str]]) -> Iterator[bytes]:
        url = f"{path}?{query_string(query)}"
        with self.client.stream("GET", url, headers=headers(self.cfg, False), timeout=120.0) as r:
            yield from r.iter_raw()  # each piece as it arrives (a size would wait to fill it)

    def close(self) -> None:
        self.client.close()


class Urllib3Path:
    """The same requests over one urllib3 pool, with the pool settings the ApiClient uses."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.pool = urllib3.PoolManager(
            maxsize=8, retries=False, cert_reqs="CERT_REQUIRED", ca_certs=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file, key_file=cfg.key_file,
        ).connection_from_url(str(cfg.host))  # fmt: skip

    def _open(self, method: str, url: str, body: bytes | None, timeout: float) -> Any:
        return self.pool.urlopen(
            method, url, body=body, headers=headers(self.cfg, body is not None), retries=False,
            redirect=False, preload_content=False, timeout=timeout,
        )  # fmt: skip

    def call(self, method: str, path: str, body: dict[str, Any]) -> None:
        r = self._open(method, path, orjson.dumps(body), 30.0)
        data = r.read()
        r.release_conn()
        if not 200 <= r.status <= 299:
            raise RuntimeError(f"{method} {path}: {r.status}")
        orjson.loads(data)

    def watch(self, path: str, query: list[tuple[str, str]]) -> Iterator[bytes]:
        r = self._open("GET", f"{path}?{query_string(query)}", None, 120.0)
        try:
            yield from r.stream(65536)
        finally:
            r.release_conn()

    def close(self) -> None:
        self.pool.close()


def apiclient_call(api: Any) -> Call:
    def call(method: str, path: str, body: dict[str, Any]) -> None:
        m, url, hdrs, b, _ = api.param_serialize(
            method=method,
            resource_path=path,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        orjson.loads(api.call_api(m, url, header_params=hdrs, body=b, _request_timeout=30.0).read())

    return call


def module_call(file: str, cfg: Any) -> Call:
    """A transport module kept outside the tree, loaded by path (`--extra`)."""
    spec = importlib.util.spec_from_file_location(f"extra_{Path(file).stem}", file)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--extra {file}: not a Python module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    transport = mod.Transport(cfg, pool_size=8, user_agent="gputopo")

    def call(method: str, path: str, body: dict[str, Any]) -> None:
        status, data = transport.request(method, path, [], orjson.dumps(body), "application/json", 30.0)
        if not 200 <= status <= 299:
            raise RuntimeError(f"{method} {path}: {status}")
        orjson.loads(data)

    return call


# ----------------------------------------------------------------------------------- measuring


def measure(
    paths: dict[str, Call], calls: int, block: int, one: Callable[[Call, str, int], None], deadline: float
) -> dict[str, Tally]:
    """`calls` calls per path, alternating blocks of `block`; stops early (fewer calls) at the deadline."""
    tallies = {p: Tally() for p in paths}
    done = 0
    while done < calls and time.monotonic() < deadline:
        n = min(block, calls - done)
        for name, call in paths.items():
            tally = tallies[name]
            cpu0 = time.process_time()
            for i in range(done, done + n):
                t0 = time.perf_counter()
                one(call, name, i)
                tally.walls.append(time.perf_counter() - t0)
            tally.cpu_s += time.process_time() - cpu0
        done += n
    return tallies


def report(title: str, tallies: dict[str, Tally]) -> None:
    print(f"\n{title}")
    print(f"  {'path':<10} {'calls':>6} {'cpu ms/call':>12} {'wall ms/call':>12} {'wall p50':>10} {'wall p99':>10}")
    for name, tally in tallies.items():
        if tally.walls:
            print(tally.line(name))
    base = tallies["kube"]
    for name, tally in tallies.items():
        if name != "kube" and tally.walls and base.walls:
            extra = tally.cpu_s / len(tally.walls) - base.cpu_s / len(base.walls)
            print(f"  {name} - kube: {extra * 1e3:+.3f} ms of client CPU per call")


def watch_cpu(kube: Kube, u3: Urllib3Path, hx: HttpxPath, admin: Any, events: int, deadline: float) -> None:
    """Both watches open at once while `events` pods are created; each consumer's own CPU per event."""
    _, rv = kube.list_items(f"/api/v1/namespaces/{NAMESPACE}/pods")
    path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    query = [("watch", "true"), ("resourceVersion", rv), ("timeoutSeconds", "120")]
    counts: dict[str, tuple[int, float]] = {}

    def consume(name: str, items: Iterator[Any]) -> None:
        cpu0, n = time.thread_time(), 0
        for _item in items:
            n += 1
            if n >= events or time.monotonic() > deadline:
                break
        counts[name] = (n, time.thread_time() - cpu0)

    streams = {
        # Each decoded to its event's object: Kube.watch does that itself.
        "kube": iter(kube.watch(path, rv, timeout_seconds=120)),
        "urllib3": (orjson.loads(line) for line in iter_lines(u3.watch(path, query))),
        "httpx": (orjson.loads(line) for line in iter_lines(hx.watch(path, query))),
    }
    threads = [threading.Thread(target=consume, args=item) for item in streams.items()]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both watches are open before the first create
    admin.create_pods([pod_manifest(f"w-{i}", namespace=NAMESPACE) for i in range(events)], workers=8)
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    print(f"\nWatch events ({events} pods created, the watches open at once)")
    print(f"  {'path':<10} {'events':>6} {'cpu ms/event':>13}")
    for name, (n, cpu) in counts.items():
        print(f"  {name:<10} {n:>6} {cpu / max(n, 1) * 1e3:>13.3f}")
    kube.abort_watches()


def run(args: argparse.Namespace) -> int:
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run gputopo/localcluster/build_binaries.sh first", file=sys.stderr)
        return 2
    with ControlPlane(bin_dir) as cp:
        say(f"control plane up in {cp.dir}")
        deadline = time.monotonic() + args.deadline
        kube = Kube(cp.kubeconfig, request_timeout=30.0)
        hx = HttpxPath(kube.configuration)
        u3 = Urllib3Path(kube.configuration)
        from kubernetes import client as k8s_client

        api = k8s_client.ApiClient(configuration=kube.configuration)

        def kube_call(method: str, path: str, body: dict[str, Any]) -> None:
            kube.request(method, path, body)

        paths: dict[str, Call] = {
            "kube": kube_call,
            "urllib3": u3.call,
            "httpx": hx.call,
            "apiclient": apiclient_call(api),
        }
        for item in args.extra:
            name, _, file = item.partition("=")
            paths[name] = module_call(file, kube.configuration)
        with cp.client() as admin:
            try:
                admin.create_namespace(NAMESPACE)
                pods = [f"p-{p}-{i}" for p in paths for i in range(args.bindings)]
                admin.create_pods([pod_manifest(name, namespace=NAMESPACE) for name in pods], workers=8)
                if pods:
                    say(f"{len(pods)} pending pods created")

                def post_event(call: Call, name: str, i: int) -> None:
                    call("POST", f"/api/v1/namespaces/{NAMESPACE}/events", event(f"e-{name}-{i}", f"p-{name}-{i}"))

                def bind(call: Call, name: str, i: int) -> None:
                    call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods/p-{name}-{i}/binding", binding(f"p-{name}-{i}"))

                for name, call in paths.items():  # open the connections (TLS handshakes) before measuring
                    for i in range(WARMUP):
                        call("POST", f"/api/v1/namespaces/{NAMESPACE}/events", event(f"w-{name}-{i}", "warmup"))
                events = measure(paths, args.calls, args.block, post_event, deadline)
                report(f"Event POSTs ({args.calls} per path, blocks of {args.block})", events)
                if args.bindings:
                    bindings = measure(paths, args.bindings, args.block, bind, deadline)
                    report(f"Binding POSTs ({args.bindings} per path, blocks of {args.block})", bindings)
                if args.events:
                    watch_cpu(kube, u3, hx, admin, args.events, deadline)
                if time.monotonic() >= deadline:
                    print(f"\nstopped at the --deadline ({args.deadline:.0f}s): fewer calls than asked")
            finally:
                kube.close()
                hx.close()
                u3.close()
                api.close()
    return 0


def bounded(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not 0 <= value <= limit:
            raise argparse.ArgumentTypeError(f"between 0 and {limit}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Client CPU per API call: gputopo.kube against urllib3, httpx, the ApiClient."
    )
    p.add_argument("--calls", type=bounded(MAX_CALLS), default=400, help="Event POSTs per path (default 400)")
    p.add_argument("--bindings", type=bounded(MAX_CALLS), default=200, help="Binding POSTs per path; 0: none")
    p.add_argument("--events", type=bounded(MAX_CALLS), default=400, help="watch events per path; 0: none")
    p.add_argument("--block", type=int, default=50, help="calls per path before switching to the next")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds for the measuring, at most")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=FILE", help="another transport module")
    args = p.parse_args(argv)
    args.block = max(1, args.block)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
