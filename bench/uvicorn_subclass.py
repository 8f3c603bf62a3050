"""Whether the webhook's and metrics' protocol subclass (gputopo/extender/http/uvicornprotocol.py) can go: the same
hostile callers against it and against its public alternative, in one run, on loopback.

Variants (`--variants`):

- `subclass`: the real `gputopo-extender --snapshot` (100 nodes), as shipped;
- `public-h11`, `public-httptools`: the same extender, with its webhook and metrics served by uvicorn through
  public settings only (h11 with `h11_max_incomplete_event_size` as the head cap, or httptools, which has none;
  `limit_concurrency` = `--max-connections`, `timeout_keep_alive` = `--idle-timeout-seconds`, the default
  backlog), with `PublicFront` in front of each app: what the subclass decides from a request head (the
  listener's paths, a body no path reads, the declared length, the body budget in all and per address),
  decided from the ASGI scope before the app reads the body. uvicorn puts no TLS extension in the scope, so no
  ASGI layer sees a client certificate: client auth moves into the TLS context (`ssl_cert_reqs=CERT_REQUIRED`
  with `--webhook-client-ca-file`), which any certificate that CA signed passes, whatever it names.

Parts (`--parts`), one extender process per variant and part, with client auth on the webhook:

- `heads`: ten 10 MB request heads at once to each listener: RSS growth at peak and after, the first answer;
- `bodies`: `--bodies` (256) connections from 4 addresses posting 8 MiB each to metrics /healthz, then to the
  webhook's /mutate without a certificate (`listener_limits.bodies_run`);
- `silent`: `--flood-addresses` (8) addresses holding 64 silent connections each: the server's open files,
  probes from another address (fresh connection, 3 s; on the webhook with the API server's certificate, which
  both variants answer), and how many flood connections the server still holds after `--hold-s`; a probe
  without a certificate (the kubelet's) before the flood;
- `reviews`: `--forgers` (48) callers without a certificate posting 6 MiB reviews for 15 s; metrics /healthz
  and the API server's review timed meanwhile (`listener_limits.review_flood_run`);
- `cost`: an honest request's latency and the server's CPU per request: metrics /healthz and the API server's
  review, each on one kept-alive connection; then the option "the project's own server for all three", as the
  verbs server (gputopo/extender/http/verbserver.py), the subclass and the public variant each serving a
  trivial handler.

Counts and time are bounded (`--bodies`, `--requests`, `--review-flood-s`, `--hold-s`; every socket wait has a
timeout); loopback only, and only the processes it starts are stopped. Nothing is asserted:

    .venv/bin/python bench/uvicorn_subclass.py [--variants subclass,public-h11,public-httptools]
        [--parts heads,bodies,silent,reviews,cost]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

# Beside this script: bench/ is no package, and running a script puts its own folder on sys.path.
from extender_latency import cpu_seconds, free_port, pct, stop, write_cluster
from listener_limits import (
    API_SERVER,
    LISTENERS,
    HonestReviews,
    Probe,
    bodies_run,
    certificate,
    client_certs,
    client_context,
    fds,
    gone,
    heads_growth,
    probe_once,
    review_flood_run,
    rss_mib,
    source_addresses,
    start,
)

HONEST_REVIEW = orjson.dumps(
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
     "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE",
                 "object": {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": []}}}}
)  # fmt: skip
TRIVIAL_BODY = b'{"ok":true}'


# ---------------------------------------------------------------------------------------------- the public variant


async def _json(send: Any, status: int, text: str) -> None:
    body = orjson.dumps({"Error": text})
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": [*headers, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class PublicFront:
    """ASGI middleware: the subclass's head decisions (`HeadPolicy`, `BodyBudget`) from the scope, before the app
    reads a byte of the body; a refusal closes the connection. What uvicorn read of the body meanwhile (its flow
    control pauses past 64 KiB, the TLS layer reads ahead 256 KiB) is not this layer's to stop."""

    def __init__(self, app: Any, policy: Any, budget: Any) -> None:
        self.app, self.policy, self.budget = app, policy, budget

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = self.policy.decide(scope["method"].encode("latin-1"), scope["path"], scope["headers"], None)
        peer = scope["client"][0] if scope.get("client") else None
        refused = decision.refusal
        if refused is None and (full := self.budget.refusal(decision.declared, peer)) is not None:
            refused = (503, full)
        if refused is not None:
            await _json(send, *refused)
            return
        held = decision.declared

        async def counted() -> Any:
            nonlocal held
            message = await receive()
            size = len(message.get("body", b""))
            if decision.chunked and size:
                if self.budget.refusal(size, peer) is not None:
                    return {"type": "http.disconnect"}  # over the budget: the app sees the client gone
                held += size
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.budget.give(held, peer)


