"""`gputopo-agent --device-plugin`: its settings as flags and GPUTOPO_* variables, the plugin served for the
agent's lifetime with the discovery cycle's topology, and a MIG node refused at start."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.deviceplugin import api_pb2
from gputopo.agent.deviceplugin.devices import DeviceListStrategy
from gputopo.agent.deviceplugin.plugin import TopologyTap
from gputopo.agent.deviceplugin.preferred import PreferredAllocation
from gputopo.agent.main import main, make_local_pods
from gputopo.agent.nvml_backend import MIG_REASON
from gputopo.agent.pods import StaticLocalPods
from gputopo.agent.settings import load_settings
from gputopo.model import Health, NodeTopology
from tests.agent.dp_harness import FakeKubelet, pod_object, topology, with_gpu
from tests.agent.memory_api import InMemoryNodeApi

# main() touches process-wide state: run each test on a clean environment and restore the rest.
pytestmark = pytest.mark.usefixtures("restore_logging_and_signals", "clean_env")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        pytest.param(
            [],
            {},
            {
                "device_plugin": False,
                "device_plugin_dir": Path("/var/lib/kubelet/device-plugins"),
                "resource_name": "nvidia.com/gpu",
                "device_list_strategy": DeviceListStrategy.ENVVAR,
                "preferred_allocation": PreferredAllocation.PLACEMENT,
            },
            id="defaults",
        ),
        pytest.param(
            [],
            {
                "GPUTOPO_DEVICE_PLUGIN": "true",
                "GPUTOPO_DEVICE_PLUGIN_DIR": "/dp",
                "GPUTOPO_RESOURCE_NAME": "example.com/gpu",
                "GPUTOPO_DEVICE_LIST_STRATEGY": "cdi-cri",
                "GPUTOPO_PREFERRED_ALLOCATION": "besteffort",
            },
            {
                "device_plugin": True,
                "device_plugin_dir": Path("/dp"),
                "resource_name": "example.com/gpu",
                "device_list_strategy": DeviceListStrategy.CDI_CRI,
                "preferred_allocation": PreferredAllocation.BESTEFFORT,
            },
            id="environment",
        ),
        pytest.param(
            ["--no-device-plugin", "--device-list-strategy", "cdi-annotations", "--preferred-allocation", "placement"],
            {"GPUTOPO_DEVICE_PLUGIN": "1", "GPUTOPO_PREFERRED_ALLOCATION": "besteffort"},
            {
                "device_plugin": False,
                "device_list_strategy": DeviceListStrategy.CDI_ANNOTATIONS,
                "preferred_allocation": PreferredAllocation.PLACEMENT,
            },
            id="flags-win-over-environment",
        ),
        pytest.param(["--device-plugin"], {}, {"device_plugin": True}, id="flag-on"),
    ],
)
def test_settings(
    argv: list[str], env: dict[str, str], expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = load_settings(argv)
    assert {k: getattr(settings, k) for k in expected} == expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        pytest.param(["--resource-name", "gpu"], {}, "--resource-name", id="resource-without-domain"),
        pytest.param(
            [], {"GPUTOPO_DEVICE_LIST_STRATEGY": "volume-mounts"}, "GPUTOPO_DEVICE_LIST_STRATEGY", id="bad-strategy"
        ),
        pytest.param([], {"GPUTOPO_PREFERRED_ALLOCATION": "random"}, "--preferred-allocation", id="bad-preference"),
    ],
)
def test_invalid_settings_exit_2(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["--once", "--json", "--backend", "fixture:dgx-1v", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "once", "wanted"),
    [
        pytest.param(["--device-plugin", "--backend", "fixture:dgx-1v"], False, True, id="device-plugin"),
        pytest.param(["--device-plugin", "--backend", "fixture:dgx-1v"], True, False, id="once-needs-none"),
        pytest.param(["--backend", "fixture:dgx-1v"], False, False, id="simulated-node-without-plugin"),
        pytest.param(["--backend", "nvml"], False, True, id="podresources-attribution"),
    ],
)
def test_pod_view_only_when_something_reads_it(argv: list[str], once: bool, wanted: bool) -> None:
    settings = load_settings(argv)
    view = make_local_pods(settings, "n1", once, lambda _s, node: StaticLocalPods(node))
    assert (view is not None) is wanted


class StopAfterPatches(InMemoryNodeApi):
    """Runs `check` and sends SIGTERM on the first Node patch, as the kubelet would on pod deletion."""

    def __init__(self, node: str, check: Any) -> None:
        super().__init__(node)
        self.check = check
        self.seen: Any = None

    def patch_node_meta(self, name: str, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> None:
        super().patch_node_meta(name, annotations, labels)
        if self.seen is None:
            self.seen = self.check()
            os.kill(os.getpid(), signal.SIGTERM)


def _write(path: Path, topo: NodeTopology) -> Path:
    path.write_text(topo.to_annotation())
    return path


def test_agent_serves_the_plugin_while_it_runs(tmp_path: Path) -> None:
    dp = tmp_path / "dp"
    kubelet = FakeKubelet(dp)
    kubelet.start()
    topo = topology()
    failed = with_gpu(topo, 2, health=Health.FAILED)
    topo_file = _write(tmp_path / "topo.json", failed)

    def check() -> tuple[int, list[str]]:
        import grpc

        from gputopo.agent.deviceplugin import api_pb2_grpc

        with grpc.insecure_channel(f"unix://{dp / 'gputopo-gpu.sock'}") as ch:
            first = next(api_pb2_grpc.DevicePluginStub(ch).ListAndWatch(api_pb2.Empty(), timeout=10))
        return kubelet.count(), [d.health for d in first.devices]

    api = StopAfterPatches("gpu-node-1", check)
    argv = ["--backend", f"file:{topo_file}", "--node-name", "gpu-node-1", "--metrics-port", "0"]
    argv += ["--device-plugin", "--device-plugin-dir", str(dp), "--device-list-strategy", "cdi-cri"]
    try:
        code = main(
            argv,
            node_api_factory=lambda _s: api,
            local_pods_factory=lambda _s, node: StaticLocalPods(node, [pod_object("a", [0, 1])]),
        )
    finally:
        kubelet.stop()
    assert code == 0
    registrations, health = api.seen
    assert registrations == 1
    assert health == ["Healthy", "Healthy", "Unhealthy", *["Healthy"] * 5]
    assert not (dp / "gputopo-gpu.sock").exists(), "the socket goes with the agent"


def test_mig_node_refuses_the_device_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = topology()
    mig = topo.model_copy(
        update={
            "gpus": tuple(g.model_copy(update={"reasons": (MIG_REASON,)}) if g.index == 3 else g for g in topo.gpus)
        }
    )
    argv = ["--backend", f"file:{_write(tmp_path / 'topo.json', mig)}", "--node-name", "gpu-node-1"]
    argv += ["--metrics-port", "0", "--device-plugin", "--device-plugin-dir", str(tmp_path / "dp")]
    code = main(
        argv,
        node_api_factory=lambda _s: InMemoryNodeApi("gpu-node-1"),
        local_pods_factory=lambda _s, node: StaticLocalPods(node),
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot start the device plugin" in err and f"GPU 3 ({topo.gpus[3].uuid}) is in MIG mode" in err


class _Backend:
    description = "test"

    def __init__(self, topo: NodeTopology) -> None:
        self.topo = topo
        self.closed = False

    def discover(self) -> NodeTopology:
        return self.topo

    def close(self) -> None:
        self.closed = True


def _boom(_t: NodeTopology) -> None:
    raise RuntimeError("plugin broke")


@pytest.mark.parametrize(
    ("observer_fails"), [pytest.param(False, id="observer-gets-each-topology"), pytest.param(True, id="observer-fails")]
)
def test_topology_tap_feeds_the_plugin_without_failing_discovery(observer_fails: bool) -> None:
    seen: list[NodeTopology] = []
    backend = _Backend(topology())
    tap = TopologyTap(backend, _boom if observer_fails else seen.append)
    assert tap.discover() == backend.topo
    assert tap.description == "test"
    assert seen == ([] if observer_fails else [backend.topo])
    tap.close()
    assert backend.closed
