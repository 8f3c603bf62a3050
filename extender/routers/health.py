"""GET /healthz (the process answers) and /readyz (the cache finished its first full sync), on every listener.

`readiness` is also what the verbs listener's own server answers (`extender.verbserver`)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic_core import to_json

from extender.deps import ExtenderDep
from extender.service import Extender

router = APIRouter(tags=["health"])

HEALTHY = b'{"status":"ok"}'


def readiness(extender: Extender) -> tuple[int, bytes]:
    cache = extender.cache
    if cache.ready:
        return 200, to_json({"status": "ready", "nodes": len(cache.nodes)})
    return 503, to_json({"status": "syncing", "synced": sorted(cache.synced)})


@router.api_route("/healthz", methods=["GET", "HEAD"])  # HEAD: the same answer, no body
async def healthz() -> Response:
    return Response(HEALTHY, media_type="application/json")


@router.api_route("/readyz", methods=["GET", "HEAD"])
async def readyz(extender: ExtenderDep) -> Response:
    status, body = readiness(extender)
    return Response(body, status_code=status, media_type="application/json")