def public_config(app: Any, limits: Any, http: str, tls: Any = None, client_ca: Any = None) -> Any:
    """uvicorn's public settings for the webhook or metrics listener, `PublicFront` before the app."""
    import uvicorn

    from gputopo.extender.http.heads import BodyBudget, HeadPolicy

    state = getattr(app, "state", None)
    policy = HeadPolicy(
        paths=getattr(state, "paths", frozenset({"/healthz"})),
        body_paths=getattr(state, "post_paths", frozenset()),
        max_request_bytes=limits.max_request_bytes,
    )  # no `guarded`: the scope carries no certificate (the module doc)
    budget = BodyBudget(limits.max_body_bytes_in_flight, limits.body_bytes_per_peer)
    options: dict[str, Any] = {"h11_max_incomplete_event_size": limits.max_header_bytes} if http == "h11" else {}
    return uvicorn.Config(
        PublicFront(app, policy, budget),
        lifespan="off",
        log_config=None,
        access_log=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        ssl_ca_certs=str(client_ca) if tls and client_ca else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and client_ca else ssl.CERT_NONE,
        http=http,
        ws="none",
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=int(limits.idle_timeout_s),
        **options,
    )


def public_server(config: Any) -> Any:
    import uvicorn

    class PublicServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:  # `serve` handles the signals once for all listeners
            yield

    return PublicServer(config)


def serve_public(http: str, argv: list[str]) -> int:
    """The extender's own `main`, its webhook and metrics listeners on `public_config` and `public_server`."""
    import gputopo.extender.app as app_module
    from gputopo.extender import main as extender_main

    build = app_module.create_listeners

    def unguarded(settings: Any) -> Any:
        listeners = build(settings)
        listeners.webhook.state.guarded = {}  # the route's own check reads the scope's TLS extension: none here
        return listeners

    def config(app: Any, limits: Any, tls: Any = None, client_ca: Any = None) -> Any:
        return public_config(app, limits, http, tls, client_ca)

    app_module.create_listeners = unguarded  # type: ignore[assignment]
    extender_main.listener_config = config
    extender_main.ListenerServer = lambda config, limits: public_server(config)  # type: ignore[assignment,misc]
    return extender_main.main(argv)


# ---------------------------------------------------------------------------------------------- trivial handlers


