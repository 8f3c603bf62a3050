"""POST /mutate, the mutating admission webhook (extender/webhook.py), served only on the webhook listener.

A review that cannot be read but carries a readable `request.uid` is answered with an AdmissionReview that
allows the pod unchanged (an unreadable review never denies a pod); only a body without one gets HTTP 400.

With `--dra` the pod's claim template is ensured in its namespace (extender/claimtemplates.py, on a worker
thread: it is a call to the API server) before the answer goes out, except on a dry run; a template that
cannot be ensured refuses the pod with the reason, since its claim could never be made.
"""

from __future__ import annotations

import time
from typing import Any, cast

from fastapi import APIRouter, Request, Response
from pydantic_core import from_json, to_json
from starlette.concurrency import run_in_threadpool

from extender import webhook
from extender.claimtemplates import ClaimTemplates, TemplateConflict
from extender.deps import ExtenderDep, MetricsDep
from extender.kube import KubeSource
from extender.service import Extender
from extender.settings import Settings
from gputopo.kube import KubeError

router = APIRouter(tags=["webhook"])


def claim_templates(request: Request, extender: Extender) -> ClaimTemplates | None:
    """The app's template store: `app.state.claim_templates` when set (tests set a fake), else one over
    the extender's own API client, made once; None without an API server (snapshot mode)."""
    state = request.app.state
    templates = getattr(state, "claim_templates", None)
    if templates is None and isinstance(extender.source, KubeSource):
        templates = state.claim_templates = ClaimTemplates(extender.source.api)
    return cast(ClaimTemplates | None, templates)


async def _ensure(request: Request, extender: Extender, admission: webhook.Admission) -> dict[str, Any]:
    template = admission.template
    if template is None or admission.dry_run:  # a dry run persists nothing, so nothing is made for it
        return admission.answer
    templates = claim_templates(request, extender)
    if templates is None:
        return webhook.refusal(admission.uid, "DRA claims need the API server (the extender runs from a snapshot)", 503)
    try:
        await run_in_threadpool(templates.ensure, admission.namespace, template)
    except TemplateConflict as e:
        return webhook.refusal(admission.uid, str(e), 409)
    except KubeError as e:
        where = f"{admission.namespace}/{template.name}"
        why = f"{e.reason or e.status or 'unreachable'}: {e.message}"[:200]
        return webhook.refusal(admission.uid, f"cannot ensure ResourceClaimTemplate {where}: {why}", 503)
    return admission.answer


@router.post("/mutate")
async def mutate(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    start = time.perf_counter()
    review: Any = None
    settings = cast(Settings, request.app.state.settings)
    dra = webhook.DraMode(list_attributes=settings.dra_list_attributes) if settings.dra else None
    try:
        # pydantic-core's parser, not json.loads: it stops at 200 levels of nesting with a ValueError
        # where the standard library would exhaust the stack.
        review = from_json(await request.body())
        if not isinstance(review, dict):
            raise ValueError("an AdmissionReview object is expected")
        admission = webhook.admit_pod(review, dra=dra)
        answer = await _ensure(request, extender, admission)
        outcome = "answered" if answer["response"]["allowed"] else "refused"
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
