"""GET /healthz (the process answers) and /readyz (the cache finished its first full sync), on every listener."""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic_core import to_json

from extender.deps import ExtenderDep

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
