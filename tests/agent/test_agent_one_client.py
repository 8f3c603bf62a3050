"""The agent builds one Kubernetes client (one connection pool) and its parts share it: the pod view
watches through it, stopping the view ends its watch but leaves the client serving the publisher's
calls, and the client is built once, on first use."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gputopo.agent.main import AgentKube, make_local_pods
from gputopo.agent.nodepublisher import KubeNodeApi
from gputopo.agent.pods import KubeLocalPods
from gputopo.agent.settings import load_settings
from tests.kube.test_kube_layer import FakeApiServer, Reply, write_kubeconfig


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
    yield fake
    fake.close()


def test_the_agents_parts_share_one_client(server: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url)
    settings = load_settings(["--device-plugin", "--backend", "fixture:dgx-1v", f"--kubeconfig={kubeconfig}"])
    shared = AgentKube(settings)
    kube = shared.get()
    assert shared.get() is kube  # built once
    # The pod list, then a watch held open until the server lets go.
    server.replies = [Reply(body={"items": [], "metadata": {"resourceVersion": "5"}}), Reply(chunks=[], hold=True)]
    pods = make_local_pods(settings, "n1", False, None, shared)
    assert isinstance(pods, KubeLocalPods)
    assert pods.synced.wait(5)
    deadline = time.monotonic() + 5
    while len(server.seen) < 2 and time.monotonic() < deadline:  # the watch is in flight
        time.sleep(0.01)
    pods.close()  # ends the pod watch at once (status 0 in its thread) ...
    assert not pods._thread.is_alive()  # the watch was aborted, not waited out
    server.release.set()
    server.replies = [Reply(body={"metadata": {"annotations": {"a": "1"}, "labels": {}}})]
    meta = KubeNodeApi(kube).read_node_meta("n1")  # ... and the shared client still serves
    assert meta.annotations == {"a": "1"}
    assert kube.transport is not None
    shared.close()
