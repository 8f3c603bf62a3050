"""Extender latency over HTTP on loopback: filter+prioritize in snapshot mode, against a floor endpoint.

For 100, 1,000 and 5,000 nodes this writes a cluster file (a mix of dgx-h100, hgx-h200, dgx-a100 and
l40s-4 nodes under leaf/spine labels, some GPUs in use), starts the real `gputopo-extender --snapshot`
in a subprocess, and a floor: the extender's own verbs server (`gputopo.extender.http.verbserver`: same loop, same
HTTP parser, same worker-thread hop) with verbs that only decode the same request with the same JSON
library (orjson) and encode an answer of the same size (the extender's own answer to that request,
handed to it beforehand as Python objects).
The floor is therefore the HTTP + JSON cost of the exchange; what the extender adds is its decision.

It sends filter (`NodeNames` = all nodes, Go-cased, `Nodes: null`) followed by prioritize with the nodes
that filter passed, as kube-scheduler does, for an 8-GPU gputopo pod and for a plain pod, and prints per
case: p50/p99 of the pair, the same for the floor,
the ratio of p99s, the server's CPU per pair (from /proc, both servers) and the bytes exchanged.
It then times one 8-GPU decision over the largest size in process (decode, filter, encode; a new pod
each time, the ledger's per-kind memo warm as in a long-running extender, and cleared: cold).
Targets are printed, not asserted: at 5,000 nodes, 8-GPU pod p99 <= 5 ms and <= 1.5x the floor's;
one in-process decision <= 5 ms.

    .venv/bin/python bench/extender_latency.py [--sizes 100,1000,5000] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from gputopo.model import GPU_RESOURCE, LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE, SCHEDULER_NAME

FIXTURES = ("dgx-h100", "hgx-h200", "dgx-a100", "l40s-4")
TARGET_P99_MS = {("gputopo-8", 5000): 5.0}
TARGET_FLOOR_RATIO = 1.5
TARGET_DECISION_MS = 5.0
VERBS = ("filter", "prioritize")


def write_cluster(path: Path, n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    nodes: list[dict[str, Any]] = []
    for i in range(n):
        fixture = FIXTURES[i % len(FIXTURES)]
        gpus = 4 if fixture == "l40s-4" else 8
        spine, leaf = i // 256, i // 32
        node: dict[str, Any] = {
            "name": f"gpu-{i:05d}",
            "fixture": fixture,
            "labels": {LABEL_NETWORK_SPINE: f"spine-{spine}", LABEL_NETWORK_LEAF: f"leaf-{leaf}"},
        }
        r = rng.random()
        if r < 0.3:
            node["gpusInUse"] = sorted(rng.sample(range(gpus), rng.randint(1, gpus)))
        nodes.append(node)
    path.write_text(yaml.safe_dump({"nodes": nodes}, sort_keys=False))
    return [str(n["name"]) for n in nodes]


POD_UID = b"0b5e4a1c-bench"


def pod(gputopo: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "bench-0", "namespace": "default", "uid": POD_UID.decode()}
    if gputopo:
        meta["annotations"] = {"gputopo.io/nvlink": "required"}
    return {
        "metadata": meta,
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "containers": [
                {
                    "name": "train",
                    "image": "x",
                    "resources": {"limits": {GPU_RESOURCE: "8"}, "requests": {GPU_RESOURCE: "8"}},
                }
            ],
        },
        "status": {"phase": "Pending"},
    }


def go_json(value: Any) -> bytes:
    """JSON as kube-scheduler's Go encoder writes its requests: compact, fields in declaration order."""
    return json.dumps(value, separators=(",", ":")).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FloorDoor:
    """The floor's verbs: decode the request with orjson, answer the extender's own answer to it, encoded
    again. Served by the extender's verbs server (`gputopo.extender.http.verbserver`) as its door, worker-thread hop
    included; readyz on the loop, as the extender's."""

    max_request_bytes = 64 * 1024 * 1024

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self._pool = ThreadPoolExecutor(max_workers=4)

    @staticmethod
    def route(method: bytes, path: str) -> str | tuple[int, bytes]:
        return path[1:] if path[1:] in (*VERBS, "readyz") else (404, b"{}")

    @staticmethod
    def reads_body(verb: str) -> bool:
        return verb in VERBS

    def pool_for(self, verb: str) -> ThreadPoolExecutor | None:
        return self._pool if verb in VERBS else None

    def after(self, verb: str) -> None:
        pass

    def ready(self, verb: str, body: bytes) -> tuple[int, bytes] | None:
        return None

    def answer(self, verb: str, body: bytes) -> tuple[int, bytes]:
        if verb == "readyz":
            return 200, b"{}"
        args = orjson.loads(body)
        assert isinstance(args["NodeNames"], list)
        return 200, orjson.dumps(self.answers[verb])


