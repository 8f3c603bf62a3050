"""What the extender spends on a pod that is none of its business: with `managedResources` empty (the
chart's default, so that a group's members without GPUs reach the extender) kube-scheduler sends every
pod of gputopo's profile, also one that is no group member and asks for no GPU. Its filter passes every
node at once and its bind just posts the Binding (no placement, no event).

In process, over a cluster file of `--nodes` nodes (extender_latency.py's mix): the median CPU
microseconds of one pass-through filter call through the door (decode, decide, encode) with every node
named, next to a floor that only decodes the same body and encodes the same answer with the same JSON
library; and of one bind of such a pod (its GET and Binding answered by a stub in memory, so the figure
is the extender's own CPU, not the API server's). Targets are printed, not asserted: a pass-through
filter within 1.5x its floor, a bind under 200 us.

    .venv/bin/python bench/passthrough_cost.py [--nodes 1000,5000] [--calls 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from extender_latency import write_cluster

from gputopo.extender.app import create_listeners
from gputopo.extender.settings import Settings
from gputopo.model import SCHEDULER_NAME

TARGET_FLOOR_RATIO = 1.5
TARGET_BIND_US = 200.0


def plain_pod(i: int) -> dict[str, Any]:
    """A web server under gputopo's profile: no gputopo annotation, no controller's labels, no GPU."""
    return {
        "metadata": {"name": f"web-{i}", "namespace": "default", "uid": f"uid-web-{i}", "labels": {"app": "web"}},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "containers": [{"name": "web", "image": "x", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}],
        },
        "status": {"phase": "Pending"},
    }


class StubSource:
    """The API server's answers in memory: the pod on GET, nothing on the Binding."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], Any] = {}
        self.bindings = 0

    def get_pod(self, namespace: str, name: str) -> Any:
        return self.pods[(namespace, name)]

    def create_binding(
        self, namespace: str, name: str, uid: str, node: str, *, annotations: Mapping[str, str] | None = None
    ) -> None:
        assert annotations is None, "a plain pod's Binding carries no placement"
        self.bindings += 1


def cpu_us(fn: Any, calls: int) -> float:
    """Median CPU microseconds of `fn(i)` over `calls` calls (after a few to warm up)."""
    for i in range(5):
        fn(-1 - i)
    times = []
    for i in range(calls):
        t0 = time.process_time_ns()
        fn(i)
        times.append((time.process_time_ns() - t0) / 1e3)
    return statistics.median(times)


def measure(nodes: int, calls: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        names = write_cluster(path, nodes)
        door = create_listeners(Settings(snapshot=path, metrics_port=0)).door
    stub = StubSource()
    door.extender.source = stub  # type: ignore[assignment]  # the binder reads its source through the extender
    bodies = {i: orjson.dumps({"Pod": plain_pod(i), "Nodes": None, "NodeNames": names}) for i in range(-5, calls)}
    answer = orjson.dumps({"NodeNames": names, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""})

    status, out = door.answer("filter", bodies[-5])
    assert status == 200 and orjson.loads(out)["NodeNames"] == names, "a plain pod passes every node"

    def filter_call(i: int) -> None:
        assert door.answer("filter", bodies[i])[0] == 200

    def floor(i: int) -> None:
        orjson.loads(bodies[i])
        orjson.dumps(orjson.loads(answer))

    def bind_call(i: int) -> None:
        pod = plain_pod(i)
        stub.pods[("default", pod["metadata"]["name"])] = pod
        body = {"PodName": f"web-{i}", "PodNamespace": "default", "PodUID": f"uid-web-{i}", "Node": names[i % nodes]}
        status, out = door.answer("bind", orjson.dumps(body))
        assert status == 200 and orjson.loads(out)["Error"] == ""

    return cpu_us(filter_call, calls), cpu_us(floor, calls), cpu_us(bind_call, calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", default="1000,5000")
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args(argv)
    print(f"{'nodes':>6} {'filter us':>9} {'floor us':>8} {'x floor':>7} {'bind us':>8}  target")
    for n in (int(s) for s in args.nodes.split(",")):
        filt, base, bind = measure(n, args.calls)
        ok = filt <= TARGET_FLOOR_RATIO * base and bind <= TARGET_BIND_US
        verdict = f"filter <= {TARGET_FLOOR_RATIO:g}x floor, bind <= {TARGET_BIND_US:g} us: {'met' if ok else 'MISSED'}"
        print(f"{n:>6} {filt:>9.1f} {base:>8.1f} {filt / base:>7.2f} {bind:>8.1f}  {verdict}")
    print("(CPU microseconds per call, median, in process: a pod that is no group member and asks for no GPU;")
    print(" floor: decoding the same filter body and encoding the same answer, nothing else)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
