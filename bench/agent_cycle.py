"""Benchmark the node agent: cycle cost and Node writes in steady state.

1. One discovery + publish cycle on the fixture backend, N times: the first (a real Node patch),
   steady cycles (compare only), and cycles where the GPUs in use change every time (a patch each).
   Reports time per cycle and the process's peak RSS.
2. Node writes per minute in steady state: the real loop (threading.Event, wall clock) with short
   intervals against an in-memory NodeApi for a bounded time, counting Node patches against Lease
   renewals; then the same loop on a simulated clock at the production settings for one hour.
   Target: zero Node writes after the first publish; only the Lease renews.

    .venv/bin/python bench/agent_cycle.py [--system dgx-h100] [--cycles 2000] [--seconds 3]
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from agent.backends import FixtureBackend, InUseSource, NoneInUse
from agent.memory_api import InMemoryNodeApi
from agent.metrics import AgentMetrics
from agent.publisher import Publisher
from agent.runner import Agent
from gputopo.model import NodeTopology

NODE = "bench-node"


class Alternating:
    """GPUs in use that change on every call, so every cycle must patch the Node."""

    def __init__(self) -> None:
        self.n = 0

    def gpus_in_use(self, topology: NodeTopology) -> frozenset[int]:
        self.n += 1
        return frozenset({self.n % len(topology.gpus)})

    def close(self) -> None:
        pass


def make_agent(
    system: str, in_use: InUseSource, interval: float, heartbeat: float, stop: threading.Event
) -> tuple[Agent, InMemoryNodeApi]:
    api = InMemoryNodeApi(NODE)
    publisher = Publisher(api, NODE, "gputopo-system", lease_duration_s=120, sleep=stop.wait)
    agent = Agent(FixtureBackend(system, NODE), in_use, publisher, AgentMetrics(), interval, heartbeat, stop)
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
    size = len(api.annotations.get("gputopo.io/topology", ""))
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
    publisher = Publisher(api, NODE, "gputopo-system", lease_duration_s=120, sleep=sim.wait, monotonic=sim.clock)
    agent = Agent(
        FixtureBackend(system, NODE), NoneInUse(), publisher, AgentMetrics(), interval, heartbeat, sim, clock=sim.clock
    )
    agent.run()
    writes = api.calls["patch_node"] - 1
    beats = api.calls["renew_lease"]
    print(f"== simulated hour at production settings (interval {interval:g}s, heartbeat {heartbeat:g}s)")
    print(f"Node writes/min in steady state:  {writes / 60:.2f} ({writes} after the first publish)")
    print(f"Lease renewals/min:               {beats / 60:.2f}")
    print(f"Node reads/min:                   {api.calls['read_node'] / 60:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", default="dgx-h100")
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=3.0, help="wall time of the real-loop run")
    p.add_argument("--interval", type=float, default=0.02, help="real-loop discovery interval")
    p.add_argument("--heartbeat", type=float, default=0.1, help="real-loop Lease interval")
    args = p.parse_args()
    logging.disable(logging.INFO)  # the loop logs each publish; keep the figures readable
    bench_cycles(args.system, args.cycles)
    bench_real_loop(args.system, args.seconds, args.interval, args.heartbeat)
    bench_simulated_hour(args.system)
    return 0


if __name__ == "__main__":
    sys.exit(main())
