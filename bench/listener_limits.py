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

- `--part hostile` (docs/benchmarks.md, "Hostile callers on the listeners"), against an extender with client
  auth on the webhook, one process per measurement: RSS before, at peak and once closed while `--bodies`
  (256) connections from 4 addresses post the largest body each to metrics /healthz, then to the webhook's
  /mutate without a certificate; probes from another address (fresh connection, 3 s) while
  `--flood-addresses` (8) addresses hold 64 silent connections each; metrics /healthz and the API server's
  review (its certificate, kept alive) timed while `--forgers` (48) callers without one post 6 MiB reviews
  from a process of their own.

- `--part agent` (docs/benchmarks.md, "Hostile callers on the listeners"): the agent's /metrics listener
  (`serve_metrics`, its default caps) in a subprocess; `--flood-addresses` (8) addresses each keep up to 64
  silent connections open (re-opened every 0.1 s as they are closed) while `--probes` (10) scrapes come from
  another address (fresh connection, 3 s).

Counts and time are bounded (`--requests`, `--budget-s`, `--silent`, `--half`, `--flood-s`,
`--close-budget-s`, `--drip-budget-s`; every socket wait has a timeout); loopback only, and only the
processes it starts are stopped. The handshaking threads run at nice 19 (`--attacker-nice`): on
loopback the attacker's CPU is the extender's, which a remote attacker's is not. Nothing is asserted.
Run it against another checkout (`--root`) for the figures before a change:

    .venv/bin/python bench/listener_limits.py [--part all|heads|floods|hostile|agent] [--requests 300] [--root PATH]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
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
from typing import Any

import httpx
import orjson

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


# ---------------------------------------------------------------------------------------------- hostile callers


def client_certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A client CA and the API server's client certificate it signed: (CA, certificate, key)."""
    openssl = shutil.which("openssl")
    assert openssl is not None  # `certificate` checked
    ca, ca_key, crt, key, csr = (tmp / n for n in ("cca.crt", "cca.key", "api.crt", "api.key", "api.csr"))
    steps = [
        f"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=client-ca -keyout {ca_key} -out {ca}",
        f"req -newkey rsa:2048 -nodes -subj /CN={API_SERVER} -keyout {key} -out {csr}",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -days 1 -out {crt}",
    ]
    for step in steps:
        subprocess.run([openssl, *step.split()], check=True, capture_output=True)
    return ca, crt, key


API_SERVER = "kube-apiserver-webhook-client"
ATTACKER_NICE = 19


def source_addresses(count: int) -> list[str]:
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(count)]


