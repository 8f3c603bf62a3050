"""Random requests and pods into GetPreferredAllocation over the socket: every answer is usable by the kubelet
(exactly `size` distinct available devices holding every must-include one) or a clear INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.agent.deviceplugin.preferred import PreferredAllocation
from tests.agent.dp_harness import Harness, pod_object, running_plugin, topology

TOPO = topology()
U = [g.uuid for g in TOPO.gpus]
# Devices the topology does not know (it changed under the kubelet) may be offered too.
IDS = [*U, "GPU-gone-1", "GPU-gone-2"]


@st.composite
def pods(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for n in range(draw(st.integers(0, 4))):
        gpus = draw(st.none() | st.lists(st.integers(0, 9), min_size=1, max_size=8))
        split = draw(st.integers(1, 3))
        count = len(gpus) if gpus else draw(st.integers(1, 4))
        sizes = [count // split + (1 if i < count % split else 0) for i in range(split)]
        out.append(
            pod_object(
                f"p{n}",
                gpus,
                containers=[(f"c{i}", s) for i, s in enumerate(sizes) if s > 0],
                init=draw(st.sampled_from([(), (("init", 1),)])),
                node=draw(st.sampled_from(["gpu-node-1", "gpu-node-1", "other"])),
                phase=draw(st.sampled_from(["Pending", "Pending", "Running", ""])),
                created=f"2026-01-01T00:00:{draw(st.integers(0, 59)):02d}Z",
            )
        )
    return out


@pytest.fixture(scope="module", params=list(PreferredAllocation), ids=str)
def plugin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with running_plugin(tmp_path_factory.mktemp("dp"), TOPO, mode=request.param) as h:
        yield h


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    available=st.lists(st.sampled_from(IDS), unique=True, max_size=len(IDS)),
    must=st.lists(st.sampled_from(IDS), unique=True, max_size=4),
    size=st.integers(0, 10),
    local=pods(),
    allocate=st.booleans(),
)
def test_preferred_answer_is_always_usable(
    plugin: Harness, available: list[str], must: list[str], size: int, local: list[dict[str, Any]], allocate: bool
) -> None:
    plugin.pods.set_objects(local)
    possible = set(must) <= set(available) and len(must) <= size <= len(available)
    try:
        answer = plugin.preferred(available, must, size)
    except grpc.RpcError as e:
        assert not possible, f"a possible request was refused: {e.details()}"
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert e.details()
        return
    assert possible
    assert len(answer) == size
    assert len(set(answer)) == size
    assert set(answer) <= set(available)
    assert set(must) <= set(answer)
    if allocate and answer and set(answer) <= set(U):
        plugin.allocate(answer)
