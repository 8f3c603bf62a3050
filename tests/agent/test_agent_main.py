"""`gputopo-agent` command line: settings, --once output, errors, publishing, SIGTERM."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path

import pytest

from gputopo.agent.main import main
from gputopo.agent.nodepublisher import NodeApi
from gputopo.agent.nvml_lib import NvmlLib
from gputopo.agent.settings import AgentSettings, load_settings
from gputopo.model import GPUS_IN_USE_ANNOTATION, TOPOLOGY_ANNOTATION, parse_topology
from gputopo.systems import SYSTEMS, VARIANTS, build_system
from tests.agent.fake_pynvml import FakeNvml, NVMLError_LibraryNotFound, fake_system
from tests.agent.memory_api import InMemoryNodeApi
from tests.paths import REPO

# main() touches process-wide state: run each test on a clean environment and restore the rest.
pytestmark = pytest.mark.usefixtures("restore_logging_and_signals", "clean_env")


@pytest.mark.parametrize("system", sorted(SYSTEMS) + sorted(VARIANTS))
def test_once_json_round_trips_for_every_named_system(system: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--once", "--json", "--backend", f"fixture:{system}"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # compact: exactly the annotation value
    assert parse_topology(out) == build_system(system)


def test_once_print_dgx1v_shows_nv1_nv2_and_sys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--once", "--print", "--backend", "fixture:dgx-1v"]) == 0
    rows = {ln.split()[0]: ln.split()[1:9] for ln in capsys.readouterr().out.splitlines() if ln.startswith("GPU0 ")}
    assert rows["GPU0"] == ["X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]


def test_once_print_shows_gpus_in_use_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in-use.json").write_text("[7, 2]")
    args = ["--once", "--print", "--backend", "fixture:hgx-h200", "--in-use-file", str(tmp_path / "in-use.json")]
    assert main(args) == 0
    assert "GPUs in use: 2, 7" in capsys.readouterr().out


def test_nvml_backend_with_a_fake_library(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lib: NvmlLib = fake_system("dgx-h100")
    argv = ["--once", "--json", "--backend", "nvml", "--sysfs-root", str(tmp_path)]
    assert main(argv, nvml_lib=lambda: lib) == 0
    got = parse_topology(capsys.readouterr().out)
    assert got == build_system("dgx-h100").model_copy(update={"nics": ()})


def test_no_driver_is_one_clear_error_and_nonzero_exit(capsys: pytest.CaptureFixture[str]) -> None:
    lib: NvmlLib = FakeNvml([], init_error=NVMLError_LibraryNotFound)
    assert main(["--once", "--json"], nvml_lib=lambda: lib) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("gputopo-agent: error:")]
    assert len(lines) == 1
    assert "NVIDIA driver not available" in lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--once", "--json", "--backend", "gpu"], "backend", id="unknown backend kind"),
        pytest.param(["--once", "--json", "--backend", "fixture:nope"], "unknown system", id="unknown fixture"),
        pytest.param(
            ["--once", "--json", "--interval-seconds", "0"],
            "--interval-seconds (GPUTOPO_INTERVAL_SECONDS): Input should be greater than 0",
            id="interval must be > 0",
        ),
        pytest.param(
            ["--once", "--json", "--log-level", "loud"], "--log-level (GPUTOPO_LOG_LEVEL)", id="bad log level"
        ),
        pytest.param(
            ["--print", "--backend", "fixture:dgx-1v"], "--print and --json need --once", id="print needs once"
        ),
        pytest.param(["--once", "--print", "--json"], "--print and --json are exclusive", id="print or json"),
        pytest.param(["--once", "--frobnicate"], "unrecognized arguments: --frobnicate", id="unknown flag"),
        pytest.param(["--backend", "fixture:dgx-h100"], "NODE_NAME", id="loop needs a node name"),
    ],
)
def test_invalid_settings_exit_nonzero_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_file_backend_error_in_once_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--once", "--json", "--backend", f"file:{tmp_path / 'missing.json'}"]) == 1
    assert "cannot read topology file" in capsys.readouterr().err


@pytest.mark.parametrize("variable", ["ONCE", "PRINT", "JSON", "GPUTOPO_ONCE"])
def test_the_one_shot_actions_are_flags_only(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gputopo.agent.settings import parse_command

    monkeypatch.setenv(variable, "true")
    command = parse_command([])
    assert not (command.once or command.print_topology or command.json_topology)


def test_settings_from_env_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-07")
    monkeypatch.setenv("GPUTOPO_NAMESPACE", "gpu-ops")
    monkeypatch.setenv("GPUTOPO_INTERVAL_SECONDS", "5")
    monkeypatch.setenv("GPUTOPO_IN_USE_FILE", "/tmp/in-use.json")
    monkeypatch.setenv("GPUTOPO_METRICS_PORT", "0")
    s = load_settings(["--interval-seconds", "2", "--backend", "fixture:dgx-a100"])
    assert (s.node_name, s.namespace, s.interval_seconds, s.backend) == ("gpu-07", "gpu-ops", 2.0, "fixture:dgx-a100")
    assert (s.in_use_file, s.metrics_port) == (Path("/tmp/in-use.json"), 0)


def test_defaults_match_the_configuration_reference() -> None:
    s = load_settings([])
    assert s == AgentSettings(
        node_name=None,
        namespace="gputopo-system",
        backend="nvml",
        interval_seconds=10,
        heartbeat_seconds=30,
        sysfs_root=Path("/sys"),
        podresources_socket=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        in_use_file=None,
        kubeconfig=None,
        metrics_port=9401,
        log_level="info",
    )


def test_once_without_output_publishes_and_heartbeats(tmp_path: Path) -> None:
    api = InMemoryNodeApi("dgx-01")
    (tmp_path / "in-use.json").write_text("[1]")
    argv = ["--once", "--backend", "fixture:dgx-h100", "--node-name", "dgx-01"]
    argv += ["--in-use-file", str(tmp_path / "in-use.json")]
    assert main(argv, node_api_factory=lambda _s: api) == 0
    assert parse_topology(api.annotations[TOPOLOGY_ANNOTATION]) == build_system("dgx-h100", "dgx-01")
    assert api.annotations[GPUS_IN_USE_ANNOTATION] == '{"version":2,"pods":{},"other":[1]}'
    assert ("gputopo-system", "gputopo-agent-dgx-01") in api.leases


class SigtermOnPatch(InMemoryNodeApi):
    """Sends SIGTERM to this process on the first Node patch, as the kubelet would on pod deletion."""

    def patch_node_meta(self, name: str, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> None:
        super().patch_node_meta(name, annotations, labels)
        os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_the_loop_cleanly_and_deletes_its_lease() -> None:
    api = SigtermOnPatch("gpu-09")

    def factory(_s: AgentSettings) -> NodeApi:
        return api

    argv = ["--backend", "fixture:dgx-a100", "--node-name", "gpu-09", "--metrics-port", "0"]
    assert main(argv, node_api_factory=factory) == 0
    assert api.calls["patch_node"] == 1
    assert TOPOLOGY_ANNOTATION in api.annotations
    # It heartbeat once before stopping, and deleted that Lease on the way out.
    assert (api.calls["create_lease"], api.calls["delete_lease"]) == (1, 1)
    assert api.leases == {}


def test_once_keeps_its_lease() -> None:
    api = InMemoryNodeApi("gpu-10")
    argv = ["--once", "--backend", "fixture:dgx-a100", "--node-name", "gpu-10"]
    assert main(argv, node_api_factory=lambda _s: api) == 0
    assert ("gputopo-system", "gputopo-agent-gpu-10") in api.leases
    assert api.calls["delete_lease"] == 0


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text[text.index("## gputopo-agent") :]
    for field in AgentSettings.model_fields:
        env = "`NODE_NAME`" if field == "node_name" else f"`GPUTOPO_{field.upper()}`"
        assert f"| `--{field.replace('_', '-')}` | {env} |" in section, field
