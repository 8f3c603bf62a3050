"""The app factory: `create_app(settings, cluster=..., clock=...)` wires cache, source, service and routers.

The lifespan starts one list+watch thread per kind (nodes, pods, the agents' Leases) and stops them on
shutdown. In snapshot mode (`settings.snapshot`) there is no API server: the cache is loaded from the
cluster file once and is ready immediately.

    app = create_app(Settings(kubeconfig=Path("admin.kubeconfig"), namespace="gputopo-system"))
    uvicorn.run(app, host="127.0.0.1", port=8888)
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic_core import from_json, to_json

from extender.cache import ClusterCache
from extender.kube import ClusterSource, Informer, KubeSource, start_informers
from extender.limits import RequestGuard
from extender.metrics import Metrics
from extender.routers import health, scheduler
from extender.service import Extender
from extender.settings import Settings
from gputopo.clusterfile import cluster_states, load_cluster

log = logging.getLogger("gputopo.extender")


def create_app(
    settings: Settings | None = None,
    *,
    cluster: ClusterSource | None = None,
    clock: Callable[[], float] | None = None,
    watch: bool = True,
    watch_timeout_seconds: int = 300,
) -> FastAPI:
    """Build the extender app.

    - `cluster`: the API source (tests pass `extender.fake.FakeSource`); None builds a `KubeSource` from
      `settings.kubeconfig` (or the in-cluster config) when the app starts.
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
    metrics = Metrics(cache.age_seconds)
    extender = Extender(cache, None if settings.snapshot is not None else cluster, metrics)

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
            if owned is not None:
                owned.close()
                extender.source = None

    app = FastAPI(title="gputopo-extender", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.cache = cache
    app.state.extender = extender
    app.state.metrics = metrics
    app.state.informers = []
    app.include_router(scheduler.router)
    app.include_router(health.router)
    _mount_webhook(app, metrics)
    app.add_middleware(RequestGuard, max_request_bytes=settings.max_request_bytes)
    return app


def _mount_webhook(app: FastAPI, metrics: Metrics) -> None:
    """POST /mutate when extender/webhook.py (the mutating admission webhook) is present."""
    if importlib.util.find_spec("extender.webhook") is None:
        return
    from extender import webhook

    mutate_pod: Callable[[dict[str, Any]], dict[str, Any]] = webhook.mutate_pod

    @app.post("/mutate", tags=["webhook"])
    async def mutate(request: Request) -> Response:
        start = time.perf_counter()
        review: Any = None
        try:
            # pydantic-core's parser, not json.loads: it stops at 200 levels of nesting with a ValueError
            # where the standard library would exhaust the stack.
            review = from_json(await request.body())
            if not isinstance(review, dict):
                raise ValueError("an AdmissionReview object is expected")
            answer = mutate_pod(review)
            outcome = "answered"
        except ValueError as e:  # malformed JSON or a review mutate_pod cannot read: the client's fault
            uid = webhook.review_uid(review)
            if uid is None:  # nothing to address an AdmissionReview answer to
                metrics.decision("mutate", "bad_request")
                body = {"Error": f"malformed AdmissionReview: {e}"}
                return Response(to_json(body), 400, media_type="application/json")
            answer = webhook.error_review(uid, f"malformed AdmissionReview: {e}")
            outcome = "bad_request"
        metrics.decision("mutate", outcome)
        metrics.duration.labels("mutate").observe(time.perf_counter() - start)
        return Response(to_json(answer), media_type="application/json")
