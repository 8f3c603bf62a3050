"""The factory: one cache, one service, the door into the verbs, and the webhook's and metrics' apps.

`create_listeners(settings, cluster=..., clock=...)` builds what the three listeners serve, all over one
cache and service (docs/extender.md, "Listeners"):

- `door`: the verbs (POST /filter, /prioritize, /bind, /preempt, GET /healthz, /readyz), served by the
  verbs listener's own server (`gputopo.extender.http.verbserver`, `--host`/`--port`, loopback) and called directly by
  the unit tests (`door.answer("filter", body)`);
- `webhook`: a FastAPI app, POST /mutate, GET /healthz, /readyz (`--webhook-port`, HTTPS);
- `metrics`: a FastAPI app, GET /metrics, /healthz, /readyz (`--metrics-port`).

`Listeners.running()` is the lifespan: it starts one list+watch thread per kind (nodes, pods, the agents'
Leases, ...) and stops them, the door's workers and the Event posting on exit; `gputopo.extender.main` enters it
once for all three servers. In snapshot mode (`settings.snapshot`) there is no API server: the cache is
loaded from the cluster file once and is ready immediately.

    listeners = create_listeners(Settings(kubeconfig=Path("admin.kubeconfig"), namespace="gputopo-system"))
    with listeners.running():
        status, body = listeners.door.answer("readyz", b"")
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from gputopo.clusterfile import cluster_states, load_cluster
from gputopo.extender.http.bodylimit import RequestGuard
from gputopo.extender.http.clientauth import ClientAuth
from gputopo.extender.http.workers import BoundedWorkers
from gputopo.extender.metrics import Metrics
from gputopo.extender.routers import health, metrics, mutate
from gputopo.extender.settings import Settings
from gputopo.extender.verbs.door import Door
from gputopo.extender.verbs.groupgates import GateLifter, LiftChecks, SweepPace, plan_with
from gputopo.extender.verbs.service import Extender
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.source import ClusterSource, Informer, KubeSource, start_informers
from gputopo.extender.webhook.claimtemplates import TemplateKeeper
from gputopo.extender.webhook.mutation import DraMode

log = logging.getLogger("gputopo.extender")

# /mutate's decision outcomes (gputopo_extender_decisions_total) for the refusals its listener answers from the
# request head (gputopo/extender/http/heads.py).
HEAD_OUTCOMES = {401: "unauthenticated", 403: "forbidden", 413: "too_large", 503: "busy"}


@dataclass
class Listeners:
    """What each listener serves, over one cache and service; `running()` is their lifespan."""

    settings: Settings
    cache: ClusterCache
    extender: Extender
    prometheus: Metrics
    door: Door
    webhook: FastAPI
    metrics: FastAPI
    watch: bool = True
    watch_timeout_seconds: int = 300
    informers: list[Informer] = field(default_factory=list)
    keeper: TemplateKeeper | None = (
        None  # --dra: the claim templates real pods name (gputopo/extender/webhook/claimtemplates.py)
    )
    lifter: GateLifter | None = None  # lifts gputopo's scheduling gate (gputopo/extender/verbs/groupgates.py)
    _lifting: threading.Event = field(default_factory=threading.Event)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Start the informers (an API source from the settings when none was given); on exit stop them,
        the door's workers and the Event posting (queued Events go out while the API client is still open)."""
        settings, extender = self.settings, self.extender
        owned: ClusterSource | None = None
        if settings.snapshot is None:
            if extender.source is None:
                owned = extender.source = KubeSource(settings.kubeconfig, settings.namespace)
            if settings.dra and self.keeper is None and isinstance(extender.source, KubeSource):
                cache = self.cache
                self.keeper = TemplateKeeper(
                    extender.source.api,
                    claims=DraMode(
                        list_attributes=settings.dra_list_attributes,
                        memory_classes=settings.memory_classes,
                        blocks=settings.dra_blocks,
                    ),
                    ready=lambda: "pods" in cache.synced,
                )
            if self.keeper is not None:
                self.cache.pod_hook = self.keeper
                self.keeper.start()
            if self.watch:
                started = start_informers(
                    extender.source,
                    self.cache,
                    watch_timeout_seconds=self.watch_timeout_seconds,
                    on_relist=self.prometheus.relisted,
                )
                self.informers = [inf for inf, _ in started]
            # Always, whether or not this webhook gates: a pod gated before the setting changed is lifted too.
            self.lifter = GateLifter(
                self.cache.ledger,
                lambda: extender.source,
                extender.events,
                pace=SweepPace(release_after_s=settings.group_gate_release_seconds),
                clock=self.cache.clock,
                on_lift=lambda reason: self.prometheus.gates_lifted.labels(reason).inc(),
                checks=LiftChecks(plan=plan_with(extender.groups), leading=self.cache.leadership.leading),
            )
            self._lifting.clear()
            if self.watch:  # without informers the caller drives the sweeps (`lifter.sweep()`), as the cache
                threading.Thread(
                    target=self.lifter.run, args=(self._lifting,), name="gputopo-group-gates", daemon=True
                ).start()
        if settings.webhook_port and settings.webhook_client_ca_file is None:
            log.warning(
                "the webhook is unauthenticated: /mutate answers any caller that reaches its port "
                "(set --webhook-client-ca-file and --webhook-client-names to answer only the API server)"
            )
        log.info(
            "gputopo-extender started",
            extra={
                "mode": "snapshot" if settings.snapshot else "api",
                "nodes": len(self.cache.nodes),
                "namespace": settings.namespace,
            },
        )
        try:
            yield
        finally:
            for inf in self.informers:
                inf.stop.set()
            self._lifting.set()
            if self.lifter is not None:
                self.lifter.close()
            if self.keeper is not None:
                self.keeper.close()
            self.door.close()
            for app in (self.webhook, self.metrics):
                workers = getattr(app.state, "review_workers", None)
                if workers is not None:
                    workers.close()
            extender.close()
            if owned is not None:
                owned.close()
                extender.source = None


