"""Benchmark the node agent: cycle cost and Node writes in steady state.

1. One discovery + publish cycle on the fixture backend, N times: the first (a real Node patch),
   steady cycles (compare only), and cycles where the GPUs in use change every time (a patch each).
   Reports time per cycle and the process's peak RSS.
2. Node writes per minute in steady state: the real loop (threading.Event, wall clock) with short
   intervals against an in-memory NodeApi for a bounded time, counting Node patches against Lease
   renewals; then the same loop on a simulated clock at the production settings for one hour.
   Target: zero Node writes after the first publish; only the Lease renews.
3. Node writes per pod start and per pod stop, with per-pod truth from a simulated kubelet.
4. The device plugin over its real gRPC unix socket: GetPreferredAllocation latency when the
   admitted pod has a placement (among running pods that do not match) and when it falls back to
   best effort, and Allocate latency, over a bounded number of calls each.

    .venv/bin/python bench/agent_cycle.py [--system dgx-h100] [--cycles 2000] [--seconds 3] [--calls 2000]
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import grpc

from gputopo.agent.backends import FixtureBackend, InUseSource, NoneInUse
from gputopo.agent.deviceplugin import api_pb2, api_pb2_grpc
from gputopo.agent.deviceplugin.plugin import DevicePlugin, PluginConfig
from gputopo.agent.metrics import AgentMetrics
from gputopo.agent.nodepublisher import LeaseTerms, Publisher
from gputopo.agent.podresources import api_pb2 as pr_pb2
from gputopo.agent.pods import StaticLocalPods
from gputopo.agent.runner import Agent, Pacing
from gputopo.model import (
    DEFAULT_NAMESPACE,
    GPU_RESOURCE,
    PLACEMENT_ANNOTATION,
    TOPOLOGY_ANNOTATION,
    GpusInUse,
    NodeTopology,
    Placement,
)
from gputopo.systems import build_system
from tests.agent.dp_harness import serve_podresources
from tests.agent.memory_api import InMemoryNodeApi

NODE = "bench-node"


class Alternating:
    """GPUs in use that change on every call, so every cycle must patch the Node."""

    def __init__(self) -> None:
        self.n = 0

    def gpus_in_use(self, topology: NodeTopology) -> GpusInUse:
        self.n += 1
        return GpusInUse(other=frozenset({self.n % len(topology.gpus)}))

    def close(self) -> None:
        pass


class Kubelet:
    """Per-pod truth as the kubelet's PodResources would report it: pods start and stop between cycles."""

    def __init__(self) -> None:
        self.pods: dict[str, frozenset[int]] = {}

    def gpus_in_use(self, topology: NodeTopology) -> GpusInUse:
        return GpusInUse(pods=dict(self.pods))

    def close(self) -> None:
        pass


def make_agent(
    system: str, in_use: InUseSource, interval: float, heartbeat: float, stop: threading.Event
) -> tuple[Agent, InMemoryNodeApi]:
    api = InMemoryNodeApi(NODE)
    publisher = Publisher(api, NODE, LeaseTerms(DEFAULT_NAMESPACE, 120), sleep=stop.wait)
    agent = Agent(FixtureBackend(system, NODE), in_use, publisher, AgentMetrics(), Pacing(interval, heartbeat, stop))
    return agent, api


