"""The extender verbs kube-scheduler calls: POST /filter, /prioritize, /bind, /preempt (the verbs listener).

Every decision runs on a worker thread (`run_in_threadpool`): the event loop stays free for the health
endpoints, the other listeners and the next request while a large filter call is evaluated.

Bodies are parsed straight from bytes by pydantic-core (both key casings, `Nodes: null`), and answers
are encoded by pydantic-core too, with the Go field names. A request that does not have the
protocol's shape gets HTTP 400 naming the problem; anything unexpected after that is caught and
reported in the `Error` field (filter, bind) or as neutral scores (prioritize): never a 500.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool

from extender.deps import ExtenderDep, MetricsDep
from extender.metrics import Metrics
from extender.service import NEUTRAL_SCORE
from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderPreemptionArgs,
    PodInfo,
    WireError,
    pod_info,
)

log = logging.getLogger("gputopo.extender.http")
router = APIRouter(tags=["scheduler"])
M = TypeVar("M", bound=BaseModel)


class BadRequest(Exception):
    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


def _json(body: Any, status: int = 200) -> Response:
    return Response(to_json(body), status_code=status, media_type="application/json")


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:3]:
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "json_invalid":
            return f"request body is not valid JSON: {e.get('ctx', {}).get('error', msg)}"
        if e["type"] == "model_type" and not loc:
            return "request body must be a JSON object"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


async def _parse(request: Request, model: type[M]) -> M:
    body = await request.body()
    if not body.strip():
        raise BadRequest("request body is empty")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise BadRequest(_describe(e)) from None


async def _scheduling_args(request: Request) -> tuple[ExtenderArgs, list[str], PodInfo]:
    """What filter and prioritize both read: the args, the candidate node names, the pod."""
    args = await _parse(request, ExtenderArgs)
    return args, args.candidate_names(), pod_info(args.pod)


def _bad(verb: str, metrics: Metrics, err: BadRequest | WireError) -> Response:
    text = err.message if isinstance(err, BadRequest) else str(err)
    metrics.decision(verb, "bad_request")
    log.warning("malformed request", extra={"verb": verb, "error": text})
    return _json({"Error": text}, 400)


T = TypeVar("T")

# Before the first full list of nodes, pods and Leases the ledger lacks placements: a filter or bind then
# could hand out GPUs that bound pods hold. kube-scheduler retries a pod whose filter or bind reports an error.
NOT_READY = "gputopo-extender is not ready: its cache has not finished listing nodes, pods and Leases yet"


def _not_ready(verb: str, metrics: Metrics, body: dict[str, Any]) -> Response:
    metrics.decision(verb, "not_ready")
    log.warning("not ready", extra={"verb": verb})
    return _json({**body, "Error": NOT_READY})


def _timed(metrics: Metrics, verb: str) -> Callable[[], None]:
    start = time.perf_counter()
    return lambda: metrics.duration.labels(verb).observe(time.perf_counter() - start)


@router.post("/filter")
async def filter_(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    done = _timed(metrics, "filter")
    try:
        args, names, info = await _scheduling_args(request)
    except (BadRequest, WireError) as e:
        done()
        return _bad("filter", metrics, e)
    if not extender.cache.ready:
        done()
        return _not_ready("filter", metrics, {"NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}})
    try:
        # The decision is CPU work on worker threads, so /healthz and /readyz answer while it runs.
        answer = await run_in_threadpool(extender.filter, info, names)
        d = answer.decision
        body: dict[str, Any] = {
            "NodeNames": answer.passed,
            "FailedNodes": answer.failed,
            "FailedAndUnresolvableNodes": answer.unresolvable,
            "Error": "",
        }
        if args.node_names is None and args.nodes is not None:
            keep = set(answer.passed)
            items = [i for i, n in zip(args.nodes.items or [], names, strict=True) if n in keep]
            body["Nodes"] = {"metadata": args.nodes.metadata or {}, "items": items}
        else:
            body["Nodes"] = None
        outcome = "pass_through" if d.kind == "pass_through" else ("feasible" if answer.passed else "infeasible")
        metrics.decision("filter", outcome, d.reason_label())
        if d.kind != "pass_through":
            log.debug(
                "filter",
                extra={"verb": "filter", "pod": info.ref, "passed": len(answer.passed), "kind": d.kind},
            )
    except Exception as e:
        log.exception("filter failed", extra={"verb": "filter", "pod": info.ref})
        metrics.decision("filter", "error")
        body = {"NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": f"internal: {e}"}
    done()
    return _json(body)


@router.post("/prioritize")
async def prioritize(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    done = _timed(metrics, "prioritize")
    try:
        _, names, info = await _scheduling_args(request)
    except (BadRequest, WireError) as e:
        done()
        return _bad("prioritize", metrics, e)
    try:
        scores, d = await run_in_threadpool(extender.prioritize, info, names)
        body: list[dict[str, Any]] = [{"Host": n, "Score": s} for n, s in scores]
        metrics.decision("prioritize", "pass_through" if d.kind == "pass_through" else "scored", d.reason_label())
    except Exception:
        log.exception("prioritize failed; neutral scores", extra={"verb": "prioritize", "pod": info.ref})
        metrics.decision("prioritize", "error")
        body = [{"Host": n, "Score": NEUTRAL_SCORE} for n in names]
    done()
    return _json(body)


@router.post("/bind")
async def bind(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    done = _timed(metrics, "bind")
    try:
        args = await _parse(request, ExtenderBindingArgs)
    except BadRequest as e:
        done()
        return _bad("bind", metrics, e)
    if not extender.cache.ready:
        done()
        return _not_ready("bind", metrics, {})
    try:
        error = await run_in_threadpool(extender.bind, args.pod_namespace, args.pod_name, args.pod_uid, args.node)
    except Exception as e:
        log.exception("bind failed", extra={"verb": "bind", "pod": f"{args.pod_namespace}/{args.pod_name}"})
        error = f"internal: {e}"
    metrics.decision("bind", "error" if error else "bound")
    if error:
        log.warning(
            "bind refused",
            extra={"verb": "bind", "pod": f"{args.pod_namespace}/{args.pod_name}", "node": args.node, "error": error},
        )
    done()
    return _json({"Error": error})


@router.post("/preempt")
async def preempt(request: Request, extender: ExtenderDep, metrics: MetricsDep) -> Response:
    done = _timed(metrics, "preempt")
    try:
        args = await _parse(request, ExtenderPreemptionArgs)
        pod_info(args.pod)
    except (BadRequest, WireError) as e:
        done()
        return _bad("preempt", metrics, e)
    try:
        kept = await run_in_threadpool(extender.preempt, args)
    except Exception:
        log.exception("preempt failed; candidates unchanged", extra={"verb": "preempt"})
        kept = args.meta_victims()
    metrics.decision("preempt", "answered")
    done()
    return _json({"NodeNameToMetaVictims": {n: v.to_wire() for n, v in kept.items()}})
