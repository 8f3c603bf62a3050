"""Fuzz: every verb, fed mutated and raw garbage over the real servers and one keep-alive client,
answers below 500 with a JSON body, and the next valid request on the same connection still succeeds.

Examples are few and unshrunk-heavy cases are cheap: the suite runs on a busy 2-core CI. More examples:
GPUTOPO_FUZZ_EXAMPLES=2000 (bench/fuzz.py runs 100,000 cases against the real binary).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.extender.app import create_listeners
from gputopo.extender.main import load_settings
from gputopo.extender.settings import Settings
from gputopo.extender.wire import MAX_CANDIDATE_NODES
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, FakeClock, args, gputopo_pod, lease_obj, node_obj, start_server, sync

EXAMPLES = int(os.environ.get("GPUTOPO_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LIMIT = 256 * 1024  # a small body limit, so the fuzzer can reach it cheaply
NODES = ["h100-a", "l40s-a", "ghost"]
VERBS = ["filter", "prioritize", "bind", "preempt", "mutate"]

# Values the audit found answered with 500, or that probe a bound.
NASTY_STRINGS = ["NaN", "inf", "-inf", "Infinity", "1e400", "-1", "0.5", "2k", "9" * 400, "", "\x00", "80Gi", "é" * 70]
# Raw JSON tokens json.dumps cannot produce: placed where a sentinel string was, after serialising.
RAW_TOKENS = [
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "9" * 400,
    "[" * 5000 + "]" * 5000,
    '{"a":' * 5000 + "1" + "}" * 5000,
]


def _valid(verb: str) -> dict[str, Any]:
    pod = gputopo_pod("p", 4)
    if verb in ("filter", "prioritize"):
        return args(pod, list(NODES))
    if verb == "bind":
        return {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "h100-a"}
    if verb == "preempt":
        return {"Pod": pod, "NodeNameToMetaVictims": {"h100-a": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0}}}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod},
    }


_PROTOCOL_KEYS = {"Pods", "UID", "NumPDBViolations"}


def _lower(body: Any, top: bool = True) -> Any:
    """Old-style lower-case protocol keys (`pod`, `nodenames`); the embedded Pod keeps its own keys."""
    if isinstance(body, dict):
        return {
            (k.lower() if top or k in _PROTOCOL_KEYS else k): _lower(v, False) if k != "Pod" else v
            for k, v in body.items()
        }
    if isinstance(body, list):
        return [_lower(v, False) for v in body]
    return body


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _set(root: Any, path: tuple[Any, ...], new: Any, delete: bool) -> Any:
    if not path:
        return new
    parent = root
    for p in path[:-1]:
        parent = parent[p]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return root


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and the infinities included: json.dumps writes NaN / Infinity
    st.text(max_size=12),
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from([f"__raw{i}__" for i in range(len(RAW_TOKENS))]),
)
json_values = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=10), inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn, verb: str, lower: bool) -> bytes:
    body = _valid(verb)
    if lower:
        body = _lower(body)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        path = draw(st.sampled_from(paths))
        body = _set(body, path, draw(json_values), delete=draw(st.booleans()))
    text = json.dumps(body)
    for i, token in enumerate(RAW_TOKENS):
        text = text.replace(f'"__raw{i}__"', token)
    return text.encode()


@st.composite
def garbage(draw: st.DrawFn, verb: str) -> bytes:
    valid = json.dumps(_valid(verb)).encode()
    choice = draw(st.integers(0, 2))
    if choice == 0:
        return draw(st.binary(max_size=64))
    if choice == 1:
        return valid[: draw(st.integers(0, len(valid)))]  # truncated mid-document
    return draw(st.sampled_from(RAW_TOKENS)).encode()


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[str, httpx.Client]]:
    """One keep-alive client per listener: the verbs app, and the webhook app (/mutate) over plain HTTP, since
    TLS is not what this suite exercises (tests/extender/http/test_listeners.py serves it over TLS)."""
    source, clock = FakeSource(NS), FakeClock()
    listeners = create_listeners(
        Settings(namespace=NS, max_request_bytes=LIMIT, log_level="critical"),
        cluster=source,
        clock=clock,
        watch=False,
    )
    for node in (node_obj("h100-a"), node_obj("l40s-a", "l40s-4")):
        source.put("nodes", node)
        source.put("leases", lease_obj(node["metadata"]["name"], clock.now))
    sync(listeners.cache, source)
    started = {name: start_server(app) for name, app in (("verbs", listeners.door), ("webhook", listeners.webhook))}
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(httpx.Client(base_url=url, timeout=10)) for name, (_, _, url) in started.items()
        }
    for server, thread, _ in started.values():
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def client(clients: dict[str, httpx.Client]) -> httpx.Client:
    return clients["verbs"]


@pytest.fixture(scope="module")
def webhook_client(clients: dict[str, httpx.Client]) -> httpx.Client:
    return clients["webhook"]


def _peer(r: httpx.Response) -> Any:
    return r.extensions["network_stream"].get_extra_info("client_addr")


def _check(clients: dict[str, httpx.Client], verb: str, body: bytes) -> None:
    client = clients["webhook" if verb == "mutate" else "verbs"]
    r = client.post(f"/{verb}", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300])
    answer = r.json()  # a JSON body, whatever the status
    if r.status_code == 400:
        assert isinstance(answer, dict) and answer["Error"], answer
    if verb == "mutate":
        again = client.post("/mutate", json=_valid("mutate"))
        assert again.status_code == 200 and again.json()["response"]["allowed"] is True, again.text[:300]
    else:
        again = client.post("/filter", json=args(gputopo_pod("probe", 1), ["h100-a"]))
        assert again.status_code == 200 and again.json()["Error"] == "", again.text[:300]
    if r.status_code != 413:  # 413 closes the connection on purpose: its body was never read
        assert _peer(again) == _peer(r), "the server dropped the keep-alive connection"


@pytest.mark.parametrize("lower", [False, True], ids=["go-cased", "lower-cased"])
@pytest.mark.parametrize("verb", VERBS)
def test_mutated_requests_get_a_json_answer_below_500_and_keep_the_connection(
    clients: dict[str, httpx.Client], verb: str, lower: bool
) -> None:
    @FUZZ
    @given(body=mutated(verb, lower))
    def run(body: bytes) -> None:
        _check(clients, verb, body)

    run()


@pytest.mark.parametrize("verb", VERBS)
def test_raw_garbage_gets_a_json_answer_below_500_and_keeps_the_connection(
    clients: dict[str, httpx.Client], verb: str
) -> None:
    @FUZZ
    @given(body=garbage(verb))
    def run(body: bytes) -> None:
        _check(clients, verb, body)

    run()


def _pod_with_gpus(raw: str) -> bytes:
    """A filter request whose container asks for `raw` GPUs, spliced in as raw JSON text."""
    body = json.dumps(args(gputopo_pod("p", 4), ["h100-a"]))
    return body.replace('"nvidia.com/gpu": "4"', f'"nvidia.com/gpu": {raw}', 1).encode()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (_pod_with_gpus('"NaN"'), "containers[0].resources.limits.nvidia.com/gpu"),
        (_pod_with_gpus("NaN"), "containers[0].resources.limits.nvidia.com/gpu"),
        (_pod_with_gpus('"inf"'), "containers[0].resources.limits.nvidia.com/gpu"),
        (_pod_with_gpus("1e400"), "containers[0].resources.limits.nvidia.com/gpu"),
        (_pod_with_gpus('"1e400"'), "out of range"),
        (_pod_with_gpus('"' + "9" * 400 + '"'), "containers[0].resources.limits.nvidia.com/gpu"),
        (_pod_with_gpus('"-1"'), "non-negative"),
        (_pod_with_gpus('"500m"'), "whole"),
        (_pod_with_gpus("true"), "not a Kubernetes quantity"),
        (json.dumps({"Pod": {"metadata": {"name": "p"}, "spec": {"containers": "x"}}}).encode(), "Pod.spec.containers"),
        (json.dumps({"Pod": {"metadata": {"name": "p"}, "spec": {"containers": [1]}}}).encode(), "containers[0]"),
        (json.dumps({"Pod": {"metadata": [1]}}).encode(), "Pod.metadata"),
        (json.dumps({"Pod": {"metadata": {"name": "p", "annotations": {"a": 1}}}}).encode(), "annotations"),
        (json.dumps({"Pod": {"metadata": {"name": "p"}, "status": "x"}}).encode(), "Pod.status"),
        (
            json.dumps({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{"metadata": [1]}]}}).encode(),
            "items[0]",
        ),
        (b'{"Pod":' * 5000 + b"1" + b"}" * 5000, "not valid JSON"),
    ],
    ids=[
        "GPU count string NaN",
        "GPU count literal NaN",
        "GPU count inf",
        "GPU count literal 1e400",
        "GPU count string 1e400",
        "GPU count of 400 digits",
        "negative GPU count",
        "fractional GPU count",
        "GPU count boolean",
        "containers not a list",
        "container not an object",
        "metadata not an object",
        "annotation value not a string",
        "status not an object",
        "node item metadata not an object",
        "nesting 5000 deep",
    ],
)
def test_what_the_audit_answered_with_500_gets_400_naming_the_field(
    client: httpx.Client, body: bytes, needle: str
) -> None:
    for verb in ("filter", "prioritize"):
        r = client.post(f"/{verb}", content=body)
        assert r.status_code == 400, r.text
        assert needle in r.json()["Error"]


def test_a_body_over_the_limit_is_refused_with_413_by_its_declared_length(client: httpx.Client) -> None:
    r = client.post("/filter", content=b" " * (LIMIT + 1))
    assert r.status_code == 413
    assert "larger than" in r.json()["Error"]
    assert client.post("/filter", json=args(gputopo_pod("p", 1), ["h100-a"])).status_code == 200


def test_a_chunked_body_is_counted_as_it_streams_and_refused_past_the_limit(client: httpx.Client) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(64):  # 4 MiB offered, 16x the limit
            sent += 1
            yield b" " * 65536

    r = client.post("/filter", content=chunks())
    assert r.status_code == 413
    assert client.post("/filter", json=args(gputopo_pod("p", 1), ["h100-a"])).status_code == 200


def test_a_chunked_body_under_the_limit_is_parsed(client: httpx.Client) -> None:
    body = json.dumps(args(gputopo_pod("p", 1), ["h100-a"])).encode()
    r = client.post("/filter", content=iter([body[:10], body[10:]]))
    assert r.status_code == 200 and r.json()["NodeNames"] == ["h100-a"]


@pytest.mark.parametrize(
    ("body", "status", "uid"),
    [
        (json.dumps({"request": {"uid": "u-9", "object": "not a pod"}}).encode(), 200, "u-9"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "u-8"}}).encode(), 200, "u-8"),
        (json.dumps({"request": {"uid": "u-7", "object": {"metadata": {"annotations": 5}}}}).encode(), 200, "u-7"),
        (b'{"request":' * 5000 + b"1" + b"}" * 5000, 400, None),
        (b"[]", 400, None),
        (json.dumps({"request": {"uid": 5}}).encode(), 400, None),
    ],
    ids=[
        "object not a pod",
        "v1beta1 review",
        "annotations not an object",
        "nesting 5000 deep",
        "not an object",
        "uid not a string",
    ],
)
def test_mutate_answers_garbage_with_an_allowed_admission_review_when_the_uid_is_readable(
    webhook_client: httpx.Client, body: bytes, status: int, uid: str | None
) -> None:
    r = webhook_client.post("/mutate", content=body)
    assert r.status_code == status, r.text
    out = r.json()
    if uid is None:
        assert "malformed AdmissionReview" in out["Error"]
        return
    response = out["response"]
    assert response["uid"] == uid
    assert response["allowed"] is True  # the webhook never denies
    assert "patch" not in response
    if response.get("status"):
        assert response["status"]["code"] == 400 and response["status"]["message"]
        assert all(len(w) <= 120 for w in response["warnings"])


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_open(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr("gputopo.extender.verbs.door.pod_info", boom)
    r = client.post("/filter", json=args(gputopo_pod("p", 1), ["h100-a"]))
    assert r.status_code == 500
    assert r.json() == {"Error": "internal: RuntimeError: bug"}
    monkeypatch.undo()
    again = client.post("/filter", json=args(gputopo_pod("p", 1), ["h100-a"]))
    assert again.status_code == 200 and _peer(again) == _peer(r)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, 8 * 1024 * 1024),
        ([], {"GPUTOPO_MAX_REQUEST_BYTES": "1048576"}, 1024 * 1024),
        (["--max-request-bytes", "2097152"], {"GPUTOPO_MAX_REQUEST_BYTES": "1048576"}, 2 * 1024 * 1024),
    ],
    ids=["default 8 MiB", "from the environment", "the flag wins"],
)
def test_the_body_limit_is_a_setting(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], expected: int
) -> None:
    monkeypatch.delenv("GPUTOPO_MAX_REQUEST_BYTES", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert load_settings(argv).max_request_bytes == expected


@pytest.mark.parametrize("value", [0, 1023, 2 * 1024**3], ids=["zero", "under 64 KiB", "over 1 GiB"])
def test_an_unusable_body_limit_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="max_request_bytes"):
        Settings(max_request_bytes=value)


@pytest.mark.parametrize("key", ["NodeNames", "Nodes"], ids=["node names", "node objects"])
def test_more_candidate_nodes_than_any_cluster_has_get_400(env: Env, key: str) -> None:
    names = [f"n{i}" for i in range(MAX_CANDIDATE_NODES + 1)]
    value: Any = names if key == "NodeNames" else {"items": [{"metadata": {"name": n}} for n in names]}
    r = env.call("filter", {"Pod": gputopo_pod("p", 1), key: value})
    assert r.status == 400
    assert f"at most {MAX_CANDIDATE_NODES} items" in r.json()["Error"]
