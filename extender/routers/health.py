"""GET /healthz (the process answers), /readyz (the cache finished its first full sync), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic_core import to_json

from extender.deps import ExtenderDep, MetricsDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/readyz")
async def readyz(extender: ExtenderDep) -> Response:
    cache = extender.cache
    if cache.ready:
        return Response(to_json({"status": "ready", "nodes": len(cache.nodes)}), media_type="application/json")
    body = {"status": "syncing", "synced": sorted(cache.synced)}
    return Response(to_json(body), status_code=503, media_type="application/json")


@router.get("/metrics")
async def metrics(m: MetricsDep, extender: ExtenderDep) -> Response:
    m.cache_nodes.set(len(extender.cache.nodes))
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
