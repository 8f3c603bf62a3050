"""The extender verbs kube-scheduler calls: POST /filter, /prioritize, /bind, /preempt (the verbs listener).

Every decision runs on a worker thread (`run_in_threadpool`): the event loop stays free for the health
endpoints, the other listeners and the next request while a large filter call is evaluated.

Filter and prioritize bodies as kube-scheduler sends them (Go-cased keys, `NodeNames`) are decoded by
orjson and only the fields the decision reads are checked (`wire.fast_extender_args`, `wire.pod_info`);
any other body is parsed by pydantic-core (both key casings, `Nodes` objects). Answers are encoded by
orjson, with the Go field names: a 5,000-entry FailedNodes map costs about a fifth of pydantic-core's
time. A request that does not have the protocol's shape gets HTTP 400 naming the problem; anything
unexpected after that is caught and reported in the `Error` field (filter, bind) or as neutral scores
(prioritize): never a 500. The service and metrics are read from `app.state` directly (no dependency
injection per call: it is a measurable share of a request at thousands of calls per second).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool

from extender.metrics import Metrics
from extender.service import NEUTRAL_SCORE, Extender
from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderPreemptionArgs,
    PodInfo,
    WireError,
    fast_extender_args,
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
    try:
        data = orjson.dumps(body)
    except TypeError:  # an integer past 64 bits echoed from a request's Node objects: pydantic-core takes it
        data = to_json(body)
    return Response(data, status_code=status, media_type="application/json")


class _HostScores(dict[str, orjson.Fragment]):
    """`{"Host":<name>,"Score":<score>}` per node name for one score, encoded once: a prioritize answer
    for thousands of nodes is then orjson writing cached fragments (a fifth of the time of encoding a
    dict per node on every call). Names come from requests (only kube-scheduler's: the verbs listener is
    loopback-only), so each cache is bounded: cleared when full; the largest clusters have 65,000 nodes,
    and kube-scheduler names the same nodes call after call."""

    LIMIT = 70_000

    def __init__(self, score: int) -> None:
        super().__init__()
        self.score = score

    def __missing__(self, name: str) -> orjson.Fragment:
        if len(self) >= self.LIMIT:
            self.clear()
        fragment = self[name] = orjson.Fragment(orjson.dumps({"Host": name, "Score": self.score}))
        return fragment


_HOST_SCORES = {s: _HostScores(s) for s in range(11)}  # extender scores are 0..10 (MaxExtenderPriority)


def _priorities(names: Sequence[str], scores: list[int]) -> bytes:
    """The HostPriorityList `[{"Host": name, "Score": score}, ...]`, as orjson would encode it."""
    try:
        # Two C-level lookups per node: the cache of its score, then its name's fragment in it.
        return orjson.dumps(list(map(operator.getitem, map(_HOST_SCORES.__getitem__, scores), names)))
    except (KeyError, TypeError):  # a score outside 0..10 (never expected): encode it plainly
        return orjson.dumps([{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)])


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
    args = fast_extender_args(await request.body())
    if args is None:
        args = await _parse(request, ExtenderArgs)
    return args, args.candidate_names(), pod_info(args.pod)


def _state(request: Request) -> tuple[Extender, Metrics]:
    state = request.app.state
    return cast(Extender, state.extender), cast(Metrics, state.metrics)


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


class _Timed:
    """One call's duration and bytes in and out (the throughput benchmark reports bytes per call),
    recorded by `await done(request, answer)`, which returns the answer."""

    __slots__ = ("metrics", "start", "verb")

    def __init__(self, metrics: Metrics, verb: str) -> None:
        self.metrics, self.verb, self.start = metrics, verb, time.perf_counter()

    async def __call__(self, request: Request, answer: Response) -> Response:
        m, verb = self.metrics, self.verb
        m.durations[verb].observe(time.perf_counter() - self.start)
        m.bytes_in[verb].inc(len(await request.body()))
        m.bytes_out[verb].inc(len(answer.body))
        return answer


def _timed(metrics: Metrics, verb: str) -> _Timed:
    return _Timed(metrics, verb)


async def filter_(request: Request) -> Response:
    extender, metrics = _state(request)
    done = _timed(metrics, "filter")
    try:
        args, names, info = await _scheduling_args(request)
    except (BadRequest, WireError) as e:
        return await done(request, _bad("filter", metrics, e))
    if not extender.cache.ready:
        empty: dict[str, Any] = {"NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}}
        return await done(request, _not_ready("filter", metrics, empty))
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
    return await done(request, _json(body))


async def prioritize(request: Request) -> Response:
    extender, metrics = _state(request)
    done = _timed(metrics, "prioritize")
    try:
        _, names, info = await _scheduling_args(request)
    except (BadRequest, WireError) as e:
        return await done(request, _bad("prioritize", metrics, e))
    try:
        hosts, scores, d = await run_in_threadpool(extender.prioritize, info, names)
        data = _priorities(hosts, scores)
        metrics.decision("prioritize", "pass_through" if d.kind == "pass_through" else "scored", d.reason_label())
    except Exception:
        log.exception("prioritize failed; neutral scores", extra={"verb": "prioritize", "pod": info.ref})
        metrics.decision("prioritize", "error")
        data = _priorities(names, [NEUTRAL_SCORE] * len(names))
    return await done(request, Response(data, media_type="application/json"))


async def bind(request: Request) -> Response:
    extender, metrics = _state(request)
    done = _timed(metrics, "bind")
    try:
        args = await _parse(request, ExtenderBindingArgs)
    except BadRequest as e:
        return await done(request, _bad("bind", metrics, e))
    if not extender.cache.ready:
        return await done(request, _not_ready("bind", metrics, {}))
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
    return await done(request, _json({"Error": error}))


async def preempt(request: Request) -> Response:
    extender, metrics = _state(request)
    done = _timed(metrics, "preempt")
    try:
        args = await _parse(request, ExtenderPreemptionArgs)
        pod_info(args.pod)
    except (BadRequest, WireError) as e:
        return await done(request, _bad("preempt", metrics, e))
    try:
        kept = await run_in_threadpool(extender.preempt, args)
    except Exception:
        log.exception("preempt failed; candidates unchanged", extra={"verb": "preempt"})
        kept = args.meta_victims()
    metrics.decision("preempt", "answered")
    return await done(request, _json({"NodeNameToMetaVictims": {n: v.to_wire() for n, v in kept.items()}}))


# Plain Starlette routes: the verbs read the Request themselves, so FastAPI's per-call dependency and
# parameter machinery (a measurable share of a request at three calls per scheduled pod) is skipped.
for _path, _endpoint in (("/filter", filter_), ("/prioritize", prioritize), ("/bind", bind), ("/preempt", preempt)):
    router.add_route(_path, _endpoint, methods=["POST"])
