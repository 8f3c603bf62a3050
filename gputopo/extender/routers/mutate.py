"""POST /mutate, the mutating admission webhook (gputopo/extender/webhook/mutation.py), served only on the webhook
listener.

With `--webhook-client-ca-file` only a caller whose verified client certificate names one of
`--webhook-client-names` is answered (gputopo/extender/http/clientauth.py): the API server. Anyone else gets 401 or 403
with a JSON body saying why, from the request head, before the body is read (gputopo/extender/http/heads.py).

The review is parsed and read on the app's review workers (gputopo/extender/http/workers.py: 2 threads, at most 256
reviews queued in all and 64 per client address unless the caller proved it is the API server, past which 503 at
once, served round-robin by address), never on the event loop that answers the listener's probes.

A review that cannot be read but carries a readable `request.uid` is answered with an AdmissionReview that
allows the pod unchanged (an unreadable review never denies a pod); only a body without one gets HTTP 400.

With `--dra` the answer names the pod's claim template; the webhook writes nothing. It reads the template
(gputopo/extender/webhook/claimtemplates.py, on a worker thread) and refuses the pod when one of that name holds another
spec; the template itself is created by the extender once the pod exists (`TemplateKeeper`), so a forged
review, or a pod the API server refuses after this answer, leaves nothing behind.
"""

from __future__ import annotations

import time
from typing import Any, cast

from fastapi import APIRouter, Request, Response
from pydantic_core import from_json, to_json
from starlette.concurrency import run_in_threadpool

from gputopo.extender.http.clientauth import ClientAuth
from gputopo.extender.http.workers import BoundedWorkers, Busy
from gputopo.extender.routers.deps import ExtenderDep, MetricsDep
from gputopo.extender.settings import Settings
from gputopo.extender.verbs.service import Extender
from gputopo.extender.watch.source import KubeSource
from gputopo.extender.webhook import mutation
from gputopo.extender.webhook.claimtemplates import ClaimTemplates, TemplateConflict
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


async def _check(request: Request, extender: Extender, admission: mutation.Admission) -> dict[str, Any]:
    template = admission.template
    if template is None:
        return admission.answer
    templates = claim_templates(request, extender)
    if templates is None:
        return mutation.refusal(
            admission.uid, "DRA claims need the API server (the extender runs from a snapshot)", 503
        )
    try:
        await run_in_threadpool(templates.check, admission.namespace, template)
    except TemplateConflict as e:
        return mutation.refusal(admission.uid, str(e), 409)
    except KubeError as e:
        where = f"{admission.namespace}/{template.name}"
        why = f"{e.reason or e.status or 'unreachable'}: {e.message}"[:200]
        return mutation.refusal(admission.uid, f"cannot read ResourceClaimTemplate {where}: {why}", 503)
    return admission.answer


def _client_auth(request: Request) -> ClientAuth | None:
    """Who may call /mutate (`app.state.guarded`, set by gputopo.extender.app); the listener's server already
    refused anyone else from the request head, before the body: this holds for an app served another way."""
    guarded = getattr(request.app.state, "guarded", {})
    return cast(ClientAuth | None, guarded.get("/mutate"))


def review_workers(request: Request) -> BoundedWorkers:
    """The app's review workers, made once (`gputopo.extender.http.workers`)."""
    state = request.app.state
    workers = getattr(state, "review_workers", None)
    if workers is None:
        workers = state.review_workers = BoundedWorkers()
    return cast(BoundedWorkers, workers)


def _read(
    body: bytes, scheduler_name: str, dra: mutation.DraMode | None, group_gate: bool
) -> tuple[Any, mutation.Admission | ValueError]:
    """The review and what to admit, or the ValueError saying why it cannot be read (on a worker thread)."""
    review: Any = None
    try:
        # pydantic-core's parser, not json.loads: it stops at 200 levels of nesting with a ValueError
        # where the standard library would exhaust the stack.
        review = from_json(body)
        if not isinstance(review, dict):
            raise ValueError("an AdmissionReview object is expected")
        return review, mutation.admit_pod(review, scheduler_name, dra=dra, group_gate=group_gate)
    except ValueError as e:
        return review, e


@router.post("/mutate")
async def mutate(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    start = time.perf_counter()
    settings = cast(Settings, request.app.state.settings)
    auth = _client_auth(request)
    refused = auth.refusal(request.scope) if auth is not None else None
    if refused is not None:
        metrics.decision("mutate", "unauthenticated" if refused[0] == 401 else "forbidden")
        return Response(to_json({"Error": refused[1]}), refused[0], media_type="application/json")
    dra = (
        mutation.DraMode(
            list_attributes=settings.dra_list_attributes,
            memory_classes=settings.memory_classes,
            blocks=settings.dra_blocks,
        )
        if settings.dra
        else None
    )
    body = await request.body()
    peer = request.client.host if request.client is not None else "?"
    try:
        # Parsed off the loop, which answers this listener's probes; bounded in all and, unless the caller
        # proved it is the API server, per address.
        review, admission = await review_workers(request).run(
            peer, lambda: _read(body, settings.scheduler_name, dra, settings.group_gate), trusted=auth is not None
        )
    except Busy as e:
        metrics.decision("mutate", "busy")
        return Response(to_json({"Error": f"webhook busy: {e}"}), 503, media_type="application/json")
    if isinstance(admission, ValueError):  # malformed JSON or a review mutate_pod cannot read: the client's fault
        uid = mutation.review_uid(review)
        if uid is None:  # nothing to address an AdmissionReview answer to
            metrics.decision("mutate", "bad_request")
            error = {"Error": f"malformed AdmissionReview: {admission}"}
            return Response(to_json(error), 400, media_type="application/json")
        answer = mutation.error_review(uid, f"malformed AdmissionReview: {admission}")
        outcome = "bad_request"
    else:
        answer = await _check(request, extender, admission)
        outcome = "answered" if answer["response"]["allowed"] else "refused"
    metrics.decision("mutate", outcome)
    metrics.duration.labels("mutate").observe(time.perf_counter() - start)
    return Response(to_json(answer), media_type="application/json")
