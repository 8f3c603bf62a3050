"""The agent loop on a fake clock: mid-run changes republished within one interval, Lease cadence,
no Node writes in steady state, no heartbeat while discovery fails, metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from gputopo.agent.backends import FileBackend, InUseFile
from gputopo.agent.metrics import AgentMetrics
from gputopo.agent.nodepublisher import LeaseTerms, Publisher
from gputopo.agent.runner import Agent, Pacing
from gputopo.model import (
    GPUS_IN_USE_ANNOTATION,
    TOPOLOGY_ANNOTATION,
    DegradedLink,
    GpusInUse,
    LinkState,
    parse_topology,
)
from gputopo.systems import build_system
from tests.agent.memory_api import InMemoryNodeApi

NODE = "sim-01"


class FakeTime:
    """Clock plus stop signal: `wait` advances time and fires scheduled actions; stops at `end`."""

    def __init__(self, end: float) -> None:
        self.now = 0.0
        self.end = end
        self.actions: list[tuple[float, Callable[[], object]]] = []

    def at(self, t: float, action: Callable[[], object]) -> None:
        self.actions.append((t, action))
        self.actions.sort(key=lambda a: a[0])

    def clock(self) -> float:
        return self.now

    def is_set(self) -> bool:
        return self.now >= self.end

    def wait(self, timeout: float | None = None) -> bool:
        target = min(self.end, self.now + (timeout if timeout is not None else self.end))
        while self.actions and self.actions[0][0] <= target:
            t, action = self.actions.pop(0)
            self.now = max(self.now, t)
            action()
        self.now = target
        return self.is_set()


def setup(tmp_path: Path, end: float) -> tuple[Agent, InMemoryNodeApi, FakeTime, AgentMetrics, Path, Path]:
    topo_file = tmp_path / "topology.json"
    topo_file.write_text(build_system("dgx-h100", NODE).to_annotation())
    in_use_file = tmp_path / "in-use.json"
    ft = FakeTime(end)
    api = InMemoryNodeApi(NODE)
    publisher = Publisher(api, NODE, LeaseTerms("ns", 120), sleep=ft.wait, reverify_s=120.0, monotonic=ft.clock)
    metrics = AgentMetrics()
    agent = Agent(FileBackend(topo_file), InUseFile(in_use_file), publisher, metrics, Pacing(10.0, 30.0, ft, ft.clock))
    return agent, api, ft, metrics, topo_file, in_use_file


def test_steady_state_writes_the_node_once_and_renews_the_lease(tmp_path: Path) -> None:
    agent, api, _, metrics, _, _ = setup(tmp_path, end=300.0)
    agent.run()
    assert api.calls["patch_node"] == 1  # the first publish; nothing after
    assert api.calls["read_node"] == 3  # t = 0, then a read-back every 120 s: 120, 240
    assert api.calls["create_lease"] + api.calls["renew_lease"] - 1 == 10  # t = 0, 30, …, 270
    assert metrics.registry.get_sample_value("gputopo_agent_publish_total", {"result": "unchanged"}) == 29
    assert metrics.registry.get_sample_value("gputopo_agent_publish_total", {"result": "changed"}) == 1


def link_down_document(gpu: int, link: int) -> str:
    doc = build_system("dgx-h100", NODE)
    links = [list(r) for r in doc.nvlink.links]
    for j in range(len(links)):
        if j != gpu:
            links[gpu][j] = links[j][gpu] = 17
    nvlink = doc.nvlink.model_copy(update={"links": tuple(tuple(r) for r in links)})
    down = DegradedLink(gpu=gpu, link=link, state=LinkState.DOWN, detail="link not active")
    return doc.model_copy(update={"nvlink": nvlink, "degraded_links": (down,)}).to_annotation()


@pytest.mark.parametrize(
    "change_at",
    [pytest.param(35.0, id="just after a cycle"), pytest.param(39.9, id="just before a cycle")],
)
def test_link_down_mid_run_republished_within_one_interval(
    tmp_path: Path, change_at: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, api, ft, metrics, topo_file, _ = setup(tmp_path, end=200.0)
    patch_times: list[float] = []
    patch = api.patch_node_meta

    def recording_patch(name: str, annotations: Mapping[str, str], labels: Mapping[str, str]) -> None:
        patch_times.append(ft.now)
        patch(name, annotations, labels)

    monkeypatch.setattr(api, "patch_node_meta", recording_patch)
    ft.at(change_at, lambda: topo_file.write_text(link_down_document(3, 5)))
    agent.run()
    assert len(patch_times) == 2
    assert change_at < patch_times[1] <= change_at + 10.0  # within one interval
    published = parse_topology(api.annotations[TOPOLOGY_ANNOTATION])
    assert published.link_count(3, 0) == 17
    assert published.degraded_links[0].state is LinkState.DOWN
    assert metrics.registry.get_sample_value("gputopo_agent_nvlink_links_degraded") == 1


NONE = GpusInUse().to_annotation()


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        pytest.param("[1, 2]", GpusInUse(other=frozenset({1, 2})), id="plain list: all other"),
        pytest.param(
            '{"version": 2, "pods": {"uid-a": [2, 1]}, "other": [5]}',
            GpusInUse(pods={"uid-a": frozenset({1, 2})}, other=frozenset({5})),
            id="per-pod version 2",
        ),
    ],
)
def test_in_use_file_change_is_republished_as_version_2(tmp_path: Path, written: str, expected: GpusInUse) -> None:
    agent, api, ft, _, _, in_use_file = setup(tmp_path, end=100.0)
    ft.at(45.0, lambda: in_use_file.write_text(written))
    ft.at(75.0, in_use_file.unlink)
    agent.run()
    assert [p[0].get(GPUS_IN_USE_ANNOTATION) for p in api.patches] == [NONE, expected.to_annotation(), NONE]


def test_no_heartbeat_while_discovery_fails(tmp_path: Path) -> None:
    agent, api, ft, _, topo_file, _ = setup(tmp_path, end=200.0)
    good = topo_file.read_text()
    ft.at(5.0, lambda: topo_file.write_text("{not json"))
    ft.at(125.0, lambda: topo_file.write_text(good))
    agent.run()
    beats = api.calls["create_lease"] + api.calls["renew_lease"] - 1
    # t = 0 before the failure; then nothing until discovery works again at t = 130; then t = 160, 190.
    assert beats == 4
    assert api.calls["patch_node"] == 1


def test_invalid_in_use_file_keeps_last_value(tmp_path: Path) -> None:
    agent, api, ft, _, _, in_use_file = setup(tmp_path, end=60.0)
    in_use_file.write_text("[3]")
    ft.at(15.0, lambda: in_use_file.write_text("[99]"))  # out of range for 8 GPUs
    agent.run()
    assert api.annotations[GPUS_IN_USE_ANNOTATION] == GpusInUse(other=frozenset({3})).to_annotation()
    assert api.calls["patch_node"] == 1


def test_discovery_duration_is_observed(tmp_path: Path) -> None:
    agent, _, _, metrics, _, _ = setup(tmp_path, end=1.0)
    agent.cycle()
    assert metrics.registry.get_sample_value("gputopo_agent_discovery_duration_seconds_count") == 1


def test_an_external_edit_of_the_node_is_repaired_at_the_next_read_back(tmp_path: Path) -> None:
    agent, api, ft, _, _, _ = setup(tmp_path, end=300.0)
    ft.at(50.0, lambda: api.annotations.pop("gputopo.io/topology"))  # someone strips our annotation
    agent.run()
    assert "gputopo.io/topology" in api.annotations, "restored when the 120 s read-back saw it missing"
    assert api.calls["patch_node"] == 2
