"""GET /metrics, served only on the metrics listener (`--metrics-port`)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gputopo.extender.routers.deps import ExtenderDep, MetricsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(m: MetricsDep, extender: ExtenderDep) -> Response:
    m.cache_nodes.set(len(extender.cache.nodes))
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