def serve_floor(port: int, answers_file: Path) -> None:
    """The floor on the extender's own verbs server and loop, answering what `answers_file` holds."""
    from gputopo.extender.http.verbserver import VerbServer
    from gputopo.extender.main import _loop_factory

    server = VerbServer(FloorDoor(orjson.loads(answers_file.read_bytes())))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(server.serve([sock]))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(cmd: list[str], port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"{cmd[:4]} did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(
    url: str, bodies: tuple[bytes, bytes], requests: int, warmup: int, budget_s: float, pid: int
) -> tuple[list[float], float]:
    """Latency of each filter+prioritize pair (the two request bodies) in ms, and the server's CPU ms per pair.
    Each pair is for a new pod (its own UID), as kube-scheduler's cycles are: the filter decides afresh."""
    headers = {"Content-Type": "application/json"}
    out: list[float] = []
    with httpx.Client(base_url=url, headers=headers, timeout=10) as c:
        start = time.perf_counter()
        cpu0 = 0.0
        for i in range(warmup + requests):
            if i == warmup:
                cpu0 = cpu_seconds(pid)
            uid = b"%s-%05d" % (POD_UID.split(b"-")[0], i % 100_000)  # the same length as POD_UID
            filter_body, prioritize_body = (b.replace(POD_UID, uid, 1) for b in bodies)
            t0 = time.perf_counter()
            r1 = c.post("/filter", content=filter_body)
            r2 = c.post("/prioritize", content=prioritize_body)
            dt = time.perf_counter() - t0
            if r1.status_code != 200 or r2.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r1.status_code}/{r2.status_code}: {r1.text[:200]}")
            if i >= warmup:
                out.append(dt * 1000)
            if time.perf_counter() - start > budget_s and len(out) >= 20:
                break
        cpu = (cpu_seconds(pid) - cpu0) * 1000 / max(1, len(out))
    return out, cpu


