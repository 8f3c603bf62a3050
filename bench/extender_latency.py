"""Extender latency over HTTP on loopback: filter+prioritize in snapshot mode, against a bare floor.

For 100, 1,000 and 5,000 nodes this writes a cluster file (a mix of dgx-h100, hgx-h200, dgx-a100 and
l40s-4 nodes under leaf/spine labels, some GPUs in use), starts the real `gputopo-extender --snapshot`
with uvicorn in a subprocess, and a bare FastAPI app that parses the same payload and answers (the
floor: HTTP + JSON cost only), side by side. It then sends filter followed by prioritize
(`NodeNames` = all nodes, Go-cased, `Nodes: null`) for an 8-GPU gputopo pod and for a plain pod, and
prints p50/p99 of the pair per case and the ratio to the floor. Targets are printed, not asserted:
5,000 nodes, 8-GPU pod p99 <= 15 ms; plain pod p99 <= 2 ms.

    .venv/bin/python bench/extender_latency.py [--sizes 100,1000,5000] [--requests 200]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from fastapi import FastAPI, Request, Response
from pydantic_core import from_json, to_json

from gputopo.model import GPU_RESOURCE, LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE, SCHEDULER_NAME

FIXTURES = ("dgx-h100", "hgx-h200", "dgx-a100", "l40s-4")
TARGETS = {("gputopo-8", 5000): 15.0, ("plain", 5000): 2.0}


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


def pod(gputopo: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "bench-0", "namespace": "default", "uid": "0b5e4a1c-bench"}
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_floor(port: int) -> None:
    """The floor: a bare FastAPI app that parses the payload and answers, nothing else."""
    import uvicorn

    app = FastAPI()

    @app.post("/filter")
    async def filter_(request: Request) -> Response:
        args = from_json(await request.body())
        body = {"NodeNames": args["NodeNames"], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""}
        return Response(to_json(body), media_type="application/json")

    @app.post("/prioritize")
    async def prioritize(request: Request) -> Response:
        args = from_json(await request.body())
        return Response(to_json([{"Host": n, "Score": 5} for n in args["NodeNames"]]), media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(b"{}", media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


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


def measure(url: str, body: bytes, requests: int, warmup: int, budget_s: float) -> list[float]:
    headers = {"Content-Type": "application/json"}
    out: list[float] = []
    with httpx.Client(base_url=url, headers=headers, timeout=10) as c:
        for i in range(warmup + requests):
            t0 = time.perf_counter()
            r1 = c.post("/filter", content=body)
            r2 = c.post("/prioritize", content=body)
            dt = time.perf_counter() - t0
            if r1.status_code != 200 or r2.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r1.status_code}/{r2.status_code}: {r1.text[:200]}")
            if i >= warmup:
                out.append(dt * 1000)
            if time.perf_counter() - t0 > budget_s:
                break
    return out


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default="100,1000,5000")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_floor:
        serve_floor(args.serve_floor)
        return 0
    import json

    sizes = [int(s) for s in args.sizes.split(",")]
    floor_port = free_port()
    floor = start([sys.executable, __file__, "--serve-floor", str(floor_port)], floor_port)
    rows: list[tuple[int, str, float, float, float, float]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gputopo-bench-") as tmp:
            for n in sizes:
                path = Path(tmp) / f"cluster-{n}.yaml"
                names = write_cluster(path, n)
                port = free_port()
                ext = start(
                    [
                        sys.executable,
                        "-m",
                        "extender.main",
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
                try:
                    for case, gputopo in (("gputopo-8", True), ("plain", False)):
                        body = json.dumps({"Pod": pod(gputopo), "Nodes": None, "NodeNames": names}).encode()
                        got = measure(f"http://127.0.0.1:{port}", body, args.requests, args.warmup, 30.0)
                        base = measure(f"http://127.0.0.1:{floor_port}", body, args.requests, args.warmup, 30.0)
                        rows.append((n, case, pct(got, 50), pct(got, 99), pct(base, 50), pct(base, 99)))
                finally:
                    stop(ext)
    finally:
        stop(floor)
    print(
        f"{'nodes':>6} {'case':<10} {'p50 ms':>8} {'p99 ms':>8} {'floor p50':>10} {'floor p99':>10} "
        f"{'x floor p99':>11}  target"
    )
    for n, case, p50, p99, f50, f99 in rows:
        target = TARGETS.get((case, n))
        verdict = "" if target is None else f"p99 <= {target:g} ms: {'met' if p99 <= target else 'MISSED'}"
        print(f"{n:>6} {case:<10} {p50:>8.2f} {p99:>8.2f} {f50:>10.2f} {f99:>10.2f} {p99 / f99:>11.2f}  {verdict}")
    print("(one sample = filter + prioritize for the same pod, sequential, keep-alive HTTP/1.1 on loopback)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
