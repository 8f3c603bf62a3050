"""Client CPU per Kubernetes API write: the `kubernetes` ApiClient path against the lean transport.

Starts etcd and kube-apiserver from the locally built binaries (`localcluster`, loopback
only), then makes the extender's two writes per scheduled pod through `gputopo.kube.Kube` both ways,
in the same run, against the same server:

  (a) `apiclient`: the `kubernetes` package's ApiClient and urllib3 pool (what `Kube` uses when the
      configuration names a proxy, and what it used for every request before the lean transport);
  (b) `lean`: `gputopo.kube.transport`, kept-alive connections and one write per request.

Events: N core/v1 Event POSTs per path. Bindings (optional, M per path): pods/binding POSTs for
pending pods created beforehand (no scheduler runs, so nothing else binds them). Calls go one at a
time from one thread, in blocks that alternate between the paths (so a server warming up or a
neighbour's load falls on both alike), after a few warm-up calls that open the connections. Printed
per path: client CPU per call (`time.process_time`: this process only; the server is a child
process) and wall time per call (mean, p50, p99). Bounded by --calls, --bindings and --deadline;
teardown stops only the processes this script started.

    .venv/bin/python bench/kube_writes.py                    # 400 Events and 200 Bindings per path
    .venv/bin/python bench/kube_writes.py --calls 1000 --bindings 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gputopo.kube import Kube
from localcluster import ControlPlane, find_binaries, pod_manifest

NAMESPACE = "kube-writes"
MAX_CALLS = 5000
WARMUP = 20
PATHS = ("apiclient", "lean")


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


def event(name: str, pod: str) -> dict[str, object]:
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


def measure(
    clients: dict[str, Kube], calls: int, block: int, one: Callable[[Kube, str, int], None], deadline: float
) -> dict[str, Tally]:
    """`calls` calls per path, alternating blocks of `block`; stops early (fewer calls) at the deadline."""
    tallies = {p: Tally() for p in clients}
    done = 0
    while done < calls and time.monotonic() < deadline:
        n = min(block, calls - done)
        for path, kube in clients.items():
            tally = tallies[path]
            cpu0 = time.process_time()
            for i in range(done, done + n):
                t0 = time.perf_counter()
                one(kube, path, i)
                tally.walls.append(time.perf_counter() - t0)
            tally.cpu_s += time.process_time() - cpu0
        done += n
    return tallies


def report(title: str, tallies: dict[str, Tally]) -> None:
    print(f"\n{title}")
    print(f"  {'path':<10} {'calls':>6} {'cpu ms/call':>12} {'wall ms/call':>12} {'wall p50':>10} {'wall p99':>10}")
    for path, tally in tallies.items():
        print(tally.line(path))
    a, b = (tallies[p] for p in PATHS)
    if a.walls and b.walls:
        ratio = (a.cpu_s / len(a.walls)) / (b.cpu_s / len(b.walls))
        print(f"  client CPU per call, apiclient / lean: {ratio:.2f}x")


def run(args: argparse.Namespace) -> int:
    bin_dir = find_binaries()
    if bin_dir is None:
        print("control-plane binaries are not built: run localcluster/build_binaries.sh first", file=sys.stderr)
        return 2
    with ControlPlane(bin_dir) as cp:
        say(f"control plane up in {cp.dir}")
        deadline = time.monotonic() + args.deadline
        clients = {p: Kube(cp.kubeconfig, request_timeout=30.0) for p in PATHS}
        old = clients["apiclient"]
        assert old.transport is not None, "the kubeconfig names a proxy: both paths would be the ApiClient's"
        old.transport.close()
        old.transport = None  # every request through the ApiClient, as when a proxy is configured
        with cp.client() as admin:
            try:
                admin.create_namespace(NAMESPACE)
                pods = [f"p-{p}-{i}" for p in PATHS for i in range(args.bindings)]
                admin.create_pods([pod_manifest(name, namespace=NAMESPACE) for name in pods], workers=8)
                if pods:
                    say(f"{len(pods)} pending pods created")

                def post_event(kube: Kube, path: str, i: int) -> None:
                    kube.create_event(NAMESPACE, event(f"e-{path}-{i}", f"p-{path}-{i}"))

                def bind(kube: Kube, path: str, i: int) -> None:
                    kube.create_binding(NAMESPACE, f"p-{path}-{i}", "", "node-0", annotations={"bench": "1"})

                for path, kube in clients.items():  # open the connections (TLS handshakes) before measuring
                    for i in range(WARMUP):
                        kube.create_event(NAMESPACE, event(f"w-{path}-{i}", "warmup"))
                events = measure(clients, args.calls, args.block, post_event, deadline)
                report(f"Event POSTs ({args.calls} per path, blocks of {args.block})", events)
                if args.bindings:
                    bindings = measure(clients, args.bindings, args.block, bind, deadline)
                    report(f"Binding POSTs ({args.bindings} per path, blocks of {args.block})", bindings)
                if time.monotonic() >= deadline:
                    print(f"\nstopped at the --deadline ({args.deadline:.0f}s): fewer calls than asked")
            finally:
                for kube in clients.values():
                    kube.close()
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
        description="Client CPU per API write: the kubernetes ApiClient against the lean transport."
    )
    p.add_argument("--calls", type=bounded(MAX_CALLS), default=400, help="Event POSTs per path (default 400)")
    p.add_argument("--bindings", type=bounded(MAX_CALLS), default=200, help="Binding POSTs per path; 0: none")
    p.add_argument("--block", type=int, default=50, help="calls per path before switching to the other")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds for the measuring, at most")
    args = p.parse_args(argv)
    args.block = max(1, args.block)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