def ms(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    return f"mean {statistics.fmean(values) * 1e3:.3f} ms, p50 {q[49] * 1e3:.3f} ms, p99 {q[98] * 1e3:.3f} ms"


def bench_cycles(system: str, cycles: int) -> None:
    stop = threading.Event()
    agent, api = make_agent(system, NoneInUse(), 10, 30, stop)
    t0 = time.perf_counter()
    agent.cycle()
    first = time.perf_counter() - t0
    steady = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        agent.cycle()
        steady.append(time.perf_counter() - t0)
    changing_agent, changing_api = make_agent(system, Alternating(), 10, 30, stop)
    changing = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        changing_agent.cycle()
        changing.append(time.perf_counter() - t0)
    size = len(api.annotations.get(TOPOLOGY_ANNOTATION, ""))
    print(f"== discovery + publish cycle, fixture:{system} ({size} B topology annotation)")
    print(f"first cycle (Node patched):       {first * 1e3:.3f} ms")
    print(f"steady cycles x{cycles} (no write):  {ms(steady)}; Node patches {api.calls['patch_node'] - 1}")
    print(f"changing cycles x{cycles} (patch):   {ms(changing)}; Node patches {changing_api.calls['patch_node']}")
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(f"peak RSS of this process:         {rss_kib / 1024:.1f} MiB")


def bench_real_loop(system: str, seconds: float, interval: float, heartbeat: float) -> None:
    stop = threading.Event()
    agent, api = make_agent(system, NoneInUse(), interval, heartbeat, stop)
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    t0 = time.perf_counter()
    agent.run()
    elapsed = time.perf_counter() - t0
    timer.cancel()
    writes_after_first = api.calls["patch_node"] - 1
    renewals = api.calls["renew_lease"]
    print(f"== real loop, interval {interval}s, heartbeat {heartbeat}s, {elapsed:.2f}s wall")
    print(f"cycles (Node reads):              {api.calls['read_node']}")
    print(f"Node writes after the first:      {writes_after_first} ({writes_after_first / elapsed * 60:.1f}/min)")
    print(f"Lease create + renewals:          {api.calls['create_lease']} + {renewals}")


class SimTime:
    def __init__(self, end: float) -> None:
        self.now = 0.0
        self.end = end

    def clock(self) -> float:
        return self.now

    def is_set(self) -> bool:
        return self.now >= self.end

    def wait(self, timeout: float | None = None) -> bool:
        self.now = min(self.end, self.now + (timeout or 0.0))
        return self.is_set()


def bench_simulated_hour(system: str, interval: float = 10.0, heartbeat: float = 30.0) -> None:
    sim = SimTime(3600.0)
    api = InMemoryNodeApi(NODE)
    publisher = Publisher(api, NODE, LeaseTerms(DEFAULT_NAMESPACE, 120), sleep=sim.wait, monotonic=sim.clock)
    pacing = Pacing(interval, heartbeat, sim, sim.clock)
    agent = Agent(FixtureBackend(system, NODE), NoneInUse(), publisher, AgentMetrics(), pacing)
    agent.run()
    writes = api.calls["patch_node"] - 1
    beats = api.calls["renew_lease"]
    print(f"== simulated hour at production settings (interval {interval:g}s, heartbeat {heartbeat:g}s)")
    print(f"Node writes/min in steady state:  {writes / 60:.2f} ({writes} after the first publish)")
    print(f"Lease renewals/min:               {beats / 60:.2f}")
    print(f"Node reads/min:                   {api.calls['read_node'] / 60:.2f}")


def bench_pod(name: str, gpus: tuple[int, ...] | None, count: int, phase: str, second: int) -> dict[str, Any]:
    ann = {}
    if gpus is not None:
        ann[PLACEMENT_ANNOTATION] = Placement(node=NODE, gpus=gpus, score=1, reason="bench").to_annotation()
    return {
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": f"uid-{name}",
            "creationTimestamp": f"2026-01-01T00:{second // 60 % 60:02d}:{second % 60:02d}Z",
            "annotations": ann,
        },
        "spec": {"containers": [{"name": "main", "resources": {"limits": {GPU_RESOURCE: str(count)}}}]},
        "status": {"phase": phase},
    }


def bench_pod_churn(system: str, pods: int, cycles_per_phase: int = 5) -> None:
    """Node writes per pod start and per pod stop: each pod runs for several agent cycles, then ends."""
    stop = threading.Event()
    kubelet = Kubelet()
    agent, api = make_agent(system, kubelet, 10, 30, stop)
    agent.cycle()  # the first publish
    gpu_count = len(build_system(system, NODE).gpus)
    starts = stops = 0
    for i in range(pods):
        before = api.calls["patch_node"]
        kubelet.pods[f"uid-{i}"] = frozenset({i % gpu_count})
        for _ in range(cycles_per_phase):
            agent.cycle()
        starts += api.calls["patch_node"] - before
        before = api.calls["patch_node"]
        del kubelet.pods[f"uid-{i}"]
        for _ in range(cycles_per_phase):
            agent.cycle()
        stops += api.calls["patch_node"] - before
    print(f"== pod churn, {pods} pods, each alive for {cycles_per_phase} agent cycles (per-pod truth, version 2)")
    print(f"Node writes per pod start:        {starts / pods:.2f}")
    print(f"Node writes per pod stop:         {stops / pods:.2f}")