async def trivial_app(scope: Any, _receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(TRIVIAL_BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": TRIVIAL_BODY})


class TrivialDoor:
    """The verbs server's door answering every path on the loop, as /healthz is."""

    max_request_bytes = 1024

    def route(self, method: bytes, path: str) -> str:
        return "healthz"

    def reads_body(self, verb: str) -> bool:
        return False

    def pool_for(self, verb: str) -> None:
        return None

    def answer(self, verb: str, body: bytes) -> tuple[int, bytes]:
        return 200, TRIVIAL_BODY

    def after(self, verb: str) -> None:
        pass

    def ready(self, verb: str, body: bytes) -> None:
        return None


def serve_trivial(kind: str, http: str, port: int) -> int:
    """One server answering every request with TRIVIAL_BODY on the main thread's loop: the verbs server, the
    subclass (as the extender runs it) or the public variant."""
    import asyncio
    import signal

    from gputopo.extender.http.verbserver import VerbServer
    from gputopo.extender.main import ListenerServer, _loop_factory, listener_config
    from gputopo.extender.settings import ListenerLimits

    limits = ListenerLimits()
    server: Any
    if kind == "verbs":
        server = VerbServer(TrivialDoor(), limits)
    elif kind == "subclass":
        server = ListenerServer(listener_config(trivial_app, limits), limits)
    else:
        server = public_server(public_config(trivial_app, limits, http))
    if kind != "verbs":
        server.config.load()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(server.serve(sockets=[sock]))
    return 0


# ---------------------------------------------------------------------------------------------- measurements


def silent_run(pid: int, ports: dict[str, int], a: argparse.Namespace, api: ssl.SSLContext) -> None:
    """`--flood-addresses` addresses holding 64 silent connections each (twice a listener's 256); probes from
    another address; the flood connections the server still holds `--hold-s` later."""
    print(f"\n{a.flood_addresses} addresses holding 64 silent connections each; probes from another address")
    kubelet = probe_once(ports["webhook"], client_context(), "127.1.0.1")
    print(f"  webhook, before the flood: a probe without a client certificate answered: {'yes' if kubelet else 'NO'}")
    for name, context in (("metrics", None), ("webhook", api)):
        fds_before = fds(pid)
        held: list[socket.socket] = []
        for source in source_addresses(a.flood_addresses):
            for _ in range(64):
                try:
                    held.append(
                        socket.create_connection(("127.0.0.1", ports[name]), timeout=2, source_address=(source, 0))
                    )
                except OSError:
                    break
        time.sleep(0.5)
        fds_held = fds(pid) - fds_before
        ok = sum(probe_once(ports[name], context, "127.1.0.1") for _ in range(a.probes))
        for conn in held:
            conn.setblocking(False)
        deadline = time.monotonic() + a.hold_s
        while time.monotonic() < deadline and not all(gone(c) for c in held):
            time.sleep(0.5)
        still = sum(not gone(c) for c in held)
        for conn in held:
            conn.close()
        print(
            f"  {name}: {ok} of {a.probes} probes answered (3 s); {len(held)} opened, server's open files "
            f"+{fds_held}; {still} still held by the server after {a.hold_s:g} s"
        )
        time.sleep(1.0)


def timed(once: Any, pid: int, requests: int, budget_s: float) -> tuple[list[float], float]:
    """`once()` (ms, or None when it failed) up to `requests` times within `budget_s`: the times, and the server's
    CPU ms per request."""
    for _ in range(20):  # warm-up
        once()
    out: list[float] = []
    cpu0, end = cpu_seconds(pid), time.monotonic() + budget_s
    for _ in range(requests):
        took = once()
        if took is not None:
            out.append(took)
        if time.monotonic() > end:
            break
    return out, (cpu_seconds(pid) - cpu0) * 1000 / max(1, len(out))


def row(label: str, runs: tuple[list[float], float]) -> None:
    ms, cpu = runs
    if not ms:
        print(f"  {label:<48} none answered")
        return
    print(f"  {label:<48}{statistics.median(ms):>9.2f}{pct(ms, 99):>9.2f}{cpu:>10.3f}  ({len(ms)} calls)")


def cost_run(pid: int, ports: dict[str, int], a: argparse.Namespace, api: ssl.SSLContext) -> None:
    print(f"\n{'honest requests, one kept-alive connection each':<59}p50 ms   p99 ms  CPU ms/req")
    row("metrics /healthz", timed(Probe(ports["metrics"]).once, pid, a.requests, a.budget_s))
    reviews = HonestReviews(ports["webhook"], api, HONEST_REVIEW)

    def review() -> float | None:
        took, status = reviews.once()
        return took if status.startswith("200") else None

    row("the API server's review (TLS, its certificate)", timed(review, pid, a.requests, a.budget_s))


def trivial_run(a: argparse.Namespace) -> None:
    print(f"\n{'a trivial handler, one kept-alive connection':<59}p50 ms   p99 ms  CPU ms/req")
    for kind in ("verbs", *a.variants):
        port = free_port()
        http = kind.removeprefix("public-")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-trivial", kind, http, str(port)]
        env = {**os.environ, "PYTHONPATH": str(a.root), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = start(cmd, env, port, a.root)
        try:
            label = {"verbs": "verbs server", "subclass": "subclass (uvicorn + BoundedHttpTools)"}.get(kind, "")
            row(
                label or f"{kind} (public settings + PublicFront)",
                timed(Probe(port).once, proc.pid, a.requests * 3, a.budget_s),
            )
        finally:
            stop(proc)


def part_run(part: str, variant: str, a: argparse.Namespace, tmp: Path, certs: tuple[Path, ...]) -> None:
    """One part against one variant, in an extender process of its own (one part's memory never carries into
    the next)."""
    crt, key, client_ca, api_crt, api_key = certs
    api = client_context()
    api.load_cert_chain(str(api_crt), str(api_key))
    ports = {name: free_port() for name in LISTENERS}
    args = ["--snapshot", str(tmp / "cluster.yaml"), "--port", str(ports["verbs"])]
    args += ["--metrics-host", "127.0.0.1", "--metrics-port", str(ports["metrics"])]
    args += ["--webhook-host", "127.0.0.1", "--webhook-port", str(ports["webhook"])]
    args += ["--tls-cert-file", str(crt), "--tls-key-file", str(key), "--log-level", "critical"]
    args += ["--webhook-client-ca-file", str(client_ca), "--webhook-client-names", API_SERVER]
    if variant == "subclass":
        cmd = [sys.executable, "-m", "gputopo.extender.main", *args]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-public", variant.removeprefix("public-"), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOPO_")}
    env["PYTHONPATH"], env["PYTHONDONTWRITEBYTECODE"] = str(a.root), "1"
    proc = start(cmd, env, ports["verbs"], a.root)
    print(f"\n==== {part}: {variant} (RSS at start {rss_mib(proc.pid):.0f} MiB, load {os.getloadavg()[0]:.1f})")
    try:
        if part == "heads":
            for name, (peak, after, answer) in heads_growth(proc.pid, ports, a.timeout_s).items():
                print(f"  {name:<8} 10 x 10 MB heads: RSS +{peak:.1f} MiB peak, +{after:.1f} after; {answer}")
        elif part == "bodies":
            bodies_run(proc.pid, ports, a, client_context())
        elif part == "silent":
            silent_run(proc.pid, ports, a, api)
        elif part == "reviews":
            review_flood_run(ports, a, api)
        elif part == "cost":
            cost_run(proc.pid, ports, a, api)
    finally:
        stop(proc)


def uvicorn_version() -> str:
    import uvicorn

    return str(uvicorn.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--serve-public"]:
        return serve_public(args[1], args[2:])
    if args[:1] == ["--serve-trivial"]:
        return serve_trivial(args[1], args[2], int(args[3]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--variants", default="subclass,public-h11,public-httptools", help="which (module doc)")
    p.add_argument("--parts", default="heads,bodies,silent,reviews,cost", help="which measurements (module doc)")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to run")
    p.add_argument("--timeout-s", type=float, default=20.0, help="bound of every socket wait")
    p.add_argument("--bodies", type=int, default=256, help="bodies: connections sending the largest body at once")
    p.add_argument("--body-mib", type=int, default=8, help="bodies: each body's size (the default --max-request-bytes)")
    p.add_argument("--flood-addresses", type=int, default=8, help="silent: addresses holding 64 silent connections")
    p.add_argument("--probes", type=int, default=10, help="silent: probes from another address")
    p.add_argument("--hold-s", type=float, default=15.0, help="silent: how long to watch the flood connections")
    p.add_argument("--forgers", type=int, default=48, help="reviews: callers posting forged 6 MiB reviews")
    p.add_argument("--review-flood-s", type=float, default=15.0, help="reviews: how long the forged reviews go on")
    p.add_argument("--requests", type=int, default=500, help="cost: honest requests per row (x3 for trivial)")
    p.add_argument("--rounds", type=int, default=2, help="cost: rounds over the variants (the load drifts)")
    p.add_argument("--budget-s", type=float, default=20.0, help="cost: time bound of each row")
    a = p.parse_args(args)
    a.variants = a.variants.split(",")
    a.parts = a.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        write_cluster(tmp / "cluster.yaml", 100)
        crt, key = certificate(tmp)
        print(f"checkout: {a.root}; uvicorn {uvicorn_version()}; load {os.getloadavg()[0]:.1f}")
        certs = (crt, key, *client_certs(tmp))
        # Part by part, the variants one after the other: the machine's load drifts less between them.
        for part in a.parts:
            for _ in range(a.rounds if part == "cost" else 1):
                for variant in a.variants:
                    part_run(part, variant, a, tmp, certs)
        for _ in range(a.rounds if "cost" in a.parts else 0):
            trivial_run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
