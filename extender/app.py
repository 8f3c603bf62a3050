"""The app factory: one service, one cache, three listeners.

`create_listeners(settings, cluster=..., clock=...)` builds the cache, the service and one FastAPI app per
listener, all sharing them (docs/extender.md, "Listeners"):

- `verbs`: POST /filter, /prioritize, /bind, /preempt, GET /healthz, /readyz (`--host`/`--port`, loopback);
- `webhook`: POST /mutate, GET /healthz, /readyz (`--webhook-port`, HTTPS);
- `metrics`: GET /metrics, /healthz, /readyz (`--metrics-port`).

Each answers 404 for the others' paths. The verbs app owns the lifespan, which starts one list+watch thread
per kind (nodes, pods, the agents' Leases) and stops them on shutdown; `extender.main` enters it once for
all three servers. In snapshot mode (`settings.snapshot`) there is no API server: the cache is loaded from
the cluster file once and is ready immediately. `create_app` is the verbs app alone (what most tests drive):

    app = create_app(Settings(kubeconfig=Path("admin.kubeconfig"), namespace="gputopo-system"))
    with TestClient(app) as client: ...
    metrics = app.state.listeners.metrics   # the sibling apps, same cache and service
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from extender.cache import ClusterCache
from extender.kube import ClusterSource, Informer, KubeSource, start_informers
from extender.limits import RequestGuard
from extender.metrics import Metrics
from extender.routers import health, metrics, mutate
from extender.routers.scheduler import VerbLane
from extender.service import Extender
from extender.settings import Settings
from gputopo.clusterfile import cluster_states, load_cluster
from gputopo.model import EXTENDER_COMPONENT

log = logging.getLogger("gputopo.extender")


class VerbsApp(FastAPI):
    """The verbs listener's app: kube-scheduler's POSTs go straight to the `VerbLane`, around FastAPI's
    stack (three calls per scheduled pod: its per-request cost showed); the rest is FastAPI's."""

    lane: VerbLane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.lane.matches(scope):
            await self.lane(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


@dataclass(frozen=True)
class Listeners:
    """One app per listener; `verbs` owns the lifespan that starts and stops the informers."""

    verbs: VerbsApp
    webhook: FastAPI
    metrics: FastAPI


def create_listeners(
    settings: Settings | None = None,
    *,
    cluster: ClusterSource | None = None,
    clock: Callable[[], float] | None = None,
    watch: bool = True,
    watch_timeout_seconds: int = 300,
) -> Listeners:
    """Build the three apps over one cache and service.

    - `cluster`: the API source (tests pass an in-memory fake); None builds a `KubeSource` from
      `settings.kubeconfig` (or the in-cluster config) when the lifespan starts.
    - `clock`: epoch seconds, for Lease staleness and reservation timeouts (tests inject one).
    - `watch=False`: do not start informer threads (tests drive `app.state.cache` themselves).
    """
    settings = settings or Settings()
    cache = ClusterCache(
        tiers=settings.tiers,
        weights=settings.score_weights,
        stale_after_seconds=settings.stale_after_seconds,
        reservation_timeout_seconds=settings.reservation_timeout_seconds,
        clock=clock or time.time,
        lease_namespace=settings.namespace,
    )
    if settings.snapshot is not None:
        cache.load_static(cluster_states(load_cluster(settings.snapshot), settings.tiers))
    prometheus = Metrics(cache.age_seconds)
    extender = Extender(cache, None if settings.snapshot is not None else cluster, prometheus)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        informers: list[Informer] = []
        owned: ClusterSource | None = None
        if settings.snapshot is None:
            if extender.source is None:
                owned = extender.source = KubeSource(settings.kubeconfig, settings.namespace)
            if watch:
                started = start_informers(extender.source, cache, watch_timeout_seconds=watch_timeout_seconds)
                informers = [inf for inf, _ in started]
                app.state.informers = informers
        log.info(
            "gputopo-extender started",
            extra={
                "mode": "snapshot" if settings.snapshot else "api",
                "nodes": len(cache.nodes),
                "namespace": settings.namespace,
            },
        )
        try:
            yield
        finally:
            for inf in informers:
                inf.stop.set()
            lane.close()
            extender.close()  # queued Events go out while the API client is still open
            if owned is not None:
                owned.close()
                extender.source = None

    lane = VerbLane(extender, prometheus, settings.max_request_bytes)

    def build(title: str, *routers: APIRouter, owns_lifespan: bool = False, cls: type[FastAPI] = FastAPI) -> FastAPI:
        app = cls(
            title=title,
            lifespan=lifespan if owns_lifespan else None,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )
        app.state.settings = settings
        app.state.cache = cache
        app.state.extender = extender
        app.state.metrics = prometheus
        app.state.informers = []
        for router in routers:
            app.include_router(router)
        # The POST paths whose body the listener reads: its server sends 100 Continue only for those.
        app.state.post_paths = frozenset(
            r.path
            for router in routers
            for r in router.routes
            if isinstance(r, APIRoute) and "POST" in (r.methods or ())
        )
        # Every listener reads request bodies (the webhook's AdmissionReviews too): the same limit for all.
        app.add_middleware(RequestGuard, max_request_bytes=settings.max_request_bytes)
        return app

    verbs = build(EXTENDER_COMPONENT, health.router, owns_lifespan=True, cls=VerbsApp)
    assert isinstance(verbs, VerbsApp)
    verbs.lane = lane
    listeners = Listeners(
        verbs=verbs,
        webhook=build("gputopo-extender webhook", mutate.router, health.router),
        metrics=build("gputopo-extender metrics", metrics.router, health.router),
    )
    for app in (listeners.verbs, listeners.webhook, listeners.metrics):
        app.state.listeners = listeners
    return listeners


def create_app(
    settings: Settings | None = None,
    *,
    cluster: ClusterSource | None = None,
    clock: Callable[[], float] | None = None,
    watch: bool = True,
    watch_timeout_seconds: int = 300,
) -> VerbsApp:
    """The verbs app of `create_listeners` (its siblings are `app.state.listeners`)."""
    return create_listeners(
        settings, cluster=cluster, clock=clock, watch=watch, watch_timeout_seconds=watch_timeout_seconds
    ).verbs
