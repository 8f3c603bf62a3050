"""Fuzz the DRA driver over its real gRPC unix socket (`bench/fuzz.py --dra`).

Serves the driver (`gputopo.agent.dra.plugin.DraPlugin`) in process on sockets in a temporary directory, with a
stand-in API server whose ResourceClaims are drawn at random: valid allocations, another node's pool,
another driver's devices, a claim split over two nodes, unknown or non-ASCII-digit device names,
malformed JSON shapes, a changed uid, 404s and API failures. Then `--cases` calls (Prepare on v1 and
v1beta1, Unprepare), one to four claims each, from four client threads at once, with claim uids,
namespaces and names that are valid or nasty (a trailing newline, '/', '..', NUL, non-ASCII digits,
over-long). Every 500 cases the driver is restarted, now and then over a checkpoint path holding junk
bytes, deep JSON, a directory or a FIFO. Prints:

- calls, and gRPC failures ("crashes": any status but OK) and exceptions the driver logged as bugs;
- claims answered with an error, and claims a reply left out (target 0);
- files written outside the CDI directory, the plugin's own files and the sockets (target 0), and
  CDI claim specs that disagree with the checkpoint (target 0);
- restarts, and restarts that failed (target 0); claims that failed on writing the checkpoint or a
  CDI spec (target 0: the disk is not full here).

Exit status 1 on any crash, unanswered claim, file outside, disagreement or failed restart.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import grpc

from gputopo.agent.dra.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from gputopo.agent.dra.checkpoint import CHECKPOINT_NAME, Checkpoint
from gputopo.agent.dra.plugin import DraConfig, DraPlugin
from gputopo.engine.dra.devices import DRIVER
from gputopo.kube import KubeError
from gputopo.systems import build_system

NODE = "fuzz-node"
GOOD_UIDS = [f"u{i}" for i in range(24)]
NASTY = ["x\n", "x\r\n", "../x", "a/b", "", "\x00", "\u0663", "gpu-\u00b2", "a" * 200, " x", "x ", ".", "..", "-x"]
DEVICES = ["gpu-0", "gpu-3", "gpu-7", "gpu-8", "gpu-01", "gpu-\u0663", "gpu-\u00b2", "gpu-1\n", "nic-0", "", "gpu-"]
RESTART_EVERY = 500


def nasty_or(rng: random.Random, good: str, p: float = 0.15) -> str:
    return rng.choice(NASTY) if rng.random() < p else good


class FuzzClaims:
    """A ClaimReader whose claims are drawn at random, once per (namespace, name), redrawn now and then."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, str], Any] = {}

    def _draw(self, namespace: str, name: str) -> Any:
        rng = self._rng
        uid = name.removeprefix("claim-") if rng.random() < 0.9 else "changed"
        shape = rng.choice(
            ["ours", "ours", "ours", "other-pool", "other-driver", "split", "odd-devices", "junk", "404"]
        )
        if shape == "404":
            return None
        if shape == "junk":
            return rng.choice([{}, [], "x", {"metadata": "x"}, {"metadata": {"uid": uid}, "status": {"allocation": 7}}])
        results = []
        for _ in range(rng.randint(0 if shape == "odd-devices" else 1, 4)):
            device = rng.choice(DEVICES[:3]) if shape != "odd-devices" else rng.choice(DEVICES)
            driver = "gpu.nvidia.com" if shape == "other-driver" else DRIVER
            pool = "other-node" if shape == "other-pool" or (shape == "split" and rng.random() < 0.5) else NODE
            results.append({"request": rng.choice(["gpus", "r2"]), "driver": driver, "pool": pool, "device": device})
        meta = {"uid": uid, "namespace": namespace, "name": name}
        return {"metadata": meta, "status": {"allocation": {"devices": {"results": results}}}}

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        with self._lock:
            key = (namespace, name)
            if key not in self._claims or self._rng.random() < 0.05:
                self._claims[key] = self._draw(namespace, name)
            claim = copy.deepcopy(self._claims[key])
            fail = self._rng.random() < 0.03
        if fail:
            raise KubeError(503, "unavailable", "ServiceUnavailable")
        if claim is None:
            raise KubeError(404, f"resourceclaims {name!r} not found", "NotFound")
        return claim  # type: ignore[no-any-return]


