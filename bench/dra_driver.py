"""The DRA driver's two costs an attacker on the node could raise (docs/benchmarks.md, "The DRA driver").

- cliques: a 32-GPU "full mesh minus a perfect matching" NVLink graph has 2^16 maximal cliques. Prints
  the CPU seconds and the ResourceSlice spec's size (JSON bytes) for the scalar and the list encoding,
  and the CPU seconds of a second publish of the same topology (the memo).
- bestfit: best-fit order's cost per claim change on each named system: 2,000 claims (1, 2 or 4 GPUs,
  seeded) allocated by the emulated allocator over the published order and released at random, the
  slice re-published after each change; prints slice writes per change, the slice's JSON bytes per
  write, and the agent's CPU per re-publish (order, spec and compare).
- blocks: the same with `--dra-blocks` (the pool: a counters slice and the devices with the clique
  blocks), 2- and 4-GPU claims taking the first free block of their size in the published order;
  slice writes per change count every slice written (the first publish's two are not counted).
- order: best-fit order's CPU per order (`gputopo.engine.dra.order`), without its work budget (before)
  and with it (after), side by side: on each named system over random GPUs in use (seeded), and on 32-GPU
  wirings built against the clique search (each GPU linked to all but its partner, link counts irregular);
  prints ms per order, the work units spent and how many orders ran past the budget.
- unprepare: six Prepares whose ResourceClaim reads the API server answers only after `--api-s`
  seconds, then one Unprepare (which needs no API read) over the real unix socket; prints how long
  the Unprepare took.

    .venv/bin/python bench/dra_driver.py [--api-s 2.5] [--skip cliques|bestfit|blocks|order|unprepare]
    .venv/bin/python bench/dra_driver.py --part order   # only the named parts
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz_dra import NoSlices  # bench/, the script's directory, is on sys.path

from gputopo.model import NodeTopology
from gputopo.systems import build_system

NODE = "bench-node"


def mesh_minus_matching(n: int = 32, strength: Callable[[int, int], int] = lambda _i, _j: 2) -> NodeTopology:
    """`n` GPUs, each NVLinked to every other but its partner (2k, 2k+1): 2^(n/2) maximal cliques.
    `strength(i, j)`: the link count of a linked pair (symmetric)."""
    base = build_system("dgx-h100", NODE)
    gpu = base.gpus[0]
    gpus = tuple(gpu.model_copy(update={"index": i, "uuid": f"GPU-bench-{i:04d}", "pci_bus_id": ""}) for i in range(n))
    links = tuple(
        tuple(0 if j == i or j == i ^ 1 else strength(min(i, j), max(i, j)) for j in range(n)) for i in range(n)
    )
    nvlink = base.nvlink.model_copy(update={"links": links})
    return base.model_copy(update={"gpus": gpus, "nvlink": nvlink, "nics": (), "degraded_links": ()})


def cliques() -> None:
    from gputopo.agent.dra.slices import SliceShape, desired_spec
    from gputopo.engine.dra import devices as dra

    topo = mesh_minus_matching()
    for list_attributes in (False, True):
        for attempt in ("first", "again"):
            if attempt == "first" and hasattr(dra, "encode"):
                dra.encode.cache_clear()  # a cold memo: the enumeration is measured too
            t0 = time.process_time()
            spec = desired_spec(NODE, topo, SliceShape(list_attributes=list_attributes, device_taints=False))
            cpu = time.process_time() - t0
            size = len(json.dumps(spec).encode())
            kind = "list" if list_attributes else "scalar"
            print(f"cliques {kind:6} {attempt}: {cpu:.3f} s CPU, slice spec {size / 1024:.1f} KiB")


class CountingSlices:
    """A SliceApi in memory that counts writes and their bytes, as the API server would receive them."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] = {}
        self.writes = 0
        self.bytes = 0

    def node_uid(self, node: str) -> str:
        return "node-uid"

    def get_slice(self, name: str) -> Any:
        return self.stored.get(name)

    def list_slice_names(self, node: str, driver: str) -> list[str]:
        return list(self.stored)

    def _store(self, body: Any) -> Any:
        self.writes += 1
        self.bytes += len(json.dumps(body).encode())
        doc = json.loads(json.dumps(body))
        doc["metadata"]["resourceVersion"] = str(self.writes)
        self.stored[doc["metadata"]["name"]] = doc
        return doc

    def create_slice(self, body: Any) -> Any:
        return self._store(body)

    def replace_slice(self, name: str, body: Any) -> Any:
        return self._store(body)

    def delete_slice(self, name: str) -> None:
        self.stored.pop(name, None)


