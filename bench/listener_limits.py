"""What a client on the pod network can take from the extender through its listeners, on loopback.

Starts the real `gputopo-extender --snapshot` (100 nodes) in a subprocess with all three listeners (the
webhook over TLS with a throwaway certificate) and prints, per listener side by side:

- RSS growth from ten 10 MB request heads sent at once, one connection each: the peak while they
  arrive and what stays after (target: < 10 MiB);
- the verbs' filter latency p50/p99, alone and while 500 connections are held open on the metrics
  listener (each sent one request and idles, as a kept-alive client does); target: p99 unchanged
  within noise;
- floods on the webhook listener of a second extender with the default limits and an open-files limit
  of 4,096: 3,000 connections that send nothing and 1,500 that stop after their ClientHello, from one
  address (the extender's open files and whether a new verbs connection is answered at 1 / 5 / 15 / 30
  / 60 s, each flood connection's time to close, RSS at peak and once all are closed); the verbs'
  /healthz latency on a kept-alive connection idle and under 10 s of full handshakes from 4 threads
  (target: p99 within 1.5x); 300 TLS connections dripping a header line every 2 s, and whether a client
  from another address (127.0.0.2) is served meanwhile.

Counts and time are bounded (`--requests`, `--budget-s`, `--silent`, `--half`, `--flood-s`,
`--close-budget-s`, `--drip-budget-s`; every socket wait has a timeout); loopback only, and only the
processes it starts are stopped. The handshaking threads run at nice 19 (`--attacker-nice`): on
loopback the attacker's CPU is the extender's, which a remote attacker's is not. Nothing is asserted.
Run it against another checkout (`--root`) for the figures before a change:

    .venv/bin/python bench/listener_limits.py [--part all|heads|floods] [--requests 300] [--idle 500] [--root PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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


def start(
    cmd: list[str], env: dict[str, str], port: int, root: Path, preexec_fn: Callable[[], None] | None = None
) -> subprocess.Popen[bytes]:
    # In `root`: `python -m` puts the working directory first on sys.path.
    proc = subprocess.Popen(
        cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec_fn
    )
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


# ---------------------------------------------------------------------------------------------- floods

FLOOD_NOFILE = 4096  # the extender's open-files limit in the flood run: a flood must not reach it


def gone(conn: socket.socket) -> bool:
    """True once the server closed (or reset) `conn`; what it sent before is read and dropped."""
    try:
        while True:
            if not conn.recv(65536, socket.MSG_DONTWAIT):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def client_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # a throwaway certificate
    return context


def half_handshake(port: int, context: ssl.SSLContext, timeout: float) -> socket.socket:
    """A connection that sends its ClientHello and never answers the server's."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    conn.sendall(outgoing.read())
    return conn


def open_flood(port: int, silent: int, half: int, timeout: float) -> tuple[list[tuple[socket.socket, float]], int]:
    """`silent` connections that send nothing and `half` that stop after their ClientHello, from one
    address: (socket, opened at) each, and how many could not be opened."""
    held: list[tuple[socket.socket, float]] = []
    failed = 0
    context = client_context()  # one for all: making one per connection took longer than the flood
    for i in range(silent + half):
        try:
            if i < silent:
                conn = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            else:
                conn = half_handshake(port, context, timeout)
            conn.setblocking(False)  # `gone` polls it
            held.append((conn, time.monotonic()))
        except OSError:
            failed += 1
    return held, failed