class NoSlices:
    """A SliceApi that accepts every write: the slice is not what is fuzzed here."""

    def node_uid(self, node: str) -> str:
        return "node-uid"

    def get_slice(self, name: str) -> Any:
        return None

    def list_slice_names(self, node: str, driver: str) -> list[str]:
        return []

    def create_slice(self, body: Any) -> Any:
        return body

    def replace_slice(self, name: str, body: Any) -> Any:
        return body

    def delete_slice(self, name: str) -> None:
        return None


class BugLog(logging.Handler):
    """Counts records logged with a traceback: the driver logs an unexpected exception that way."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.bugs: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.bugs[record.getMessage()] += 1


def junk_checkpoint(rng: random.Random, path: Path) -> str:
    """Put something unreadable at the checkpoint path (or leave it); returns what."""
    kind = rng.choice(["none", "none", "bytes", "deep", "directory", "fifo"])
    if kind == "none":
        return kind
    if path.is_dir() and not path.is_symlink():
        return "none"
    path.unlink(missing_ok=True)
    if kind == "bytes":
        path.write_bytes(rng.randbytes(rng.randint(0, 300)))
    elif kind == "deep":
        path.write_bytes(b"[" * 100_000)
    elif kind == "directory":
        path.mkdir()
        (path / "x").write_text("x")
    else:
        os.mkfifo(path)
    return kind


def allowed(root: Path, path: Path, cdi_dir: Path) -> bool:
    """Files the driver may leave: the CDI directory's, its own directory's, the sockets, /dev stand-in."""
    rel = path.relative_to(root).parts
    return (
        path.parent == cdi_dir
        or rel[:2] in (("plugins", DRIVER), ("registry", f"{DRIVER}-reg.sock"))
        or rel[0] == "dev"
    )


def fuzz_dra(cases: int, time_limit: float, seed: int) -> int:
    rng = random.Random(seed)
    bug_log = BugLog()
    logging.getLogger("gputopo.agent.dra").addHandler(bug_log)
    logging.getLogger("gputopo.agent.dra").setLevel(logging.ERROR)
    logging.getLogger("gputopo.agent.dra").propagate = False  # every refused claim logs a warning: not measured
    with tempfile.TemporaryDirectory(prefix="gputopo-fuzz-dra-") as tmp:
        root = Path(tmp)
        (root / "dev").mkdir()
        config = DraConfig(
            node=NODE,
            plugins_dir=root / "plugins",
            registry_dir=root / "registry",
            cdi_dir=root / "cdi",
            sysfs_root=None,
            dev_root=root,
            poll_s=0.5,
        )
        topo = build_system("dgx-1v", NODE)
        reader = FuzzClaims(random.Random(seed + 1))
        checkpoint_path = config.plugins_dir / DRIVER / CHECKPOINT_NAME
        stats: Counter[str] = Counter()
        lock = threading.Lock()

        def start() -> tuple[DraPlugin, grpc.Channel]:
            plugin = DraPlugin(config, reader, NoSlices(), sleep=lambda _s: True)
            plugin.start(topo)
            assert plugin.server is not None
            return plugin, grpc.insecure_channel(f"unix://{plugin.server.dra_socket.absolute()}")

        def call(channel: grpc.Channel, case_rng: random.Random) -> None:
            v1 = case_rng.random() < 0.5
            pb: Any = dra_v1_pb2 if v1 else dra_v1beta1_pb2
            stub: Any = (dra_v1_pb2_grpc if v1 else dra_v1beta1_pb2_grpc).DRAPluginStub(channel)
            refs = []
            for _ in range(case_rng.randint(1, 4)):
                uid = nasty_or(case_rng, case_rng.choice(GOOD_UIDS))
                namespace = nasty_or(case_rng, "default", 0.05)
                name = nasty_or(case_rng, f"claim-{uid}", 0.05)
                refs.append(pb.Claim(uid=uid, namespace=namespace, name=name))
            prepare = case_rng.random() < 0.6
            try:
                if prepare:
                    resp = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=refs), timeout=10)
                else:
                    resp = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=refs), timeout=10)
            except grpc.RpcError as e:
                with lock:
                    stats[f"crash {e.code().name}"] += 1
                return
            with lock:
                stats["calls"] += 1
                stats["unanswered"] += len({r.uid for r in refs} - set(resp.claims))
                for r in resp.claims.values():
                    if r.error:
                        stats["claim errors"] += 1
                        # The disk is not full here: failing to write its own state is the driver's bug.
                        stats["record failures"] += "cannot record it" in r.error
                    elif prepare:
                        stats["prepared"] += 1
                        stats["bad devices"] += sum(1 for d in r.devices if d.pool_name != NODE)
                    else:
                        stats["unprepared"] += 1

        plugin, channel = start()
        began = time.monotonic()
        done = 0
        try:
            with futures.ThreadPoolExecutor(4) as pool:
                while done < cases and time.monotonic() - began < time_limit:
                    batch = min(RESTART_EVERY, cases - done)
                    seeds = [rng.randrange(1 << 30) for _ in range(batch)]
                    list(pool.map(lambda s, ch=channel: call(ch, random.Random(s)), seeds))
                    done += batch
                    channel.close()
                    plugin.stop()
                    stats[f"restart over {junk_checkpoint(rng, checkpoint_path)}"] += 1
                    try:
                        plugin, channel = start()
                    except Exception as e:  # a start that fails is a finding
                        stats["failed restarts"] += 1
                        print(f"restart failed: {type(e).__name__}: {e}")
                        if checkpoint_path.is_dir():
                            shutil.rmtree(checkpoint_path)
                        else:
                            checkpoint_path.unlink(missing_ok=True)
                        plugin, channel = start()
            # Everything unprepared: nothing of ours may be left but the node's spec.
            stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
            assert plugin.driver is not None
            prepared = list(plugin.driver.prepared())
            refs = [dra_v1_pb2.Claim(uid=u, namespace="default", name=f"claim-{u}") for u in prepared]
            resp = stub.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=refs), timeout=30)
            stats["final unprepare errors"] = sum(1 for r in resp.claims.values() if r.error)
        finally:
            channel.close()
            plugin.stop()
        elapsed = time.monotonic() - began
        cdi_dir = config.cdi_dir
        outside = [p for p in root.rglob("*") if not p.is_dir() and not allowed(root, p, cdi_dir)]
        left = sorted(p.name for p in cdi_dir.iterdir() if p.name != "gputopo.io-gpu.json")
        remaining = dict(Checkpoint(checkpoint_path).claims()) if checkpoint_path.is_file() else {}
    crashes = sum(n for k, n in stats.items() if k.startswith("crash"))
    restarts = ", ".join(
        f"{k.removeprefix('restart over ')}: {n}" for k, n in sorted(stats.items()) if k.startswith("restart")
    )
    print(f"DRA driver over its unix socket: {done} cases ({stats['calls']} answered) in {elapsed:.1f} s, seed {seed}")
    print(f"crashes (gRPC failures): {crashes}  exceptions logged as bugs: {sum(bug_log.bugs.values())}")
    print(
        f"claims: {stats['prepared']} prepared, {stats['unprepared']} unprepared, {stats['claim errors']} errors "
        f"answered per claim, {stats['unanswered']} unanswered, {stats['bad devices']} devices of another pool"
    )
    print(f"restarts over the checkpoint path holding: {restarts}; failed restarts: {stats['failed restarts']}")
    print(f"claims that failed on writing the driver's own state: {stats['record failures']}")
    print(
        f"files outside the CDI dir: {len(outside)}  CDI claim specs left after unpreparing all: {len(left)}  "
        f"claims left in the checkpoint: {len(remaining)}"
    )
    for p in outside[:5]:
        print(f"  outside: {p}")
    for msg, n in bug_log.bugs.most_common(5):
        print(f"  bug logged {n}x: {msg}")
    bad = crashes + sum(bug_log.bugs.values()) + stats["unanswered"] + stats["bad devices"] + stats["failed restarts"]
    bad += len(outside) + len(left) + len(remaining) + stats["final unprepare errors"] + stats["record failures"]
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=5_000)
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    opts = ap.parse_args()
    return fuzz_dra(opts.cases, opts.time_limit, opts.seed)


if __name__ == "__main__":
    raise SystemExit(main())