def post_body(port: int, tls: ssl.SSLContext | None, source: str, path: str, size: int, timeout: float) -> str:
    """One POST declaring `size` bytes and sending them all (as long as the server reads): the status line
    answered, or what ended the exchange (where: connect, send or answer)."""
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (path.encode(), size)
    piece = b"{" * (1024 * 1024)
    stage = "connect"
    with contextlib.suppress(AttributeError, OSError):  # the attacker's CPU is not the extender's (see --attacker-nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ATTACKER_NICE)
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
        with tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw as conn:
            stage = "send"
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
                conn.sendall(head)
                for _ in range(size // len(piece)):
                    conn.sendall(piece)
            stage = "answer"
            answer = conn.recv(256)
            return answer.split(b"\r\n", 1)[0].decode("latin-1") or f"closed at {stage}"
    except (TimeoutError, OSError, ssl.SSLError) as e:
        return f"{type(e).__name__} at {stage}"


def bodies_run(pid: int, ports: dict[str, int], a: argparse.Namespace, tls: ssl.SSLContext) -> None:
    """`--bodies` connections at once, from 4 addresses, each sending a body of --max-request-bytes: to the
    metrics listener's /healthz, then to the webhook's /mutate without a client certificate."""
    print(f"\n{a.bodies} connections at once from 4 addresses, each sending {a.body_mib} MiB (the largest allowed)")
    print(f"{'target':<30}{'RSS before':>11}{'peak':>8}{'after close':>13}  answers")
    sources = source_addresses(4)
    for name, path, context in (("metrics", "/healthz", None), ("webhook", "/mutate", tls)):
        time.sleep(1.0)
        before = peak = rss_mib(pid)
        fds_before = fds(pid)
        with ThreadPoolExecutor(a.bodies) as pool:
            sent = [
                pool.submit(post_body, ports[name], context, sources[i % 4], path, a.body_mib * MIB, a.timeout_s)
                for i in range(a.bodies)
            ]
            while not all(f.done() for f in sent):
                peak = max(peak, rss_mib(pid))
                time.sleep(0.05)
            answers = collections.Counter(f.result() for f in sent)
        # What stays once the server has closed them all (each within the read timeout), fds back to before.
        settle = time.monotonic() + a.timeout_s
        while fds(pid) > fds_before and time.monotonic() < settle:
            time.sleep(0.25)
        time.sleep(2.0)
        after = rss_mib(pid)
        said = ", ".join(f"{n} x {s}" for s, n in answers.most_common(3))
        print(f"{name + ' ' + path:<30}{before:>11.0f}{peak:>8.0f}{after:>13.0f}  {said}; fds {fds(pid)}")


def probe_once(port: int, tls: ssl.SSLContext | None, source: str, timeout: float = 3.0) -> bool:
    """The kubelet's probe: a fresh connection, GET /healthz, its 3 s timeout."""
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
        with tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return conn.recv(256).startswith(b"HTTP/1.1 200")
    except (OSError, ssl.SSLError):
        return False


def probes_run(ports: dict[str, int], a: argparse.Namespace, tls: ssl.SSLContext) -> None:
    """`--flood-addresses` addresses each opening their share of silent connections (64 by default, past
    the listener's 256), then probes from another address."""
    print(f"\nprobes from another address while {a.flood_addresses} addresses hold silent connections (64 each)")
    for name, context in (("metrics", None), ("webhook", tls)):
        held: list[socket.socket] = []
        for source in source_addresses(a.flood_addresses):
            for _ in range(64):
                try:
                    raw = socket.create_connection(("127.0.0.1", ports[name]), timeout=2, source_address=(source, 0))
                    held.append(raw)
                except OSError:
                    break
        time.sleep(0.5)
        ok = sum(probe_once(ports[name], context, "127.1.0.1") for _ in range(a.probes))
        for conn in held:
            conn.close()
        print(f"  {name}: {ok} of {a.probes} probes answered (within 3 s), {len(held)} flood connections opened")
        time.sleep(1.0)


def timed_get(port: int, path: str = "/healthz", timeout: float = 10.0) -> float | None:
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=("127.1.0.2", 0)) as c:
            c.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
            if not c.recv(256).startswith(b"HTTP/1.1 200"):
                return None
    except OSError:
        return None
    return (time.perf_counter() - t0) * 1000


class HonestReviews:
    """The API server's reviews on one kept-alive TLS connection with its client certificate (Go's client
    keeps it), a new one only when the server closed it; each review timed."""

    def __init__(self, port: int, context: ssl.SSLContext, body: bytes) -> None:
        self.port, self.context = port, context
        self.request = b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        self.conn: ssl.SSLSocket | None = None

    def once(self) -> tuple[float, str]:
        t0 = time.perf_counter()
        try:
            if self.conn is None:
                raw = socket.create_connection(("127.0.0.1", self.port), timeout=15, source_address=("127.1.0.3", 0))
                self.conn = self.context.wrap_socket(raw, server_hostname="127.0.0.1")
            self.conn.sendall(self.request)
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = self.conn.recv(65536)
                if not chunk:
                    raise ConnectionResetError
                answer += chunk
            head, _, rest = answer.partition(b"\r\n\r\n")
            size = int(
                next(
                    v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
                )
            )
            while len(rest) < size:
                rest += self.conn.recv(65536)
            status = head.split(b"\r\n", 1)[0].decode("latin-1").removeprefix("HTTP/1.1 ")
        except (OSError, ssl.SSLError, StopIteration) as e:
            status = type(e).__name__
            if self.conn is not None:
                self.conn.close()
            self.conn = None
        return (time.perf_counter() - t0) * 1000, status


def forge(port: int, sources: list[str], seconds: float, count: Any) -> None:
    """Callers without a client certificate, one thread per address, each posting 6 MiB reviews on new
    TLS connections for `seconds`; how many were sent goes to `count`."""
    big = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"f","x":"'
    big += b"a" * (6 * MIB) + b'"}}'
    head = b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(big)
    context = client_context()
    end = time.monotonic() + seconds

    def forger(source: str) -> int:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ATTACKER_NICE)
        sent = 0
        while time.monotonic() < end:
            with contextlib.suppress(OSError, ssl.SSLError):
                raw = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                    with contextlib.suppress(OSError, ssl.SSLError):
                        conn.sendall(head + big)
                    conn.recv(256)
                    sent += 1
        return sent

    with ThreadPoolExecutor(len(sources)) as pool:
        count.value = sum(pool.map(forger, sources))


