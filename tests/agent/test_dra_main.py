"""`gputopo-agent --dra`: its settings as flags and GPUTOPO_* variables, the DRA driver served for the agent's
lifetime instead of the device plugin, and the discovery cycle's topology republished."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.dra.api import pluginregistration_pb2, pluginregistration_pb2_grpc
from gputopo.agent.dra.plugin import DraConfig, DraPlugin
from gputopo.agent.dra.slices import slice_name
from gputopo.agent.main import main
from gputopo.agent.settings import AgentSettings, load_settings
from gputopo.engine.dra.devices import DRIVER
from tests.agent.dp_harness import NODE, topology
from tests.agent.dra_harness import FakeClaims, FakeSlices
from tests.agent.memory_api import InMemoryNodeApi

pytestmark = pytest.mark.usefixtures("restore_logging_and_signals", "clean_env")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        pytest.param(
            [],
            {},
            {
                "dra": False,
                "dra_list_attributes": False,
                "dra_device_taints": False,
                "dra_blocks": False,
                "dra_plugins_dir": Path("/var/lib/kubelet/plugins"),
                "dra_registry_dir": Path("/var/lib/kubelet/plugins_registry"),
                "cdi_dir": Path("/var/run/cdi"),
            },
            id="defaults",
        ),
        pytest.param(
            [],
            {
                "GPUTOPO_DRA": "true",
                "GPUTOPO_DRA_LIST_ATTRIBUTES": "1",
                "GPUTOPO_DRA_DEVICE_TAINTS": "true",
                "GPUTOPO_DRA_BLOCKS": "true",
                "GPUTOPO_DRA_PLUGINS_DIR": "/p",
                "GPUTOPO_DRA_REGISTRY_DIR": "/r",
                "GPUTOPO_CDI_DIR": "/c",
            },
            {
                "dra": True,
                "dra_list_attributes": True,
                "dra_device_taints": True,
                "dra_blocks": True,
                "dra_plugins_dir": Path("/p"),
                "dra_registry_dir": Path("/r"),
                "cdi_dir": Path("/c"),
            },
            id="environment",
        ),
        pytest.param(
            ["--dra", "--dra-list-attributes", "--no-dra-device-taints", "--cdi-dir", "/x", "--no-dra-blocks"],
            {"GPUTOPO_DRA_DEVICE_TAINTS": "1", "GPUTOPO_DRA_BLOCKS": "1"},
            {
                "dra": True,
                "dra_list_attributes": True,
                "dra_device_taints": False,
                "cdi_dir": Path("/x"),
                "dra_blocks": False,
            },
            id="flags-win",
        ),
    ],
)
def test_settings(
    argv: list[str], env: dict[str, str], expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = load_settings(argv)
    assert {k: getattr(settings, k) for k in expected} == expected


class StopAfterPatch(InMemoryNodeApi):
    """Runs `check` on the first Node patch (the first discovery cycle published), then SIGTERM."""

    def __init__(self, node: str, check: Callable[[], Any]) -> None:
        super().__init__(node)
        self.check = check
        self.seen: Any = None

    def patch_node_meta(self, name: str, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> None:
        super().patch_node_meta(name, annotations, labels)
        if self.seen is None:
            self.seen = self.check()
            os.kill(os.getpid(), signal.SIGTERM)


def test_agent_serves_the_dra_driver_instead_of_the_device_plugin(tmp_path: Path) -> None:
    topo = topology()
    topo_file = tmp_path / "topo.json"
    topo_file.write_text(topo.to_annotation())
    slices, made = FakeSlices(), []

    def factory(_s: AgentSettings, config: DraConfig, sleep: Callable[[float], bool]) -> DraPlugin:
        made.append(config)
        return DraPlugin(config, FakeClaims(), slices, sleep)

    reg_socket = tmp_path / "registry" / f"{DRIVER}-reg.sock"

    def check() -> tuple[str, int, bool]:
        import grpc

        with grpc.insecure_channel(f"unix://{reg_socket}") as ch:
            info = pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(
                pluginregistration_pb2.InfoRequest(), timeout=10
            )
        return info.name, slices.writes, (tmp_path / "dp").exists()

    api = StopAfterPatch(NODE, check)
    argv = ["--backend", f"file:{topo_file}", "--node-name", NODE, "--metrics-port", "0", "--sysfs-root", str(tmp_path)]
    argv += ["--dra", "--device-plugin", "--device-plugin-dir", str(tmp_path / "dp")]
    argv += ["--dra-plugins-dir", str(tmp_path / "plugins"), "--dra-registry-dir", str(tmp_path / "registry")]
    argv += ["--cdi-dir", str(tmp_path / "cdi")]
    assert main(argv, node_api_factory=lambda _s: api, dra_factory=factory) == 0
    assert made[0].node == NODE and made[0].cdi_dir == tmp_path / "cdi"
    name, writes, device_plugin_dir = api.seen
    assert name == DRIVER
    assert writes == 1 and slice_name(NODE) in slices.slices  # published at start, unchanged by the cycle
    assert not device_plugin_dir, "with --dra the device plugin does not start"
    assert not reg_socket.exists(), "the sockets go with the agent"
    assert (tmp_path / "cdi" / "gputopo.io-gpu.json").exists()


def test_a_dra_start_failure_exits_1_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    def factory(_s: AgentSettings, _c: DraConfig, _sleep: Callable[[float], bool]) -> DraPlugin:
        raise ValueError("no kubeconfig")

    argv = ["--backend", "fixture:dgx-1v", "--node-name", NODE, "--metrics-port", "0", "--dra"]
    assert main(argv, node_api_factory=lambda _s: InMemoryNodeApi(NODE), dra_factory=factory) == 1
    assert "cannot start the DRA driver: no kubeconfig" in capsys.readouterr().err


@pytest.mark.timeout(60)  # today's driver hangs opening the FIFO
def test_the_agent_starts_over_a_junk_checkpoint_and_a_full_cdi_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from gputopo.agent.dra import cdi

    def full(path: Path, _data: bytes, _mode: int = 0o644) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cdi, "atomic_write", full)
    checkpoint = tmp_path / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    os.mkfifo(checkpoint)  # a plain open() of it would never return
    topo_file = tmp_path / "topo.json"
    topo_file.write_text(topology().to_annotation())
    reg_socket = tmp_path / "registry" / f"{DRIVER}-reg.sock"

    def factory(_s: AgentSettings, config: DraConfig, sleep: Callable[[float], bool]) -> DraPlugin:
        return DraPlugin(config, FakeClaims(), FakeSlices(), sleep)

    def check() -> str:
        import grpc

        with grpc.insecure_channel(f"unix://{reg_socket}") as ch:
            info = pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(
                pluginregistration_pb2.InfoRequest(), timeout=10
            )
        return str(info.name)

    api = StopAfterPatch(NODE, check)
    argv = ["--backend", f"file:{topo_file}", "--node-name", NODE, "--metrics-port", "0", "--sysfs-root", str(tmp_path)]
    argv += ["--dra", "--dra-plugins-dir", str(tmp_path / "plugins"), "--dra-registry-dir", str(tmp_path / "registry")]
    argv += ["--cdi-dir", str(tmp_path / "cdi")]
    assert main(argv, node_api_factory=lambda _s: api, dra_factory=factory) == 0
    assert api.seen == DRIVER
    assert (tmp_path / "plugins" / DRIVER / "checkpoint.json.unreadable").exists()
    assert not (tmp_path / "cdi" / "gputopo.io-gpu.json").exists()  # still full: retried every cycle