class Probe:
    """/healthz on the verbs listener over one kept-alive connection (as kube-scheduler holds one), timed;
    a probe that fails opens a new connection for the next."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: socket.socket | None = None
        self.failures = 0

    def once(self) -> float | None:
        t0 = time.perf_counter()
        try:
            if self.conn is None:
                self.conn = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            self.conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = self.conn.recv(4096)
                if not chunk:
                    raise ConnectionResetError
                answer += chunk
            return (time.perf_counter() - t0) * 1000
        except OSError:
            self.failures += 1
            if self.conn is not None:
                self.conn.close()
            self.conn = None
            return None

    def run(self, seconds: float, every_s: float = 0.01) -> list[float]:
        out: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            took = self.once()
            if took is not None:
                out.append(took)
            time.sleep(every_s)
        return out

    def new_connection_answers(self) -> bool:
        """Whether a fresh connection to the verbs listener is answered within 2 s."""
        fresh = Probe(self.port)
        answered = fresh.once() is not None
        if fresh.conn is not None:
            fresh.conn.close()
        return answered


def handshakes(port: int, seconds: float, threads: int, nice: int) -> int:
    """Full TLS handshakes (each connection closed right after), from `threads` threads for `seconds`, each
    thread at `nice` (Linux: per thread)."""
    context = client_context()
    end = time.monotonic() + seconds

    def loop() -> int:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        done = 0
        while time.monotonic() < end:
            try:
                with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=2)):
                    done += 1  # wrap_socket handshakes
            except OSError:
                pass
        return done

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda _: loop(), range(threads)))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def drip(port: int, conns: int, newcomer: str, budget_s: float) -> tuple[int, str, float | None]:
    """`conns` TLS connections from 127.0.0.1 that each send a request head one header line every 2 s;
    meanwhile a client from `newcomer` asks the webhook for /healthz. Returns how many drips were
    accepted and got to send a line, the newcomer's answer, and when the last drip was cut (s after its
    first line; None: not within `budget_s`)."""
    context = client_context()
    dripping: list[ssl.SSLSocket] = []
    for _ in range(conns):
        with contextlib.suppress(OSError):
            conn = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5))
            conn.sendall(b"GET /healthz HTTP/1.1\r\n")
            dripping.append(conn)
    first = time.monotonic()
    answer = "no answer"
    try:
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(newcomer, 0))
        ) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = conn.recv(256).split(b"\r\n", 1)[0].decode("latin-1") or "closed"
    except (OSError, ssl.SSLError) as e:
        answer = type(e).__name__
    accepted = len(dripping)
    cut_at: float | None = None
    line = 0
    while dripping and time.monotonic() - first < budget_s:
        time.sleep(2)
        line += 1
        alive = []
        for conn in dripping:
            try:
                conn.sendall(b"X-Drip-%d: x\r\n" % line)
                conn.settimeout(0.001)
                with contextlib.suppress(TimeoutError, ssl.SSLWantReadError):
                    if conn.recv(256):  # an answer (408, 503): cut
                        conn.close()
                        continue
                alive.append(conn)
            except (OSError, ssl.SSLError):
                conn.close()
        if len(alive) < len(dripping) and not alive:
            cut_at = time.monotonic() - first
        dripping = alive
    for conn in dripping:
        conn.close()
    return accepted, answer, cut_at


def flood_run(a: argparse.Namespace, tmp: Path, crt: Path, key: Path) -> None:
    """The floods against an extender with its default limits and an open-files limit of FLOOD_NOFILE."""
    ports = {name: free_port() for name in LISTENERS}
    cmd = [sys.executable, "-m", "gputopo.extender.main", "--snapshot", str(tmp / "cluster.yaml")]
    cmd += ["--port", str(ports["verbs"]), "--metrics-host", "127.0.0.1", "--metrics-port", str(ports["metrics"])]
    cmd += ["--webhook-host", "127.0.0.1", "--webhook-port", str(ports["webhook"])]
    cmd += ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--log-level", "critical"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOPO_")}
    env["PYTHONPATH"] = str(a.root)

    def nofile() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD_NOFILE, FLOOD_NOFILE))

    proc = start(cmd, env, ports["verbs"], a.root, preexec_fn=nofile)
    held: list[tuple[socket.socket, float]] = []
    try:
        probe = Probe(ports["verbs"])
        probe.run(1.0)  # warm-up
        rss0 = rss_mib(proc.pid)
        idle = probe.run(a.flood_s)
        with ThreadPoolExecutor(1) as pool:  # full handshakes alone: the CPU they cost the verbs
            shaken = pool.submit(handshakes, ports["webhook"], a.flood_s, a.flood_threads, a.attacker_nice)
            flooded = probe.run(a.flood_s)
            done = shaken.result()
        held, failed = open_flood(ports["webhook"], a.silent, a.half, 2.0)
        opened = time.monotonic()
        # The server's open files at these seconds after the flood was opened (its connections held), the
        # peak RSS, and the time to close of every flood connection, bounded by --close-budget-s.
        marks = [m for m in (1.0, 5.0, 15.0, 30.0, 60.0) if m < a.close_budget_s]
        held_fds: dict[float, int] = {}
        verbs_at: dict[float, bool] = {}  # whether a new connection to the verbs was answered then
        peak_rss = rss_mib(proc.pid)
        closed_after: list[float] = []
        open_ = list(held)
        while open_ and time.monotonic() - held[0][1] < a.close_budget_s:
            since = time.monotonic() - opened
            for m in marks:
                if m not in held_fds and since >= m:
                    held_fds[m] = fds(proc.pid)
                    verbs_at[m] = probe.new_connection_answers()
            peak_rss = max(peak_rss, rss_mib(proc.pid))
            still = []
            for conn, at in open_:
                if gone(conn):
                    closed_after.append(time.monotonic() - at)
                    conn.close()
                else:
                    still.append((conn, at))
            open_ = still
            time.sleep(0.25)
        for conn, _ in open_:
            conn.close()
        held = []
        time.sleep(2.0)
        rss_after = rss_mib(proc.pid)
        fds_after = fds(proc.pid)
        accepted, newcomer, cut_at = drip(ports["webhook"], a.drip, "127.0.0.2", a.drip_budget_s)
        rss_end = rss_mib(proc.pid)
    finally:
        for conn, _ in held:
            conn.close()
        stop(proc)

    total = a.silent + a.half
    print(f"\nfloods on the webhook listener (defaults, open-files limit {FLOOD_NOFILE}), RSS at start {rss0:.0f} MiB")
    print(f"  {a.silent} silent + {a.half} half-handshake connections from one address: {failed} not opened")
    print("  server's open files after: " + ", ".join(f"{m:g} s {n}" for m, n in held_fds.items()))
    answered = ", ".join(f"{m:g} s {'yes' if ok else 'NO'}" for m, ok in verbs_at.items())
    print(f"  a new connection to the verbs answered (within 2 s) after: {answered}")
    closes = sorted(closed_after)
    if closes:
        print(
            f"  time to close, s: median {statistics.median(closes):.1f}, max {closes[-1]:.1f}; "
            f"{total - failed - len(closes)} still open after {a.close_budget_s:.0f} s"
        )
    print(f"  RSS peak {peak_rss:.0f} MiB, {rss_after:.0f} MiB once all closed (fds {fds_after})")
    print(f"\nverbs /healthz on a kept-alive connection, ms ({len(idle)} / {len(flooded)} calls)")
    print(f"{'':<34}{'p50':>8}{'p99':>8}")
    print(f"{'idle':<34}{statistics.median(idle):>8.2f}{pct(idle, 99):>8.2f}")
    if flooded:
        label = f"{done} handshakes on the webhook"
        print(f"{label:<34}{statistics.median(flooded):>8.2f}{pct(flooded, 99):>8.2f}")
        print(f"  p99 ratio {pct(flooded, 99) / pct(idle, 99):.2f}x; failed probes {probe.failures}")
    else:
        print(f"  no verbs answer during the flood; failed probes {probe.failures}")
    cut = f"{cut_at:.0f} s after its first line" if cut_at is not None else f"not within {a.drip_budget_s:.0f} s"
    print(f"\ndrip: {accepted} of {a.drip} TLS connections from 127.0.0.1 dripping a header line every 2 s")
    print(f"  a client from 127.0.0.2 meanwhile: {newcomer}; the last drip cut {cut}; RSS {rss_end:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=300, help="filter calls per latency run")
    p.add_argument("--idle", type=int, default=500, help="connections held open on the metrics listener")
    p.add_argument("--budget-s", type=float, default=30.0, help="time bound of each latency run")
    p.add_argument("--timeout-s", type=float, default=20.0, help="bound of every socket wait")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to run")
    p.add_argument("--part", choices=("all", "heads", "floods"), default="all", help="which measurements")
    p.add_argument("--silent", type=int, default=3000, help="flood: connections that send nothing")
    p.add_argument("--half", type=int, default=1500, help="flood: connections that stop after their ClientHello")
    p.add_argument("--flood-s", type=float, default=10.0, help="flood: seconds of full handshakes")
    p.add_argument("--flood-threads", type=int, default=4, help="flood: threads making full handshakes")
    p.add_argument(
        "--attacker-nice",
        type=int,
        default=19,
        help="flood: nice value of the handshaking threads; on loopback the attacker's CPU is the extender's, "
        "which a remote attacker's is not",
    )
    p.add_argument("--close-budget-s", type=float, default=75.0, help="flood: how long to wait for the closes")
    p.add_argument("--drip", type=int, default=300, help="drip: TLS connections dripping a head")
    p.add_argument("--drip-budget-s", type=float, default=24.0, help="drip: how long to keep dripping")
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        names = write_cluster(tmp / "cluster.yaml", 100)
        crt, key = certificate(tmp)
        print(f"checkout: {a.root}")
        if a.part in ("all", "floods"):
            flood_run(a, tmp, crt, key)
        if a.part == "floods":
            return 0
        ports = {name: free_port() for name in LISTENERS}
        cmd = [sys.executable, "-m", "gputopo.extender.main", "--snapshot", str(tmp / "cluster.yaml")]
        cmd += ["--port", str(ports["verbs"]), "--metrics-host", "127.0.0.1", "--metrics-port", str(ports["metrics"])]
        cmd += ["--webhook-host", "127.0.0.1", "--webhook-port", str(ports["webhook"])]
        cmd += ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--log-level", "error"]
        # Room for every held connection (an older checkout ignores the variable).
        room = str(a.idle + 16)
        env = {**os.environ, "PYTHONPATH": str(a.root), "GPUTOPO_MAX_CONNECTIONS": room}
        env["GPUTOPO_MAX_CONNECTIONS_PER_PEER"] = room  # all from one address here
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

    print(f"\nextender RSS at start {rss0:.0f} MiB")
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