def _block(topo: NodeTopology, k: int, in_use: frozenset[int]) -> tuple[int, ...] | None:
    """A k-block claim's GPUs: the first free block of k in the order published for `in_use`."""
    from gputopo.engine.dra.blocks import block_devices, first_free
    from gputopo.engine.state.cliques import bits, mask_of

    order = [mask_of(list(d.gpus)) for d in block_devices(topo, in_use)]
    found = first_free(order, k, mask_of(sorted(in_use)))
    return tuple(bits(found)) if found else None


def bestfit(claims: int = 2000, seed: int = 0, blocks: bool = False) -> None:
    import random

    from gputopo.agent.dra.pool import PoolPublisher
    from gputopo.agent.dra.slices import SlicePublisher, SliceShape
    from gputopo.engine.dra.devices import device_name, devices
    from gputopo.sim.draallocator import allocate, partition_claim, unconstrained_claim

    for system in ("dgx-h100", "dgx-1v", "a100-pcie-bridged", "gb200-tray"):
        topo = build_system(system, NODE)
        api = CountingSlices()
        shape = SliceShape(list_attributes=False, device_taints=False, best_fit_order=True, blocks=blocks)
        pub = (PoolPublisher if blocks else SlicePublisher)(api, NODE, shape, sleep=lambda _s: True)
        pub.publish(topo, in_use=frozenset())
        rng = random.Random(seed)
        held: list[tuple[int, ...]] = []
        in_use: frozenset[int] = frozenset()
        writes0, bytes0, changes, cpu = api.writes, api.bytes, 0, 0.0
        for _ in range(claims):
            if held and (rng.random() < 0.5 or len(in_use) == len(topo.gpus)):
                gone = held.pop(rng.randrange(len(held)))
                in_use = in_use - set(gone)
            else:
                k = rng.choice([1, 2, 4] if len(topo.gpus) > 4 else [1, 2])
                claim = unconstrained_claim(1) if k == 1 else partition_claim(k)
                order = devices(topo, list_attributes=False, in_use=in_use)
                got = allocate(order, claim, [device_name(g) for g in sorted(in_use)])
                gpus = _block(topo, k, in_use) if blocks and k > 1 else (got.gpus if got else None)
                if gpus is None:
                    continue
                held.append(gpus)
                in_use = in_use | set(gpus)
            changes += 1
            t0 = time.process_time()
            pub.publish(topo, in_use=in_use)
            cpu += time.process_time() - t0
        writes = api.writes - writes0
        print(
            f"bestfit{' blocks' if blocks else ''} {system:18} {changes} changes: "
            f"{writes / changes:.2f} slice writes per change, "
            f"{(api.bytes - bytes0) / max(writes, 1) / 1024:.1f} KiB per write, "
            f"{1e3 * cpu / changes:.2f} ms CPU per re-publish"
        )


# Wirings built against the clique search: name -> (GPUs, link count of a linked pair i < j).
HOSTILE_WIRINGS: dict[str, tuple[int, Callable[[int, int], int]]] = {
    "mesh-32 minus matching, NV2": (32, lambda _i, _j: 2),
    "mesh-32 minus matching, NV1-3 irregular": (32, lambda i, j: 1 + (i * j + i + j) % 3),
    "mesh-24 minus matching, NV1-3 irregular": (24, lambda i, j: 1 + (i * j + i + j) % 3),
}


def _orders(topo: NodeTopology, states: list[frozenset[int]], budget: int) -> tuple[float, float, int, int]:
    """CPU ms per order (mean, max), the most work units one took, and how many ran past the budget."""
    from gputopo.engine.dra.devices import encoding
    from gputopo.engine.dra.order import bounded_order
    from gputopo.engine.state.cliques import mask_of
    from gputopo.engine.state.snapshot import shape_of

    shape, part = shape_of(topo), encoding(topo).partitions[0]
    usable = mask_of([g.index for g in topo.gpus])
    times, work, capped = [], 0, 0
    for in_use in states:
        bounded_order.cache_clear()  # every order computed, none answered from the memo
        t0 = time.process_time()
        got = bounded_order(shape, part, usable, mask_of(sorted(in_use)), budget)
        times.append(1e3 * (time.process_time() - t0))
        work, capped = max(work, got.work), capped + got.capped
    return sum(times) / len(times), max(times), work, capped


