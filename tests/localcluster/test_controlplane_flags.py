"""Feature gates, runtime-config and kube-controller-manager's command line, without running anything:
what each component is started with, and bad input refused before a process or a directory exists."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.localcluster import APISERVER, CONTROLLERS, ApiFeatures, ControlPlane, FlagError, parse_flag_map
from gputopo.localcluster.binaries import BUILD_SCRIPT, REQUIRED_BINARIES
from gputopo.localcluster.controlplane import CONTROLLER_MANAGER, CONTROLLER_MANAGER_USER
from gputopo.localcluster.featureflags import feature_gates_arg, runtime_config_arg

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")


def _bin_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name in BINARIES:
        (d / name).write_text("#!/bin/sh\n")
        (d / name).chmod(0o755)
    return d


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("", {}),
        ("A=true", {"A": True}),
        (
            " InPlacePodVerticalScaling=false , DRAAdminAccess=TRUE,",
            {"InPlacePodVerticalScaling": False, "DRAAdminAccess": True},
        ),
        ("api/beta=true,batch/v1=false", {"api/beta": True, "batch/v1": False}),
    ],
)
def test_parse_flag_map_reads_name_equals_bool_lists(text: str, parsed: dict[str, bool]) -> None:
    assert parse_flag_map(text, source="X") == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("A", "'A' is not NAME=true or NAME=false"),
        ("A=yes", "'A=yes' is not NAME=true or NAME=false"),
        ("=true", "'=true' is not NAME=true"),
        ("A=true,A=false", "'A' is given twice"),
    ],
)
def test_parse_flag_map_names_the_source_and_the_bad_item(text: str, message: str) -> None:
    with pytest.raises(FlagError, match=f"^GPUTOPO_E2E_FEATURE_GATES: {message}"):
        parse_flag_map(text, source="GPUTOPO_E2E_FEATURE_GATES")


@given(st.text(max_size=40))
def test_parse_flag_map_fails_only_with_flag_error(text: str) -> None:
    try:
        parsed = parse_flag_map(text, source="fuzz")
    except FlagError:
        return
    assert all(isinstance(v, bool) for v in parsed.values())


@given(st.dictionaries(st.from_regex(r"[A-Z][A-Za-z0-9]{0,20}", fullmatch=True), st.booleans(), max_size=5))
def test_feature_gates_arg_round_trips_through_the_parser(gates: dict[str, bool]) -> None:
    assert parse_flag_map(feature_gates_arg(gates), source="t") == gates


@pytest.mark.parametrize(
    ("render", "values", "message"),
    [
        (feature_gates_arg, {"lowercase": True}, "feature gate: 'lowercase' is not a valid name"),
        (feature_gates_arg, {"A,B": True}, "feature gate: 'A,B' is not a valid name"),
        (feature_gates_arg, {"A": "true"}, "feature gate: A='true' must be true or false"),
        (runtime_config_arg, {"api/beta=x": True}, "runtime-config: 'api/beta=x' is not a valid name"),
        (runtime_config_arg, {"a/b/c/d": True}, "runtime-config: 'a/b/c/d' is not a valid name"),
    ],
)
def test_bad_gate_or_api_names_are_refused_naming_them(render: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        render(values)


def test_runtime_config_takes_groups_versions_and_resources() -> None:
    cfg = {"api/alpha": False, "resource.k8s.io/v1beta2": True, "admissionregistration.k8s.io/v1beta1/x": True}
    assert runtime_config_arg(cfg) == (
        "admissionregistration.k8s.io/v1beta1/x=true,api/alpha=false,resource.k8s.io/v1beta2=true"
    )


def test_a_bad_gate_fails_before_the_control_plane_makes_its_directory(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(FlagError, match="'not a gate'"):
        ControlPlane(_bin_dir(tmp_path), base_dir=base, features=ApiFeatures(feature_gates={"not a gate": True}))
    assert not list(base.iterdir())


def test_feature_gates_reach_apiserver_schedulers_and_controller_manager_runtime_config_only_the_apiserver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp = ControlPlane(
        _bin_dir(tmp_path),
        base_dir=tmp_path,
        features=ApiFeatures(feature_gates={"B": False, "A": True}, runtime_config={"api/beta": True}),
    )
    started: dict[str, list[str]] = {}
    monkeypatch.setattr(cp, "start_process", lambda name, argv, **_: started.setdefault(name, list(argv)) and name)
    try:
        cp._prepare_files()
        cp._add_apiserver()
        cp._started = True
        cp.start_scheduler("s")
        cp.start_controller_manager()
        apiserver = cp._components[APISERVER].argv
        assert "--feature-gates=A=true,B=false" in apiserver and "--runtime-config=api/beta=true" in apiserver
        for name in ("s", CONTROLLER_MANAGER):
            assert "--feature-gates=A=true,B=false" in started[name]
            assert not [a for a in started[name] if a.startswith("--runtime-config")]
    finally:
        cp.teardown()


def test_controller_manager_runs_the_listed_controllers_on_loopback_with_its_own_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp = ControlPlane(_bin_dir(tmp_path), base_dir=tmp_path)
    started: dict[str, list[str]] = {}
    monkeypatch.setattr(cp, "start_process", lambda name, argv, **_: started.setdefault(name, list(argv)) and name)
    try:
        cp._prepare_files()
        cp._started = True
        cp.start_controller_manager()
        argv = started[CONTROLLER_MANAGER]
        flags = dict(a.split("=", 1) for a in argv[1:])
        assert flags["--bind-address"] == "127.0.0.1" and int(flags["--secure-port"]) == cp.controller_manager_port
        assert flags["--controllers"].split(",") == list(CONTROLLERS)
        assert not {"node-lifecycle-controller", "pod-garbage-collector-controller"} & set(CONTROLLERS)
        assert (flags["--use-service-account-credentials"], flags["--leader-elect"]) == ("true", "false")
        assert flags["--service-account-private-key-file"] == str(cp.dir / "sa.key")
        kubeconfig = Path(flags["--kubeconfig"])
        assert oct(kubeconfig.stat().st_mode & 0o777) == "0o600"
        assert f'"name": "{CONTROLLER_MANAGER_USER}"' in kubeconfig.read_text()
        # Its token is in the apiserver's token file under its own user, with no group.
        assert (
            f"{cp.controller_manager_token},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER}\n"
            in (cp.dir / "tokens.csv").read_text()
        )
    finally:
        cp.teardown()


def test_controller_manager_missing_is_named_with_the_build_script(tmp_path: Path) -> None:
    bin_dir = _bin_dir(tmp_path)
    (bin_dir / "kube-controller-manager").unlink()
    cp = ControlPlane(bin_dir, base_dir=tmp_path)
    cp._started = True
    try:
        with pytest.raises(Exception, match=r"kube-controller-manager is missing; run .*build_binaries\.sh"):
            cp.start_controller_manager()
    finally:
        cp.teardown()


def test_build_check_counts_a_cache_without_the_controller_manager_as_incomplete(tmp_path: Path) -> None:
    env = {**os.environ, "GPUTOPO_CACHE": str(tmp_path)}
    env.pop("GPUTOPO_BIN_DIR", None)

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, env=env, check=False
        )

    bin_dir = Path(check().stdout.strip())
    bin_dir.mkdir(parents=True)
    for name in (*REQUIRED_BINARIES, "kubelet", "fakecri"):
        if name != CONTROLLER_MANAGER:
            (bin_dir / name).write_text("#!/bin/sh\n")
            (bin_dir / name).chmod(0o755)
    assert check().returncode == 3
    (bin_dir / CONTROLLER_MANAGER).write_text("#!/bin/sh\n")
    (bin_dir / CONTROLLER_MANAGER).chmod(0o755)
    assert check().returncode == 0
    assert CONTROLLER_MANAGER in REQUIRED_BINARIES
