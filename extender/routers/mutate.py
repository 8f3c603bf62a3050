"""POST /mutate, the mutating admission webhook (extender/webhook.py), served only on the webhook listener.

A review that cannot be read but carries a readable `request.uid` is answered with an AdmissionReview that
allows the pod unchanged (the webhook never denies); only a body without one gets HTTP 400.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic_core import from_json, to_json

from extender import webhook
from extender.deps import MetricsDep

router = APIRouter(tags=["webhook"])


@router.post("/mutate")
async def mutate(request: Request, metrics: MetricsDep) -> Response:
    start = time.perf_counter()
    review: Any = None
    try:
        # pydantic-core's parser, not json.loads: it stops at 200 levels of nesting with a ValueError
        # where the standard library would exhaust the stack.
        review = from_json(await request.body())
        if not isinstance(review, dict):
            raise ValueError("an AdmissionReview object is expected")
        answer = webhook.mutate_pod(review)
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
