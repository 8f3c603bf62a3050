"""Fuzz the real extender over HTTP: malformed requests to every verb, one keep-alive connection.

Starts `gputopo-extender --snapshot` (a small cluster file) in a subprocess on 127.0.0.1, its webhook
listener over TLS with a throwaway certificate (openssl), then sends `--cases` requests (default 100,000)
over one keep-alive connection per listener: valid bodies of /filter, /prioritize, /bind, /preempt (the
verbs listener) and /mutate (the webhook listener), Go-cased and lower-cased keys, with one to three values
replaced or deleted, NaN / infinities / 1e400 / 400-digit numbers spliced in as raw JSON, nesting
thousands deep, truncated and random bytes, and now and then a body over the size limit (declared or
chunked). Every 100 cases a valid filter must still answer 200 with no Error. It stops by itself after
the cases or `--time-limit` seconds, and prints:

- answers by status, 5xx, answers that are not JSON, dropped connections (the next request on the
  keep-alive connection needed a new one, or failed), hangs (no answer within 5 s);
- tracebacks in the server's log, and the server's RSS after warm-up and at the end (target: flat).

Exit status 1 when any 5xx, non-JSON answer, drop or hang was seen.

With `--door` the same cases for the verbs (not /mutate, which is the webhook's) go straight into the one
door, in process (`gputopo.extender.verbs.door.Door.answer`, what the verbs server calls for every request): no socket,
so 100,000 cases take seconds; bodies over the limit are handed over whole (the limit is the server's).
It prints the answers by status, 5xx and non-JSON answers, failed probes, and exits 1 on any.

With `--dra` it fuzzes the agent's DRA driver instead, over its real gRPC unix socket (`bench/fuzz_dra.py`
says what and how; `--cases` there defaults to 5,000 and `--time-limit` to 300 s).

    .venv/bin/python bench/fuzz.py [--cases 100000] [--time-limit 1200] [--seed 1] [--door | --dra]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from gputopo.model import GPU_RESOURCE, LABEL_NETWORK_LEAF, SCHEDULER_NAME

HANG_SECONDS = 5.0
LIMIT = 1024 * 1024  # the server's --max-request-bytes here: over-limit cases stay cheap to send
VERBS = ("filter", "prioritize", "bind", "preempt", "mutate")
NASTY = ["NaN", "inf", "-inf", "Infinity", "1e400", "-1", "0.5", "2k", "500m", "9" * 400, "", "\x00", "80Gi"]
RAW = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 400, "[" * 3000 + "]" * 3000]
PROTOCOL_KEYS = {"Pods", "UID", "NumPDBViolations"}


def pod(name: str, gpus: int) -> dict[str, Any]:
    limits = {GPU_RESOURCE: str(gpus)}
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "annotations": {"gputopo.io/nvlink": "required", "gputopo.io/min-gpu-memory": "40Gi"},
        },
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits, "requests": limits}}],
        },
        "status": {"phase": "Pending"},
    }


NODES = ["dgx-0", "dgx-1", "l40s-0", "ghost"]


def valid(verb: str) -> dict[str, Any]:
    p = pod("p", 4)
    if verb in ("filter", "prioritize"):
        return {"Pod": p, "Nodes": None, "NodeNames": list(NODES)}
    if verb == "bind":
        return {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-p", "Node": "dgx-0"}
    if verb == "preempt":
        return {"Pod": p, "NodeNameToMetaVictims": {"dgx-0": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0}}}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": p},
    }


def lower(body: Any, top: bool = True) -> Any:
    if isinstance(body, dict):
        return {
            (k.lower() if top or k in PROTOCOL_KEYS else k): (v if k == "Pod" else lower(v, False))
            for k, v in body.items()
        }
    if isinstance(body, list):
        return [lower(v, False) for v in body]
    return body


TEMPLATES = {(verb, low): json.dumps(lower(valid(verb)) if low else valid(verb)) for verb in VERBS for low in (0, 1)}


def random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.15:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and r < 0.3:
        return {rng.choice(["", "a", "metadata", "name", "Pod", "uid"]): random_value(rng, depth + 1)}
    return rng.choice(
        [
            None,
            True,
            rng.randrange(-(2**40), 2**40),
            rng.choice([float("nan"), float("inf"), -1.5, 1e300, 0.0]),
            rng.choice(NASTY),
            "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12))),
            f"__raw{rng.randrange(len(RAW))}__",
        ]
    )


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


def mutate(rng: random.Random, verb: str) -> bytes:
    body: Any = json.loads(TEMPLATES[(verb, rng.randrange(2))])
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(list(paths(body)))
        if not path:
            body = random_value(rng)
            continue
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict) and rng.random() < 0.3:
            del parent[path[-1]]
        else:
            parent[path[-1]] = random_value(rng)
    text = json.dumps(body)
    if "__raw" in text:
        for i, token in enumerate(RAW):
            text = text.replace(f'"__raw{i}__"', token)
    return text.encode()


def case(rng: random.Random, verb: str) -> bytes | Iterator[bytes]:
    r = rng.random()
    if r < 0.80:
        return mutate(rng, verb)
    template = TEMPLATES[(verb, 0)].encode()
    if r < 0.88:
        return template[: rng.randrange(len(template))]
    if r < 0.94:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if r < 0.999:
        return rng.choice(RAW).encode()
    if r < 0.9995:
        return b" " * (LIMIT + 1)  # declared length over the limit
    return (b" " * 65536 for _ in range(2 * LIMIT // 65536))  # chunked, past the limit


def peer_of(r: httpx.Response) -> Any:
    """The client end of the connection that carried `r`; None when the server closed it after answering."""
    try:
        return r.extensions["network_stream"].get_extra_info("client_addr")
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def certificate(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for 127.0.0.1, for the webhook listener."""
    ca_key, ca, key, csr, crt, ext = (tmp / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    for step in (
        f"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=fuzz-ca -keyout {ca_key} -out {ca}",
        f"req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout {key} -out {csr}",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -days 1 -out {crt} -extfile {ext}",
    ):
        subprocess.run(["openssl", *step.split()], check=True, capture_output=True)
    return ca, crt, key


def write_cluster(path: Path) -> None:
    nodes = [
        {"name": "dgx-0", "fixture": "dgx-h100", "labels": {LABEL_NETWORK_LEAF: "leaf-1"}},
        {"name": "dgx-1", "fixture": "dgx-h100", "gpusInUse": [0, 1]},
        {"name": "l40s-0", "fixture": "l40s-4"},
    ]
    path.write_text(yaml.safe_dump({"nodes": nodes}))


def stop(server: subprocess.Popen[bytes]) -> None:
    """End the server this script started (its own session), however it is doing."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--time-limit", type=float, default=1200.0, help="stop after this many seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--door", action="store_true", help="the verbs' cases through the door, in process")
    ap.add_argument("--dra", action="store_true", help="fuzz the agent's DRA driver over its unix socket")
    opts = ap.parse_args()
    if opts.dra:
        from fuzz_dra import fuzz_dra  # bench/, the script's directory, is on sys.path

        explicit = {a.split("=")[0] for a in sys.argv[1:]}
        cases = opts.cases if "--cases" in explicit else 5_000
        return fuzz_dra(cases, opts.time_limit if "--time-limit" in explicit else 300.0, opts.seed)
    rng = random.Random(opts.seed)
    with tempfile.TemporaryDirectory(prefix="gputopo-fuzz-") as tmp:
        cluster, log_path = Path(tmp) / "cluster.yaml", Path(tmp) / "server.log"
        write_cluster(cluster)
        if opts.door:
            return through_door(opts, rng, cluster)
        ca, crt, key = certificate(Path(tmp))
        port, webhook_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "gputopo.extender.main", "--snapshot", str(cluster), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--max-request-bytes", str(LIMIT), "--log-level", "error", "--metrics-port", "0"]
        cmd += ["--webhook-host", "127.0.0.1", "--webhook-port", str(webhook_port)]
        cmd += ["--tls-cert-file", str(crt), "--tls-key-file", str(key)]
        with log_path.open("wb") as log:
            server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        clients = {
            "verbs": httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG_SECONDS),
            "webhook": httpx.Client(
                base_url=f"https://127.0.0.1:{webhook_port}",
                timeout=HANG_SECONDS,
                verify=ssl.create_default_context(cafile=str(ca)),
            ),
        }
        try:
            return run(opts, rng, clients, server, log_path)
        finally:
            for c in clients.values():
                c.close()
            stop(server)


def through_door(opts: argparse.Namespace, rng: random.Random, cluster: Path) -> int:
    """The verbs' cases straight into `Door.answer`, in process, over the snapshot `cluster`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from gputopo.extender.app import create_listeners
    from gputopo.extender.settings import Settings

    logging.disable(logging.WARNING)  # each malformed case is logged as a warning: not what is measured
    listeners = create_listeners(Settings(snapshot=cluster, max_request_bytes=LIMIT))
    door = listeners.door
    verbs = [v for v in VERBS if v != "mutate"]
    statuses: Counter[int] = Counter()
    by_verb: Counter[str] = Counter()
    fives = non_json = failed_probes = done = 0
    probe = json.dumps(valid("filter")).encode()
    start = time.monotonic()
    with listeners.running():
        for i in range(opts.cases):
            if time.monotonic() - start > opts.time_limit:
                break
            verb = verbs[i % len(verbs)]
            body = case(rng, verb)
            status, data = door.answer(verb, body if isinstance(body, bytes) else b"".join(body))
            done += 1
            statuses[status] += 1
            by_verb[f"{verb} {status}"] += 1
            fives += status >= 500
            try:
                json.loads(data)
            except ValueError:
                non_json += 1
            if i % 100 == 99:
                status, data = door.answer("filter", probe)
                failed_probes += not (status == 200 and json.loads(data)["Error"] == "")
    elapsed = time.monotonic() - start
    print(f"through the door: {done} cases in {elapsed:.1f} s ({done / elapsed:.0f}/s), seed {opts.seed}")
    print("answers by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print("by verb: " + ", ".join(f"{k}: {n}" for k, n in sorted(by_verb.items())))
    print(f"5xx: {fives}  not JSON: {non_json}  failed valid probes: {failed_probes}")
    return 1 if fives or non_json or failed_probes else 0


def run(
    opts: argparse.Namespace,
    rng: random.Random,
    clients: dict[str, httpx.Client],
    server: subprocess.Popen[bytes],
    log: Path,
) -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            if all(c.get("/readyz").status_code == 200 for c in clients.values()):
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            print(f"server did not start:\n{log.read_text()[-2000:]}", file=sys.stderr)
            return 2
        time.sleep(0.1)

    statuses: Counter[int] = Counter()
    by_verb: Counter[str] = Counter()
    fives = non_json = dropped = hangs = failed_probes = 0
    probe = json.dumps(valid("filter")).encode()
    headers = {"Content-Type": "application/json"}
    # Per listener: the connection the last answer came on, and whether a new one is due.
    last_peer: dict[str, Any] = dict.fromkeys(clients)
    expect_new = dict.fromkeys(clients, False)
    rss_before = 0
    start = time.monotonic()
    done = 0
    for i in range(opts.cases):
        if time.monotonic() - start > opts.time_limit:
            break
        if i == 1000:
            rss_before = rss_kib(server.pid)  # after warm-up: imports, caches and pools are in place
        verb = VERBS[i % len(VERBS)]
        listener = "webhook" if verb == "mutate" else "verbs"
        try:
            r = clients[listener].post(f"/{verb}", content=case(rng, verb), headers=headers)
        except httpx.TimeoutException:
            hangs += 1
            expect_new[listener] = True
            continue
        except httpx.TransportError:
            dropped += 1
            expect_new[listener] = True
            continue
        finally:
            done += 1
        peer, last = peer_of(r), last_peer[listener]
        if (peer is None and r.status_code != 413) or (last and peer and peer != last and not expect_new[listener]):
            dropped += 1  # closed right after this answer, or the previous one's connection did not survive
        last_peer[listener], expect_new[listener] = peer, peer is None or r.status_code == 413
        statuses[r.status_code] += 1
        by_verb[f"{verb} {r.status_code}"] += 1
        if r.status_code >= 500:
            fives += 1
        try:
            r.json()
        except ValueError:
            non_json += 1
        if i % 100 == 99:
            try:
                p = clients["verbs"].post("/filter", content=probe, headers=headers)
                ok = p.status_code == 200 and p.json()["Error"] == ""
                last_peer["verbs"] = peer_of(p)
            except httpx.HTTPError:
                ok = False
            failed_probes += not ok
        if i % 10_000 == 9_999:
            print(f"  {i + 1} cases, {time.monotonic() - start:.0f} s, RSS {rss_kib(server.pid)} KiB", flush=True)
    elapsed = time.monotonic() - start
    rss_after = rss_kib(server.pid)
    tracebacks = log.read_text(errors="replace").count("Traceback")
    print(f"cases: {done} in {elapsed:.0f} s ({done / elapsed:.0f}/s), seed {opts.seed}")
    print("answers by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print("by verb: " + ", ".join(f"{k}: {n}" for k, n in sorted(by_verb.items())))
    print(
        f"5xx: {fives}  not JSON: {non_json}  dropped connections: {dropped}  hangs (> {HANG_SECONDS:.0f} s): {hangs}"
    )
    print(f"failed valid probes: {failed_probes}  tracebacks in the server log: {tracebacks}")
    print(f"server RSS: {rss_before} KiB after warm-up, {rss_after} KiB at the end ({rss_after - rss_before:+d} KiB)")
    return 1 if fives or non_json or dropped or hangs or failed_probes else 0


if __name__ == "__main__":
    sys.exit(main())