def in_process_decision(path: Path, names: list[str], repeat: int) -> tuple[float, float]:
    """Median CPU ms of one 8-GPU decision in process (decode, filter, encode), a new pod each time:
    with the ledger's per-kind memo warm, and cleared before each decision (cold)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from gputopo.extender.app import create_listeners
    from gputopo.extender.settings import Settings

    door = create_listeners(Settings(snapshot=path, metrics_port=0)).door
    ledger = door.extender.ledger
    warm: list[float] = []
    cold: list[float] = []
    for i in range(2 * repeat + 2):
        p = pod(True)
        p["metadata"]["uid"] = f"pod-{i}"
        body = orjson.dumps({"Pod": p, "Nodes": None, "NodeNames": names})
        if i % 2:
            ledger._verdicts.clear()
        t0 = time.process_time()
        status, _ = door.answer("filter", body)
        assert status == 200
        dt = (time.process_time() - t0) * 1000
        if i >= 2:
            (cold if i % 2 else warm).append(dt)
    return statistics.median(warm), statistics.median(cold)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default="100,1000,5000")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--decisions", type=int, default=20, help="in-process decisions timed, warm and cold each")
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--answers", help=argparse.SUPPRESS)  # with --serve-floor: the answers to give
    args = p.parse_args(argv)
    if args.serve_floor:
        serve_floor(args.serve_floor, Path(args.answers))
        return 0

    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[tuple[int, str, list[float], list[float], float, float, int, int]] = []
    decision: tuple[float, float] | None = None
    with tempfile.TemporaryDirectory(prefix="gputopo-bench-") as tmp:
        for n in sizes:
            path = Path(tmp) / f"cluster-{n}.yaml"
            names = write_cluster(path, n)
            port = free_port()
            ext = start(
                [
                    sys.executable,
                    "-m",
                    "gputopo.extender.main",
                    "--snapshot",
                    str(path),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--metrics-port",
                    "0",
                ],
                port,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                for case, gputopo in (("gputopo-8", True), ("plain", False)):
                    the_pod = pod(gputopo)
                    body = go_json({"Pod": the_pod, "Nodes": None, "NodeNames": names})
                    # kube-scheduler asks prioritize about the nodes that passed every filter, ours included.
                    answers = {"filter": httpx.post(f"{url}/filter", content=body, timeout=30).content}
                    passed = orjson.loads(answers["filter"])["NodeNames"]
                    bodies = (body, go_json({"Pod": the_pod, "Nodes": None, "NodeNames": passed}))
                    # The floor answers what the extender answers, so both move the same bytes.
                    answers["prioritize"] = httpx.post(f"{url}/prioritize", content=bodies[1], timeout=30).content
                    answers_file = Path(tmp) / f"answers-{n}-{case}.json"
                    answers_file.write_bytes(
                        b'{"filter":%s,"prioritize":%s}' % (answers["filter"], answers["prioritize"])
                    )
                    floor_port = free_port()
                    floor = start(
                        [sys.executable, __file__, "--serve-floor", str(floor_port), "--answers", str(answers_file)],
                        floor_port,
                    )
                    try:
                        got, cpu = measure(url, bodies, args.requests, args.warmup, 30.0, ext.pid)
                        floor_url = f"http://127.0.0.1:{floor_port}"
                        base, base_cpu = measure(floor_url, bodies, args.requests, args.warmup, 30.0, floor.pid)
                    finally:
                        stop(floor)
                    sizes_out = sum(map(len, answers.values()))
                    rows.append((n, case, got, base, cpu, base_cpu, sum(map(len, bodies)), sizes_out))
            finally:
                stop(ext)
            if n == max(sizes):
                decision = in_process_decision(path, names, args.decisions)
    print(
        f"{'nodes':>6} {'case':<10} {'p50 ms':>7} {'p99 ms':>7} {'floor p50':>9} {'floor p99':>9} {'x floor':>7} "
        f"{'CPU ms':>7} {'floor CPU':>9} {'KB in':>6} {'KB out':>6}  target"
    )
    for n, case, got, base, cpu, base_cpu, b_in, b_out in rows:
        p99, f99 = pct(got, 99), pct(base, 99)
        verdict = ""
        target = TARGET_P99_MS.get((case, n))
        if target is not None:
            ok = p99 <= target and p99 / f99 <= TARGET_FLOOR_RATIO
            verdict = f"p99 <= {target:g} ms and <= {TARGET_FLOOR_RATIO:g}x floor: {'met' if ok else 'MISSED'}"
        print(
            f"{n:>6} {case:<10} {pct(got, 50):>7.2f} {p99:>7.2f} {pct(base, 50):>9.2f} {f99:>9.2f} "
            f"{p99 / f99:>7.2f} {cpu:>7.2f} {base_cpu:>9.2f} {b_in / 1024:>6.0f} {b_out / 1024:>6.0f}  {verdict}"
        )
    print(
        "(one sample = filter + prioritize for the same pod, sequential, keep-alive HTTP/1.1 on loopback; CPU ms:\n"
        " the server process's CPU per pair; KB in/out: request and answer bytes per pair)"
    )
    if decision is not None:
        warm, cold = decision
        verdict = "met" if warm <= TARGET_DECISION_MS else "MISSED"
        print(
            f"\none 8-GPU decision over {max(sizes)} nodes in process (decode + filter + encode, CPU): "
            f"warm memo {warm:.2f} ms, cold memo {cold:.2f} ms   target <= {TARGET_DECISION_MS:g} ms: {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
