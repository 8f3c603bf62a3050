"""GET /healthz (the process answers) and /readyz (the cache finished its first full sync) on the webhook
and metrics listeners; the verbs listener answers the same through its door (`gputopo.extender.verbs.door`)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gputopo.extender.routers.deps import ExtenderDep
from gputopo.extender.verbs.service import HEALTHY

router = APIRouter(tags=["health"])


@router.api_route("/healthz", methods=["GET", "HEAD"])  # HEAD: the same answer, no body
async def healthz() -> Response:
    return Response(HEALTHY, media_type="application/json")


@router.api_route("/readyz", methods=["GET", "HEAD"])
async def readyz(extender: ExtenderDep) -> Response:
    status, body = extender.readiness()
    return Response(body, status_code=status, media_type="application/json")
