"""POST /mutate, the mutating admission webhook (gputopo/extender/webhook.py), served only on the webhook listener.

With `--webhook-client-ca-file` only a caller whose verified client certificate names one of
`--webhook-client-names` is answered (gputopo/extender/clientauth.py): the API server. Anyone else gets 401 or 403
with a JSON body saying why, before the body is read.

A review that cannot be read but carries a readable `request.uid` is answered with an AdmissionReview that
allows the pod unchanged (an unreadable review never denies a pod); only a body without one gets HTTP 400.

With `--dra` the answer names the pod's claim template; the webhook writes nothing. It reads the template
(gputopo/extender/claimtemplates.py, on a worker thread) and refuses the pod when one of that name holds another
spec; the template itself is created by the extender once the pod exists (`TemplateKeeper`), so a forged
review, or a pod the API server refuses after this answer, leaves nothing behind.
"""

from __future__ import annotations

import time
from typing import Any, cast

from fastapi import APIRouter, Request, Response
from pydantic_core import from_json, to_json
from starlette.concurrency import run_in_threadpool

from gputopo.extender import webhook
from gputopo.extender.claimtemplates import ClaimTemplates, TemplateConflict
from gputopo.extender.clientauth import ClientAuth
from gputopo.extender.deps import ExtenderDep, MetricsDep
from gputopo.extender.kube import KubeSource
from gputopo.extender.service import Extender
from gputopo.extender.settings import Settings
from gputopo.kube import KubeError

router = APIRouter(tags=["webhook"])


def claim_templates(request: Request, extender: Extender) -> ClaimTemplates | None:
    """The app's template reader: `app.state.claim_templates` when set (tests set a fake), else one over
    the extender's own API client, made once; None without an API server (snapshot mode)."""
    state = request.app.state
    templates = getattr(state, "claim_templates", None)
    if templates is None and isinstance(extender.source, KubeSource):
        templates = state.claim_templates = ClaimTemplates(extender.source.api)
    return cast(ClaimTemplates | None, templates)


async def _check(request: Request, extender: Extender, admission: webhook.Admission) -> dict[str, Any]:
    template = admission.template
    if template is None:
        return admission.answer
    templates = claim_templates(request, extender)
    if templates is None:
        return webhook.refusal(admission.uid, "DRA claims need the API server (the extender runs from a snapshot)", 503)
    try:
        await run_in_threadpool(templates.check, admission.namespace, template)
    except TemplateConflict as e:
        return webhook.refusal(admission.uid, str(e), 409)
    except KubeError as e:
        where = f"{admission.namespace}/{template.name}"
        why = f"{e.reason or e.status or 'unreachable'}: {e.message}"[:200]
        return webhook.refusal(admission.uid, f"cannot read ResourceClaimTemplate {where}: {why}", 503)
    return admission.answer


def _client_auth(request: Request, settings: Settings) -> ClientAuth | None:
    state = request.app.state
    auth = getattr(state, "client_auth", None)
    if auth is None and settings.webhook_client_ca_file is not None:
        auth = state.client_auth = ClientAuth.of(settings.client_names)
    return cast(ClientAuth | None, auth)


@router.post("/mutate")
async def mutate(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    start = time.perf_counter()
    review: Any = None
    settings = cast(Settings, request.app.state.settings)
    auth = _client_auth(request, settings)
    refused = auth.refusal(request.scope) if auth is not None else None
    if refused is not None:
        metrics.decision("mutate", "unauthenticated" if refused[0] == 401 else "forbidden")
        return Response(to_json({"Error": refused[1]}), refused[0], media_type="application/json")
    dra = (
        webhook.DraMode(list_attributes=settings.dra_list_attributes, memory_classes=settings.memory_classes)
        if settings.dra
        else None
    )
    try:
        # pydantic-core's parser, not json.loads: it stops at 200 levels of nesting with a ValueError
        # where the standard library would exhaust the stack.
        review = from_json(await request.body())
        if not isinstance(review, dict):
            raise ValueError("an AdmissionReview object is expected")
        admission = webhook.admit_pod(review, settings.scheduler_name, dra=dra, group_gate=settings.group_gate)
        answer = await _check(request, extender, admission)
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
