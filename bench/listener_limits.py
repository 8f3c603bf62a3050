"""What a client on the pod network can take from the extender through its listeners, on loopback.

Starts the real `gputopo-extender --snapshot` (100 nodes) in a subprocess with all three listeners (the
webhook over TLS with a throwaway certificate) and prints, per listener side by side:

- RSS growth from ten 10 MB request heads sent at once, one connection each: the peak while they
  arrive and what stays after (target: < 10 MiB);
- the verbs' filter latency p50/p99, alone and while 500 connections are held open on the metrics
  listener (each sent one request and idles, as a kept-alive client does); target: p99 unchanged
  within noise.

Counts and time are bounded (`--requests`, `--budget-s`; every socket wait has a timeout). Nothing is
asserted. Run it against another checkout (`--root`) for the figures before a change:

    .venv/bin/python bench/listener_limits.py [--requests 300] [--idle 500] [--root PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# Beside this script: bench/ is no package, and running a script puts its own folder on sys.path.
from extender_latency import free_port, go_json, pct, pod, stop, write_cluster

MIB = 1024 * 1024
HEAD_BYTES = 10 * MIB
HEADS = 10
TARGET_GROWTH_MIB = 10.0
LISTENERS = ("verbs", "webhook", "metrics")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def certificate(tmp: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise SystemExit("openssl not found: the webhook listener needs a certificate")
    key, crt = tmp / "tls.key", tmp / "tls.crt"
    args = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    args += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)]
    subprocess.run(
        [openssl, *args],
        check=True,
        capture_output=True,
    )
    return crt, key


def connect(port: int, tls: bool, timeout: float) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # a throwaway certificate
        conn = context.wrap_socket(conn, server_hostname="127.0.0.1")
    return conn


def big_head(port: int, tls: bool, timeout: float) -> str:
    """Send one 10 MB head; the status line answered, or what ended the exchange."""
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * HEAD_BYTES + b"\r\n\r\n"
    try:
        with connect(port, tls, timeout) as conn:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
                conn.sendall(head)
            answer = conn.recv(256)
            return answer.split(b"\r\n", 1)[0].decode("latin-1") or "closed"
    except (TimeoutError, OSError, ssl.SSLError) as e:
        return type(e).__name__


def heads_growth(pid: int, ports: dict[str, int], timeout: float) -> dict[str, tuple[float, float, str]]:
    """Per listener, ten 10 MB heads sent at once: the peak RSS growth during them (sampled every 10 ms),
    the growth once they are done (MiB), and the first answer seen."""
    out: dict[str, tuple[float, float, str]] = {}
    for name in LISTENERS:
        before = peak = rss_mib(pid)
        with ThreadPoolExecutor(HEADS) as pool:
            sent = [pool.submit(big_head, ports[name], name == "webhook", timeout) for _ in range(HEADS)]
            while not all(f.done() for f in sent):
                peak = max(peak, rss_mib(pid))
                time.sleep(0.01)
            answers = [f.result() for f in sent]
        time.sleep(0.5)  # let the server finish with the last connection before reading its RSS
        out[name] = (peak - before, rss_mib(pid) - before, answers[0])
    return out


def filter_latency(port: int, body: bytes, requests: int, budget_s: float) -> list[float]:
    out: list[float] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        for _ in range(10):  # warm-up
            c.post("/filter", content=body)
        start = time.perf_counter()
        for _ in range(requests):
            t0 = time.perf_counter()
            r = c.post("/filter", content=body)
            out.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200:
                raise RuntimeError(f"filter: HTTP {r.status_code}: {r.text[:200]}")
            if time.perf_counter() - start > budget_s:
                break
    return out


def hold_idle(port: int, count: int, timeout: float) -> tuple[list[socket.socket], int]:
    """`count` connections that each sent /healthz and read its answer; how many were answered 200."""
    held, ok = [], 0
    for _ in range(count):
        try:
            conn = connect(port, False, timeout)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            ok += conn.recv(4096).startswith(b"HTTP/1.1 200")
            held.append(conn)
        except OSError:
            break
    return held, ok


def start(cmd: list[str], env: dict[str, str], port: int, root: Path) -> subprocess.Popen[bytes]:
    # In `root`: `python -m` puts the working directory first on sys.path.
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the extender exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError("the extender did not become ready")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=300, help="filter calls per latency run")
    p.add_argument("--idle", type=int, default=500, help="connections held open on the metrics listener")
    p.add_argument("--budget-s", type=float, default=30.0, help="time bound of each latency run")
    p.add_argument("--timeout-s", type=float, default=20.0, help="bound of every socket wait")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to run")
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        names = write_cluster(tmp / "cluster.yaml", 100)
        crt, key = certificate(tmp)
        ports = {name: free_port() for name in LISTENERS}
        cmd = [sys.executable, "-m", "extender.main", "--snapshot", str(tmp / "cluster.yaml")]
        cmd += ["--port", str(ports["verbs"]), "--metrics-host", "127.0.0.1", "--metrics-port", str(ports["metrics"])]
        cmd += ["--webhook-host", "127.0.0.1", "--webhook-port", str(ports["webhook"])]
        cmd += ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--log-level", "error"]
        # Room for every held connection (an older checkout ignores the variable).
        env = {**os.environ, "PYTHONPATH": str(a.root), "GPUTOPO_MAX_CONNECTIONS": str(a.idle + 16)}
        proc = start(cmd, env, ports["verbs"], a.root)
        held: list[socket.socket] = []
        try:
            body = go_json({"Pod": pod(True), "Nodes": None, "NodeNames": names})
            rss0 = rss_mib(proc.pid)
            alone = filter_latency(ports["verbs"], body, a.requests, a.budget_s)
            held, ok = hold_idle(ports["metrics"], a.idle, a.timeout_s)
            busy = filter_latency(ports["verbs"], body, a.requests, a.budget_s)
            for conn in held:
                conn.close()
            held = []
            again = filter_latency(ports["verbs"], body, a.requests, a.budget_s)  # the noise between runs
            growth = heads_growth(proc.pid, ports, a.timeout_s)
            verbs_alive = filter_latency(ports["verbs"], body, 10, a.budget_s)
        finally:
            for conn in held:
                conn.close()
            stop(proc)

    print(f"checkout: {a.root}  (extender RSS at start {rss0:.0f} MiB)")
    print(
        f"\nRSS growth from {HEADS} heads of {HEAD_BYTES // MIB} MB sent at once (target < {TARGET_GROWTH_MIB:g} MiB)"
    )
    print(f"{'listener':<10}{'peak MiB':>10}{'after MiB':>11}  first answer")
    for name in LISTENERS:
        peak, after, answer = growth[name]
        print(f"{name:<10}{peak:>10.1f}{after:>11.1f}  {answer}")
    print(f"\nverbs filter latency, 100 nodes, ms ({len(alone)} / {len(busy)} calls)")
    print(f"{'':<34}{'p50':>8}{'p99':>8}")
    print(f"{'alone':<34}{statistics.median(alone):>8.2f}{pct(alone, 99):>8.2f}")
    label = f"{ok} of {a.idle} held on metrics"
    print(f"{label:<34}{statistics.median(busy):>8.2f}{pct(busy, 99):>8.2f}")
    print(f"{'alone again':<34}{statistics.median(again):>8.2f}{pct(again, 99):>8.2f}")
    print(
        f"\nverbs still answer after the heads: {len(verbs_alive)} calls, p50 {statistics.median(verbs_alive):.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