def review_flood_run(ports: dict[str, int], a: argparse.Namespace, api: ssl.SSLContext) -> None:
    """`--forgers` callers without a client certificate posting 6 MiB reviews for --review-flood-s, from as
    many addresses; meanwhile metrics /healthz and an honest review (the API server's certificate) are timed."""
    honest = orjson.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
         "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE",
                     "object": {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": []}}}}
    )  # fmt: skip
    end = time.monotonic() + a.review_flood_s
    # The forgers in a process of their own: threads of this one would make the timed calls wait for its GIL.
    forged_count = multiprocessing.get_context("fork").Value("i", 0)
    forging = multiprocessing.get_context("fork").Process(
        target=forge, args=(ports["webhook"], source_addresses(a.forgers), a.review_flood_s, forged_count)
    )
    idle_probe = [t for t in (timed_get(ports["metrics"]) for _ in range(20)) if t is not None]
    apiserver = HonestReviews(ports["webhook"], api, honest)
    idle_review = [apiserver.once() for _ in range(20)]
    probe_ms: list[float] = []
    failed_probes = 0
    reviews: list[tuple[float, str]] = []

    def review_loop() -> None:
        while time.monotonic() < end:
            reviews.append(apiserver.once())
            time.sleep(0.1)

    forging.start()
    with ThreadPoolExecutor(1) as pool:
        time.sleep(1.0)
        reviewing = pool.submit(review_loop)
        while time.monotonic() < end:
            t = timed_get(ports["metrics"], timeout=3.0)
            if t is None:
                failed_probes += 1
            else:
                probe_ms.append(t)
            time.sleep(0.1)
        reviewing.result()
    forging.join(a.review_flood_s + 30)
    forgeries = forged_count.value
    print(f"\n{a.forgers} callers without a client certificate posting 6 MiB reviews for {a.review_flood_s:g} s")
    print(f"  forged reviews sent: {forgeries}")
    print(f"{'':<52}{'p50 ms':>9}{'p99 ms':>9}  answers")
    print(f"{'metrics /healthz, idle':<52}{statistics.median(idle_probe):>9.1f}{pct(idle_probe, 99):>9.1f}")
    if probe_ms:
        print(
            f"{'metrics /healthz, under the flood':<52}{statistics.median(probe_ms):>9.1f}{pct(probe_ms, 99):>9.1f}"
            f"  {len(probe_ms)} answered, {failed_probes} not within 3 s"
        )
    else:
        print(f"  metrics /healthz under the flood: none answered within 3 s ({failed_probes})")
    for label, runs in (
        ("honest review (API server's cert, kept-alive), idle", idle_review),
        ("honest review, under the flood", reviews),
    ):
        times = [t for t, _ in runs]
        said = collections.Counter(s for _, s in runs)
        print(f"{label:<52}{statistics.median(times):>9.1f}{pct(times, 99):>9.1f}  {dict(said)}")