def create_listeners(
    settings: Settings | None = None,
    *,
    cluster: ClusterSource | None = None,
    clock: Callable[[], float] | None = None,
    watch: bool = True,
    watch_timeout_seconds: int = 300,
) -> Listeners:
    """Build the door and the two apps over one cache and service.

    - `cluster`: the API source (tests pass an in-memory fake); None builds a `KubeSource` from
      `settings.kubeconfig` (or the in-cluster config) when `running()` starts.
    - `clock`: epoch seconds, for Lease staleness and reservation timeouts (tests inject one).
    - `watch=False`: do not start informer threads (tests drive `listeners.cache` themselves).
    """
    settings = settings or Settings()
    cache = ClusterCache(
        tiers=settings.tiers,
        weights=settings.score_weights,
        stale_after_seconds=settings.stale_after_seconds,
        reservation_timeout_seconds=settings.reservation_timeout_seconds,
        clock=clock or time.time,
        scheduler_name=settings.scheduler_name,
        lease_namespace=settings.namespace,
        leader_lease=settings.leader_lease,
        leader_identity=socket.gethostname(),  # kube-scheduler's, in the same pod: its holderIdentity's prefix
    )
    if settings.snapshot is not None:
        cache.load_static(cluster_states(load_cluster(settings.snapshot), settings.tiers))
    prometheus = Metrics(cache.age_seconds)
    extender = Extender(cache, None if settings.snapshot is not None else cluster, prometheus)
    extender.best_only = settings.filter_best_only
    extender.groups.exclusive.max_promised = settings.max_held_gpus_per_namespace

    def head_refused(path: str, status: int) -> None:
        """A /mutate refused from its request head, counted as the route counts its own refusals."""
        if path == "/mutate":
            prometheus.decision("mutate", HEAD_OUTCOMES.get(status, "bad_request"))

    def build(title: str, *routers: APIRouter) -> FastAPI:
        app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
        app.state.settings = settings
        app.state.cache = cache
        app.state.extender = extender
        app.state.metrics = prometheus
        for router in routers:
            app.include_router(router)
        # What the listener's server decides from a request's head (gputopo/extender/http/heads.py): the paths it
        # serves, the POST paths whose body it reads (no other body is read, nor 100 Continue sent), and the
        # guarded ones, answered only for the API server's client certificate before their body is read.
        routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
        app.state.paths = frozenset(r.path for r in routes)
        app.state.post_paths = frozenset(r.path for r in routes if "POST" in (r.methods or ()))
        guarded = app.state.post_paths & {"/mutate"}
        app.state.guarded = (
            {path: ClientAuth.of(settings.client_names) for path in guarded}
            if settings.webhook_client_ca_file is not None
            else {}
        )
        app.state.max_request_bytes = settings.max_request_bytes
        app.state.head_refused = head_refused
        if app.state.post_paths:  # reviews are parsed off the loop that answers the probes
            app.state.review_workers = BoundedWorkers()
        # Every listener reads request bodies (the webhook's AdmissionReviews too): the same limit for all.
        app.add_middleware(RequestGuard, max_request_bytes=settings.max_request_bytes)
        return app

    return Listeners(
        settings=settings,
        cache=cache,
        extender=extender,
        prometheus=prometheus,
        door=Door(extender, prometheus, settings.max_request_bytes),
        webhook=build("gputopo-extender webhook", mutate.router, health.router),
        metrics=build("gputopo-extender metrics", metrics.router, health.router),
        watch=watch,
        watch_timeout_seconds=watch_timeout_seconds,
    )