def order(states: int = 200, hostile_states: int = 3, seed: int = 0) -> None:
    import random

    from gputopo.engine.dra.order import ORDER_BUDGET

    unbounded = 10**15  # the nesting as it was before the budget: every rank to the end
    rng = random.Random(seed)
    cases: list[tuple[str, NodeTopology, int]] = [
        (name, build_system(name, NODE), states)
        for name in ("dgx-1v", "dgx-h100", "dgx-a100", "hgx-a100-4", "a100-pcie-bridged", "gb200-tray")
    ]
    cases += [(name, mesh_minus_matching(n, fn), hostile_states) for name, (n, fn) in HOSTILE_WIRINGS.items()]
    print(f"order: ms CPU per order (mean / max), most work units, orders past the budget ({ORDER_BUDGET:,})")
    for name, topo, count in cases:
        n = len(topo.gpus)
        picks = [frozenset(rng.sample(range(n), rng.randrange(n))) for _ in range(count - 1)]
        run = [frozenset(), *picks]
        b_mean, b_max, b_work, _ = _orders(topo, run, unbounded)
        a_mean, a_max, a_work, a_capped = _orders(topo, run, ORDER_BUDGET)
        print(
            f"order {name:40} {len(run):3} orders: before {b_mean:9.2f} / {b_max:9.2f} ms, {b_work:>13,} units; "
            f"after {a_mean:6.2f} / {a_max:6.2f} ms, {a_work:>6,} units, {a_capped} capped"
        )


class SlowClaims:
    """A ClaimReader whose every read takes `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.reads = 0
        self._lock = threading.Lock()

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        with self._lock:
            self.reads += 1
        time.sleep(self.delay_s)
        uid = name.removeprefix("claim-")
        results = [{"request": "gpus", "driver": "gpu.gputopo.io", "pool": NODE, "device": "gpu-0"}]
        return {
            "metadata": {"uid": uid, "namespace": namespace, "name": name},
            "status": {"allocation": {"devices": {"results": results}}},
        }


def unprepare(api_s: float) -> None:
    import grpc

    from gputopo.agent.dra.api import dra_v1_pb2, dra_v1_pb2_grpc
    from gputopo.agent.dra.plugin import DraConfig, DraPlugin

    with tempfile.TemporaryDirectory(prefix="gputopo-dra-bench-") as tmp:
        root = Path(tmp)
        config = DraConfig(
            node=NODE,
            plugins_dir=root / "plugins",
            registry_dir=root / "registry",
            cdi_dir=root / "cdi",
            sysfs_root=None,
            dev_root=root,
            poll_s=0.5,
        )
        reader = SlowClaims(api_s)
        plugin = DraPlugin(config, reader, NoSlices(), sleep=lambda _s: True)
        plugin.start(build_system("dgx-h100", NODE))
        assert plugin.server is not None
        channel = grpc.insecure_channel(f"unix://{plugin.server.dra_socket.absolute()}")
        stub: Any = dra_v1_pb2_grpc.DRAPluginStub(channel)
        pool = futures.ThreadPoolExecutor(6)
        try:

            def claim(u: str) -> Any:
                return dra_v1_pb2.Claim(uid=u, namespace="default", name=f"claim-{u}")

            prepares = [
                pool.submit(
                    stub.NodePrepareResources,
                    dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim(f"p{i}")]),
                    timeout=60,
                )
                for i in range(6)
            ]
            deadline = time.monotonic() + 5
            while reader.reads < 4 and time.monotonic() < deadline:  # the old driver's 4 workers are busy
                time.sleep(0.01)
            time.sleep(0.1)
            t0 = time.monotonic()
            stub.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim("gone")]), timeout=60)
            took = time.monotonic() - t0
            errors = sum(1 for f in prepares for r in f.result().claims.values() if r.error)
            print(f"unprepare behind 6 prepares reading a {api_s} s API: {took:.3f} s (prepare errors: {errors})")
        finally:
            pool.shutdown()
            channel.close()
            plugin.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api-s", type=float, default=2.5)
    parts = ["cliques", "bestfit", "blocks", "order", "unprepare"]
    ap.add_argument("--skip", action="append", default=[], choices=parts)
    ap.add_argument("--part", action="append", default=[], choices=parts, help="run only these parts")
    opts = ap.parse_args()
    run = [p for p in (opts.part or parts) if p not in opts.skip]
    if "cliques" in run:
        cliques()
    if "bestfit" in run:
        bestfit()
    if "blocks" in run:
        bestfit(blocks=True)
    if "order" in run:
        order()
    if "unprepare" in run:
        unprepare(opts.api_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