def hostile_run(a: argparse.Namespace, tmp: Path, crt: Path, key: Path) -> None:
    """The extender with its defaults and client auth on the webhook: bodies, many-address floods, forged
    reviews (one process each, so one measurement's memory does not carry into the next)."""
    client_ca, api_crt, api_key = client_certs(tmp)
    forged = client_context()
    api = client_context()
    api.load_cert_chain(str(api_crt), str(api_key))
    for part in a.hostile.split(","):
        ports = {name: free_port() for name in LISTENERS}
        cmd = [sys.executable, "-m", "gputopo.extender.main", "--snapshot", str(tmp / "cluster.yaml")]
        cmd += ["--port", str(ports["verbs"]), "--metrics-host", "127.0.0.1", "--metrics-port", str(ports["metrics"])]
        cmd += ["--webhook-host", "127.0.0.1", "--webhook-port", str(ports["webhook"])]
        cmd += ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--log-level", "critical"]
        cmd += ["--webhook-client-ca-file", str(client_ca), "--webhook-client-names", API_SERVER]
        if a.handshakes_per_second is not None:  # else the checkout's default (an older one has no such flag)
            cmd += ["--handshakes-per-second", str(a.handshakes_per_second)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOPO_")}
        env["PYTHONPATH"] = str(a.root)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = start(cmd, env, ports["verbs"], a.root)
        try:
            if part == "bodies":
                bodies_run(proc.pid, ports, a, forged)
            elif part == "probes":
                probes_run(ports, a, forged)
            elif part == "reviews":
                review_flood_run(ports, a, api)
        finally:
            stop(proc)


# ---------------------------------------------------------------------------------------------- the agent's /metrics

AGENT_METRICS = """
import signal, sys
from prometheus_client import CollectorRegistry, Counter
from gputopo.agent.metricsserver import serve_metrics
registry = CollectorRegistry()
Counter("gputopo_agent_bench", "a metric to scrape", registry=registry).inc()
serve_metrics(int(sys.argv[1]), registry, host="127.0.0.1")
signal.sigwait({signal.SIGTERM, signal.SIGINT})
"""


def scrape_once(port: int, source: str, timeout: float = 3.0) -> bool:
    """Prometheus' scrape: a fresh connection, GET /metrics, 3 s; answered 200 with the metric."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
            return answer.startswith(b"HTTP/1.0 200") and b"gputopo_agent_bench_total" in answer
    except OSError:
        return False


def keep_silent(port: int, source: str, per_source: int, full: threading.Event, done: threading.Event) -> int:
    """`source` keeps up to `per_source` silent connections open, re-opening those the server closed every
    0.1 s, until `done` (`full` once it has tried them all); how many it opened."""
    held: list[socket.socket] = []
    opened = 0
    while not done.is_set():
        alive = [c for c in held if not gone(c)]
        for c in set(held) - set(alive):
            c.close()
        for _ in range(per_source - len(alive)):
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
            except OSError:
                break
            conn.setblocking(False)
            alive.append(conn)
            opened += 1
        held = alive
        full.set()
        done.wait(0.1)
    for c in held:
        c.close()
    return opened


def agent_run(a: argparse.Namespace) -> None:
    """The agent's /metrics listener under `--flood-addresses` addresses holding silent connections."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(a.root), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT_METRICS, str(port)], env=env, cwd=a.root, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not scrape_once(port, "127.1.0.1"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the agent's /metrics listener did not start")
            time.sleep(0.1)
        idle = sum(scrape_once(port, "127.1.0.1") for _ in range(a.probes))
        sources = source_addresses(a.flood_addresses)
        full = [threading.Event() for _ in sources]
        done = threading.Event()
        with ThreadPoolExecutor(len(sources)) as pool:  # a thread per address: the flood outpaces the timeout
            flooding = [pool.submit(keep_silent, port, s, 64, f, done) for s, f in zip(sources, full, strict=True)]
            for f in full:
                f.wait(a.timeout_s)
            answered = 0
            for _ in range(a.probes):
                answered += scrape_once(port, "127.1.0.1")
                time.sleep(0.2)
            done.set()
            opened = sum(f.result() for f in flooding)
    finally:
        stop(proc)
    print("\nthe agent's /metrics: scrapes from another address (fresh connection, 3 s)")
    print(f"  idle: {idle} of {a.probes} answered")
    print(
        f"  while {a.flood_addresses} addresses keep up to 64 silent connections each open: {answered} of "
        f"{a.probes} answered ({opened} flood connections opened)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=300, help="filter calls per latency run")
    p.add_argument("--idle", type=int, default=500, help="connections held open on the metrics listener")
    p.add_argument("--budget-s", type=float, default=30.0, help="time bound of each latency run")
    p.add_argument("--timeout-s", type=float, default=20.0, help="bound of every socket wait")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to run")
    p.add_argument(
        "--part", choices=("all", "heads", "floods", "hostile", "agent"), default="all", help="which measurements"
    )
    p.add_argument("--hostile", default="bodies,probes,reviews", help="hostile: which of bodies, probes, reviews")
    p.add_argument("--bodies", type=int, default=256, help="hostile: connections sending the largest body at once")
    p.add_argument(
        "--body-mib", type=int, default=8, help="hostile: each body's size (the default --max-request-bytes)"
    )
    p.add_argument("--flood-addresses", type=int, default=8, help="hostile: addresses holding 64 silent connections")
    p.add_argument("--probes", type=int, default=10, help="hostile: probes from another address")
    p.add_argument("--forgers", type=int, default=48, help="hostile: callers posting forged 6 MiB reviews")
    p.add_argument(
        "--handshakes-per-second", type=float, default=None, help="hostile: the extender's flag (default: its own)"
    )
    p.add_argument("--review-flood-s", type=float, default=15.0, help="hostile: how long the forged reviews go on")
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
        if a.part == "hostile":
            hostile_run(a, tmp, crt, key)
            return 0
        if a.part == "agent":
            agent_run(a)
            return 0
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
