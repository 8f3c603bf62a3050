"""The one door into the verbs: `Door.answer(verb, body) -> (status, JSON bytes)`.

kube-scheduler's calls (filter, prioritize, bind, preempt) and the health answers (healthz, readyz) of the
verbs listener all go through `answer`, and nothing else reaches them: the verbs server
(`gputopo.extender.http.verbserver`) only frames HTTP around it, and the unit tests call it directly. `route` maps an
HTTP method and path to a verb (or to the 404 or 405 answer); `pool_for` says where a verb runs (the
decisions' workers, the binds' workers, or the server's loop); `after` and `ready` are the
prioritize-ahead memory's two hooks (`gputopo.extender.verbs.ahead`), called by the server on its loop.

Filter and prioritize bodies as kube-scheduler sends them (Go-cased keys, `NodeNames`) are decoded by
orjson and only the fields the decision reads are checked (`wire.fast_extender_args`, `wire.pod_info`);
any other body is parsed by pydantic-core (both key casings, `Nodes` objects). A filter whose node names
repeat an earlier body's decodes only its Pod, and one reason told on every node is encoded once
(`gputopo.extender.verbs.repeats`: the same bytes, less work). Answers are encoded by orjson, with the Go
field names. A request that does not have the protocol's shape gets HTTP 400 naming
the problem; anything unexpected after that is caught and reported in the `Error` field (filter, bind) or
as neutral scores (prioritize): never a 500.

Two answers carry less than every node, with the same effect on kube-scheduler (docs/extender.md):
- filter names why nodes failed only when none passed: kube-scheduler reads the failure maps only to
  explain an unschedulable pod (its FailedScheduling message, and preemption's candidates);
- prioritize scores nodes relative to the lowest score, and leaves out the nodes at it: kube-scheduler adds
  an extender's score to each listed node's total and nothing to an unlisted one, so the same amount taken
  off every node leaves its choice unchanged.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import compress, repeat
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from gputopo.extender.metrics import Metrics
from gputopo.extender.settings import DEFAULT_MAX_REQUEST_BYTES
from gputopo.extender.verbs.repeats import RepeatedNames, SameReason
from gputopo.extender.verbs.service import HEALTHY, NEUTRAL_SCORE, Extender
from gputopo.extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderPreemptionArgs,
    PodInfo,
    WireError,
    fast_extender_args,
    pod_info,
)

log = logging.getLogger("gputopo.extender.http")
M = TypeVar("M", bound=BaseModel)

Answer = tuple[int, bytes]  # HTTP status, JSON body


class BadRequest(Exception):
    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


def _json(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # an integer past 64 bits echoed from a request's Node objects: pydantic-core takes it
        return to_json(body)


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
    """The HostPriorityList `[{"Host": name, "Score": score}, ...]` relative to the lowest score: nodes at
    it are left out and the rest lowered by it (the module doc says why kube-scheduler decides the same)."""
    lowest = min(scores, default=0)
    if lowest:
        scores = list(map(operator.sub, scores, repeat(lowest)))
    above = list(map(bool, scores))  # C-level: which nodes stay
    kept_names, kept_scores = list(compress(names, above)), list(compress(scores, above))
    try:
        # Two C-level lookups per node: the cache of its score, then its name's fragment in it.
        return orjson.dumps(list(map(operator.getitem, map(_HOST_SCORES.__getitem__, kept_scores), kept_names)))
    except (KeyError, TypeError):  # a score outside 0..10 (never expected): encode it plainly
        return orjson.dumps([{"Host": n, "Score": s} for n, s in zip(kept_names, kept_scores, strict=True)])


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


def _parse(body: bytes, model: type[M]) -> M:
    if not body.strip():
        raise BadRequest("request body is empty")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise BadRequest(_describe(e)) from None


def _scheduling_args(body: bytes, repeated: RepeatedNames | None = None) -> tuple[ExtenderArgs, list[str], PodInfo]:
    """What filter and prioritize both read: the args, the candidate node names, the pod; `repeated`: the
    node names of earlier bodies (gputopo.extender.verbs.repeats)."""
    args = repeated.decode(body) if repeated is not None else None
    if args is None:
        args = fast_extender_args(body)
    if args is None:
        args = _parse(body, ExtenderArgs)
    return args, args.candidate_names(), pod_info(args.pod)


def _bad(verb: str, metrics: Metrics, err: BadRequest | WireError) -> Answer:
    text = err.message if isinstance(err, BadRequest) else str(err)
    metrics.decision(verb, "bad_request")
    log.warning("malformed request", extra={"verb": verb, "error": text})
    return 400, _json({"Error": text})


# Before the first full list of nodes, pods and Leases the ledger lacks placements: a filter or bind then
# could hand out GPUs that bound pods hold. kube-scheduler retries a pod whose filter or bind reports an error.
NOT_READY = "gputopo-extender is not ready: its cache has not finished listing nodes, pods and Leases yet"


def _not_ready(verb: str, metrics: Metrics, body: dict[str, Any]) -> Answer:
    metrics.decision(verb, "not_ready")
    log.warning("not ready", extra={"verb": verb})
    return 200, _json({**body, "Error": NOT_READY})


def _encoded(failures: Mapping[str, str]) -> Mapping[str, str] | orjson.Fragment:
    """A failure map as orjson writes it: one reason on every node is encoded once (`SameReason`)."""
    return failures.fragment if isinstance(failures, SameReason) else failures


def filter_(extender: Extender, metrics: Metrics, body: bytes) -> Answer:
    try:
        args, names, info = _scheduling_args(body, extender.repeated)
    except (BadRequest, WireError) as e:
        return _bad("filter", metrics, e)
    if not extender.cache.ready:
        empty: dict[str, Any] = {"NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}}
        return _not_ready("filter", metrics, empty)
    try:
        answer = extender.filter(info, names, body)
        d = answer.decision
        out: dict[str, Any] = {
            "NodeNames": answer.passed,
            "FailedNodes": _encoded(answer.failed),
            "FailedAndUnresolvableNodes": _encoded(answer.unresolvable),
            "Error": "",
        }
        if args.node_names is None and args.nodes is not None:
            keep = set(answer.passed)
            items = [i for i, n in zip(args.nodes.items or [], names, strict=True) if n in keep]
            out["Nodes"] = {"metadata": args.nodes.metadata or {}, "items": items}
        else:
            out["Nodes"] = None
        outcome = "pass_through" if d.kind == "pass_through" else ("feasible" if answer.passed else "infeasible")
        # Why nothing fits, when nothing does (a pass over every node: not paid when a node passed).
        metrics.decision("filter", outcome, "" if answer.passed else d.reason_label())
        if d.kind != "pass_through" and log.isEnabledFor(logging.DEBUG):
            log.debug("filter", extra={"verb": "filter", "pod": info.ref, "passed": len(answer.passed), "kind": d.kind})
    except Exception as e:
        log.exception("filter failed", extra={"verb": "filter", "pod": info.ref})
        metrics.decision("filter", "error")
        out = {"NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": f"internal: {e}"}
    return 200, _json(out)


def prioritize(extender: Extender, metrics: Metrics, body: bytes) -> Answer:
    try:
        _, names, info = _scheduling_args(body)
    except (BadRequest, WireError) as e:
        return _bad("prioritize", metrics, e)
    try:
        hosts, scores, d = extender.prioritize(info, names)
        data = _priorities(hosts, scores)
        # kube-scheduler asks only about nodes that passed filter: no failure reason to label.
        metrics.decision("prioritize", "pass_through" if d.kind == "pass_through" else "scored")
    except Exception:
        log.exception("prioritize failed; neutral scores", extra={"verb": "prioritize", "pod": info.ref})
        metrics.decision("prioritize", "error")
        data = _priorities(names, [NEUTRAL_SCORE] * len(names))
    return 200, data


def bind(extender: Extender, metrics: Metrics, body: bytes) -> Answer:
    try:
        args = _parse(body, ExtenderBindingArgs)
    except BadRequest as e:
        return _bad("bind", metrics, e)
    if not extender.cache.ready:
        return _not_ready("bind", metrics, {})
    ref = f"{args.pod_namespace}/{args.pod_name}"
    try:
        error = extender.bind(args.pod_namespace, args.pod_name, args.pod_uid, args.node)
    except Exception as e:
        log.exception("bind failed", extra={"verb": "bind", "pod": ref})
        error = f"internal: {e}"
    metrics.decision("bind", "error" if error else "bound")
    if error:
        log.warning("bind refused", extra={"verb": "bind", "pod": ref, "node": args.node, "error": error})
    return 200, _json({"Error": error})


def preempt(extender: Extender, metrics: Metrics, body: bytes) -> Answer:
    try:
        args = _parse(body, ExtenderPreemptionArgs)
        pod_info(args.pod)
    except (BadRequest, WireError) as e:
        return _bad("preempt", metrics, e)
    try:
        kept = extender.preempt(args)
    except Exception:
        log.exception("preempt failed; candidates unchanged", extra={"verb": "preempt"})
        kept = args.meta_victims()
    metrics.decision("preempt", "answered")
    return 200, _json({"NodeNameToMetaVictims": {n: v.to_wire() for n, v in kept.items()}})


def healthz(_extender: Extender) -> Answer:
    return 200, HEALTHY


Verb = Callable[[Extender, Metrics, bytes], Answer]
# The verbs that read a request body (POST): what kube-scheduler calls, on worker threads.
POSTED: dict[str, Verb] = {"filter": filter_, "prioritize": prioritize, "bind": bind, "preempt": preempt}
# GET (and HEAD: the same answer, no body), answered on the server's loop: they must answer while every
# worker is busy with a long decision.
READ: dict[str, Callable[[Extender], Answer]] = {"healthz": healthz, "readyz": Extender.readiness}


def _error(text: str) -> bytes:
    return orjson.dumps({"Error": text})


def _decode_prioritize(body: bytes) -> tuple[PodInfo, list[str]] | None:
    """A prioritize body as the prioritize-ahead memory compares it; None when it is not readable (the
    worker then answers it, with the 400 naming the problem)."""
    try:
        _, names, info = _scheduling_args(body)
    except (BadRequest, WireError):
        return None
    return info, names


class Door:
    """The verbs of one extender (module doc). Decisions and binds run on separate worker pools: binds wait
    on the API server (many at once, since kube-scheduler binds asynchronously), and a filter must not
    queue behind them."""

    def __init__(
        self, extender: Extender, metrics: Metrics, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ) -> None:
        self.extender = extender
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes  # the verbs server refuses larger bodies (413)
        self._pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None

    def answer(self, verb: str, body: bytes) -> Answer:
        """The answer to one call of `verb` with the request body `body` (b"" for healthz and readyz): HTTP
        status and JSON. Runs where `pool_for(verb)` says; an unknown verb gets 404."""
        read = READ.get(verb)
        if read is not None:
            return read(self.extender)
        handler = POSTED.get(verb)
        if handler is None:
            return 404, _error(f"/{verb} is not served on this listener")
        start = time.perf_counter()
        try:
            status, data = handler(self.extender, self.metrics, body)
        except Exception as e:  # the verbs catch their own errors: this is the last resort
            log.exception("unhandled error", extra={"verb": verb})
            status, data = 500, _error(f"internal: {type(e).__name__}: {e}")
        self._count(verb, start, body, data)
        return status, data

    @staticmethod
    def route(method: bytes, path: str) -> str | Answer:
        """The verb a request names, or the answer for one that names none: 404 for an unknown path, 405
        for a verb asked with another method (HEAD is GET without the body, the server's part)."""
        verb = path[1:] if path.startswith("/") else ""
        if verb in POSTED:
            return verb if method == b"POST" else (405, _error(f"{path} takes POST"))
        if verb in READ:
            return verb if method in (b"GET", b"HEAD") else (405, _error(f"{path} takes GET"))
        return 404, _error(f"{path} is not served on this listener")

    @staticmethod
    def reads_body(verb: str) -> bool:
        """Whether `verb` wants its request's body (the server sends 100 Continue only for those)."""
        return verb in POSTED

    def pool_for(self, verb: str) -> ThreadPoolExecutor | None:
        """The worker pool `verb` runs on, None for the loop; the pools start on first use and again after
        `close` (an extender served twice)."""
        if verb in READ:
            return None
        if self._pools is None:
            self._pools = (
                ThreadPoolExecutor(max_workers=4, thread_name_prefix="gputopo-decide"),
                ThreadPoolExecutor(max_workers=8, thread_name_prefix="gputopo-bind"),
            )
        decide, binds = self._pools
        return binds if verb == "bind" else decide

    def close(self) -> None:
        pools, self._pools = self._pools, None
        for pool in pools or ():
            pool.shutdown(wait=False, cancel_futures=True)

    def _count(self, verb: str, start: float, body: bytes, data: bytes) -> None:
        m = self.metrics
        m.durations[verb].observe(time.perf_counter() - start)
        m.bytes_in[verb].inc(len(body))
        m.bytes_out[verb].inc(len(data))

    # ------------------------------------------------------------------ the prioritize-ahead memory's hooks

    def after(self, verb: str) -> None:
        """Called by the server on its loop once a 200 answer to `verb` is written and before it reads the
        next request: after a filter, the prioritize answer for the nodes it passed is computed ahead."""
        if verb == "filter":
            self.extender.ahead.prepare(_priorities)

    def ready(self, verb: str, body: bytes) -> Answer | None:
        """An answer the loop sends at once, without a worker: the prioritize computed ahead, when this is
        the request it was computed for and it still holds (None: hand the call to a worker)."""
        if verb != "prioritize":
            return None
        start = time.perf_counter()
        data = self.extender.ahead.take(body, _decode_prioritize)
        if data is None:
            return None
        self.metrics.decision("prioritize", "scored", "ahead")
        self._count(verb, start, body, data)
        return 200, data
