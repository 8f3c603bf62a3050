"""Prioritize answered ahead: the verbs server computes the prioritize answer for the nodes a filter passed
while kube-scheduler runs its own score plugins, and sends it only when it is what prioritize would answer
now. Spoken to over HTTP on the extender's own verbs server, as kube-scheduler does."""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.extender.app import Listeners, create_listeners
from gputopo.extender.settings import Settings
from gputopo.extender.verbs.door import prioritize
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, FakeClock, args, gputopo_pod, lease_obj, node_obj, start_server, sync

# Three kinds of node, so prioritize answers carry different scores; dgx-01 half full.
NODES = {"dgx-00": "dgx-h100", "dgx-01": "dgx-h100", "a100-0": "dgx-a100", "pcie-0": "l40s-4"}
NAMES = list(NODES)


@dataclass
class Server:
    listeners: Listeners
    source: FakeSource
    conn: http.client.HTTPConnection

    def post(self, verb: str, body: Any) -> tuple[int, Any]:
        self.conn.request("POST", f"/{verb}", orjson.dumps(body) if not isinstance(body, bytes) else body)
        r = self.conn.getresponse()
        return r.status, orjson.loads(r.read())

    def ahead(self) -> float:
        got = self.listeners.prometheus.registry.get_sample_value(
            "gputopo_extender_decisions_total", {"verb": "prioritize", "outcome": "scored", "reason": "ahead"}
        )
        return got or 0.0

    def afresh(self, body: Any) -> Any:
        """What the prioritize verb answers for `body` computed now, without anything computed ahead."""
        status, data = prioritize(self.listeners.extender, self.listeners.prometheus, orjson.dumps(body))
        assert status == 200
        return orjson.loads(data)

    def sync(self) -> None:
        sync(self.listeners.cache, self.source)


@pytest.fixture
def server() -> Iterator[Server]:
    source, clock = FakeSource(NS), FakeClock()
    listeners = create_listeners(Settings(namespace=NS, log_level="critical"), cluster=source, clock=clock, watch=False)
    for name, fixture in NODES.items():
        source.put("nodes", node_obj(name, fixture, in_use=[0, 1, 2, 3] if name == "dgx-01" else None))
        source.put("leases", lease_obj(name, clock.now))
    sync(listeners.cache, source)
    srv, thread, url = start_server(listeners.door)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        yield Server(listeners, source, conn)
    finally:
        conn.close()
        srv.should_exit = True
        thread.join(10)
        listeners.door.close()


def _nothing(s: Server) -> None:
    pass


def _gpus_taken_on_a_passed_node(s: Server) -> None:
    """dgx-00 reports half its GPUs in use after the filter: the ledger changed."""
    s.source.put("nodes", node_obj("dgx-00", "dgx-h100", in_use=[0, 1, 2, 3]))
    s.sync()


def _gpus_taken_on_a_node_filter_failed(s: Server) -> None:
    """pcie-0 (no NVLink: the filter failed it) reports a GPU in use: the ledger changed, the nodes
    prioritize names did not."""
    s.source.put("nodes", node_obj("pcie-0", "l40s-4", in_use=[0]))
    s.sync()


ANOTHER = gputopo_pod("q", 2)


@pytest.mark.parametrize(
    ("between", "asked", "ahead"),
    [
        (_nothing, None, 1),  # the prioritize kube-scheduler sends next: answered ahead
        (_gpus_taken_on_a_passed_node, None, 0),  # a node it names changed since the filter: computed afresh
        (_gpus_taken_on_a_node_filter_failed, None, 1),  # only another node changed: still answered ahead
        (_nothing, ANOTHER, 0),  # another pod: computed afresh
    ],
    ids=["next-prioritize", "passed-node-changed", "other-node-changed", "another-pod"],
)
def test_prioritize_after_a_filter_answers_what_it_would_compute_now(
    server: Server, between: Callable[[Server], None], asked: dict[str, Any] | None, ahead: int
) -> None:
    pod = gputopo_pod("p", 2)
    status, filtered = server.post("filter", args(pod, NAMES))
    assert status == 200 and filtered["Error"] == ""
    passed = filtered["NodeNames"]
    assert len(passed) >= 3 and "pcie-0" not in passed
    between(server)
    before = server.ahead()
    body = args(asked or pod, passed)
    status, scores = server.post("prioritize", body)
    assert status == 200
    assert scores == server.afresh(body)
    assert server.ahead() - before == ahead


def test_a_broken_prioritize_after_a_filter_still_gets_400(server: Server) -> None:
    pod = gputopo_pod("p", 2)
    assert server.post("filter", args(pod, NAMES))[0] == 200
    status, answer = server.post("prioritize", b'{"Pod": {}, "NodeNames": "not a list"}')
    assert status == 400 and "NodeNames" in answer["Error"]
    assert server.ahead() == 0


def _reversed_nodes(body: dict[str, Any]) -> bytes:
    return orjson.dumps({**body, "NodeNames": body["NodeNames"][::-1]})


def _spaced(body: dict[str, Any]) -> bytes:
    """The same request, encoded with whitespace: not the bytes the answer was computed for."""
    return orjson.dumps(body, option=orjson.OPT_INDENT_2)


def _plain(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)


def _nested_node_names(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod carrying a NodeNames array of its own, deep inside: the filter body has two of them."""
    return {**pod, "spec": {**pod["spec"], "x": {"NodeNames": ["dgx-00"]}}}


@pytest.mark.parametrize(
    ("shape_pod", "encode", "ahead"),
    [
        (lambda p: p, _plain, 1),  # kube-scheduler's bytes: recognised without decoding
        (lambda p: p, _spaced, 1),  # the same request otherwise encoded: decoded, then answered ahead
        (lambda p: p, _reversed_nodes, 0),  # other nodes' order: not what was computed
        (_nested_node_names, _plain, 1),  # a NodeNames array inside the pod does not confuse the bytes
    ],
    ids=["same-bytes", "other-encoding", "nodes-reordered", "nested-NodeNames"],
)
def test_prioritize_is_recognised_by_its_bytes_or_by_its_content(
    server: Server,
    shape_pod: Callable[[dict[str, Any]], dict[str, Any]],
    encode: Callable[[dict[str, Any]], bytes],
    ahead: int,
) -> None:
    pod = shape_pod(gputopo_pod("p", 2))
    status, filtered = server.post("filter", args(pod, NAMES))
    assert status == 200 and filtered["Error"] == ""
    body = args(pod, filtered["NodeNames"])
    before = server.ahead()
    status, scores = server.post("prioritize", encode(body))
    assert status == 200
    assert scores == server.afresh(orjson.loads(encode(body)))
    assert server.ahead() - before == ahead


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.tuples(st.integers(0, 10_000), st.integers(0, 40)), splice=st.binary(max_size=12))
def test_a_prioritize_differing_from_the_expected_bytes_gets_what_it_would_get_afresh(
    server: Server, cut: tuple[int, int], splice: bytes
) -> None:
    """Any edit of the request the answer was computed for: the answer is what prioritize gives it afresh
    (scores, or the 400 naming the problem), never the answer computed ahead for another request."""
    pod = gputopo_pod("p", 2)
    _, filtered = server.post("filter", args(pod, NAMES))
    expected = orjson.dumps(args(pod, filtered["NodeNames"]))
    start = cut[0] % (len(expected) + 1)
    body = expected[:start] + splice + expected[start + cut[1] :]
    server.conn.request("POST", "/prioritize", body)
    r = server.conn.getresponse()
    got = (r.status, r.read())
    assert got == prioritize(server.listeners.extender, server.listeners.prometheus, body)
