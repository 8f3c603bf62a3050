"""`gputopo uninstall-cleanup` (the chart's post-delete hook): which Leases it deletes, and when."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputopo.console.cli import main
from gputopo.console.uninstall import cleanup, leases_to_delete
from gputopo.kube import Kube
from tests.kube.test_kube_layer import FakeApiServer, Reply, status, write_kubeconfig

NS = "gputopo-system"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
PODS = f"/api/v1/namespaces/{NS}/pods"


def _list(*names: str) -> Reply:
    return Reply(200, {"items": [{"metadata": {"name": n}} for n in names], "metadata": {}})


@pytest.mark.parametrize(
    ("names", "extra", "expected"),
    [
        pytest.param(
            ["gputopo-agent-a", "gputopo-scheduler", "other"],
            ["gputopo-scheduler"],
            ["gputopo-agent-a", "gputopo-scheduler"],
            id="agents and the leader Lease",
        ),
        pytest.param(["gputopo-scheduler", "mine"], [], [], id="the leader Lease only when named"),
        pytest.param(["gputopo-agent", "agent-x"], [], [], id="no prefix match without the dash"),
    ],
)
def test_leases_to_delete_are_the_agents_and_the_named(names: list[str], extra: list[str], expected: list[str]) -> None:
    assert leases_to_delete(names, extra) == expected


def test_cleanup_waits_for_the_release_pods_then_deletes_the_leases(server: FakeApiServer, kube: Kube) -> None:
    server.replies = [
        _list("gputopo-scheduler-abc"),  # still terminating
        _list(),
        _list("gputopo-agent-n1", "gputopo-scheduler", "someone-elses"),
        Reply(200, {}),
        Reply(404, status(404, "NotFound", "gone meanwhile")),
    ]
    assert cleanup(kube, NS, "gputopo", ["gputopo-scheduler"], wait_s=30, poll_s=0.01) == 0
    seen = [(s.method, s.path) for s in server.seen]
    assert seen == [
        ("GET", PODS),
        ("GET", PODS),
        ("GET", LEASES),
        ("DELETE", f"{LEASES}/gputopo-agent-n1"),
        ("DELETE", f"{LEASES}/gputopo-scheduler"),
    ]
    assert server.seen[0].query["labelSelector"] == [
        "app.kubernetes.io/instance=gputopo,app.kubernetes.io/component in (scheduler,agent)"
    ]


@pytest.mark.parametrize(
    ("replies", "expected"),
    [
        pytest.param([_list("p")] * 3, 1, id="pods outlive the wait: Leases deleted anyway, status 1"),
        pytest.param(
            [_list(), _list("gputopo-agent-n1"), Reply(403, status(403, "Forbidden", "no"))],
            1,
            id="a refused delete: status 1",
        ),
    ],
)
def test_cleanup_reports_what_it_could_not_do(
    server: FakeApiServer, kube: Kube, replies: list[Reply], expected: int
) -> None:
    server.replies = list(replies)
    assert cleanup(kube, NS, "gputopo", [], wait_s=0.0, poll_s=0.01) == expected
    assert any(s.path == LEASES for s in server.seen)


def test_the_command_line_names_its_inputs(server: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url)
    server.replies = [_list(), _list("gputopo-scheduler"), Reply(200, {})]
    argv = ["uninstall-cleanup", "--namespace", NS, "--release", "r", "--lease", "gputopo-scheduler"]
    assert main([*argv, "--wait-seconds", "5", "--kubeconfig", str(kubeconfig)]) == 0
    assert server.seen[-1].method == "DELETE"
    with pytest.raises(SystemExit):
        main(["uninstall-cleanup", "--release", "r"])  # --namespace is required