def bench_device_plugin(system: str, calls: int, kubelet_pods: int = 0) -> None:
    """With `kubelet_pods`, every request also reads a PodResources `List` of that many pods over a socket."""
    topology = build_system(system, NODE)
    uuids = [g.uuid for g in topology.gpus]
    # Running pods hold GPUs 0-3 (their placements are not available); the admitted pod asks for 2 of 4-7.
    running = [bench_pod(f"run-{i}", (i,), 1, "Running", i) for i in range(4)]
    pods = StaticLocalPods(NODE, running)
    with tempfile.TemporaryDirectory(prefix="gputopo-bench-") as tmp, serve_podresources(Path(tmp) / "pr.sock") as kl:
        config = PluginConfig(plugin_dir=Path(tmp), poll_s=5.0, podresources_socket=kl.socket if kubelet_pods else None)
        plugin = DevicePlugin(config, pods)
        plugin.start(topology)
        assert plugin.server is not None
        channel = grpc.insecure_channel(f"unix://{plugin.server.socket_path}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        free = uuids[4:]

        def ask(size: int) -> tuple[float, list[str]]:
            req = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=free, allocation_size=size)
                ]
            )
            t0 = time.perf_counter()
            resp = stub.GetPreferredAllocation(req, timeout=10)
            return time.perf_counter() - t0, list(resp.container_responses[0].deviceIDs)

        def allocate(ids: list[str]) -> float:
            req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)])
            t0 = time.perf_counter()
            stub.Allocate(req, timeout=10)
            return time.perf_counter() - t0

        placed, best, alloc = [], [], []
        for i in range(calls):
            # A new pending pod each time, so every call identifies a pod and answers from its placement.
            gpus = (4 + i % 4, 4 + (i + 1) % 4)
            pods.set_objects([*running, bench_pod(f"p{i}", gpus, 2, "Pending", 100 + i)])
            names = [*(f"other-{k}" for k in range(max(kubelet_pods - 5, 0))), *(f"run-{k}" for k in range(4)), f"p{i}"]
            kl.pods = [
                pr_pb2.PodResources(name=n, namespace="bench", containers=[pr_pb2.ContainerResources(name="main")])
                for n in names
            ]
            took, answer = ask(2)
            assert answer == [uuids[g] for g in gpus], answer
            placed.append(took)
            alloc.append(allocate(answer))
        pods.set_objects([*running, bench_pod("plain", None, 2, "Pending", 1)])
        for _ in range(calls):
            best.append(ask(2)[0])
        channel.close()
        plugin.stop()
    kubelet = f", the kubelet's PodResources List of {kubelet_pods} pods read per request" if kubelet_pods else ""
    print(f"== device plugin over its unix socket, fixture:{system}, {calls} calls each{kubelet}")
    print(f"GetPreferredAllocation, placement: {ms(placed)}")
    print(f"GetPreferredAllocation, besteffort: {ms(best)}")
    print(f"Allocate (envvar):                 {ms(alloc)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", default="dgx-h100")
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=3.0, help="wall time of the real-loop run")
    p.add_argument("--interval", type=float, default=0.02, help="real-loop discovery interval")
    p.add_argument("--heartbeat", type=float, default=0.1, help="real-loop Lease interval")
    p.add_argument("--calls", type=int, default=2000, help="device plugin calls per measured RPC")
    args = p.parse_args()
    logging.disable(logging.INFO)  # the loop logs each publish; keep the figures readable
    bench_cycles(args.system, args.cycles)
    bench_real_loop(args.system, args.seconds, args.interval, args.heartbeat)
    bench_simulated_hour(args.system)
    bench_pod_churn(args.system, pods=200)
    bench_device_plugin(args.system, args.calls)
    bench_device_plugin(args.system, args.calls, kubelet_pods=40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
