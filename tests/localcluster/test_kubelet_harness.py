"""The real-kubelet harness without a kubelet: when it refuses to run, its configuration, and the
build script's notion of a complete cache (which now includes the kubelet and fakecri)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gputopo.localcluster.binaries import BUILD_SCRIPT
from gputopo.localcluster.kubelet import kubelet_configuration, kubelet_unavailable

ALL_BINARIES = (
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubectl",
    "kubelet",
    "fakecri",
    "etcd",
    "helm",
)


def _bin_dir(tmp_path: Path, names: tuple[str, ...]) -> Path:
    d = tmp_path / "bin"
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_text("#!/bin/sh\n")
        (d / n).chmod(0o755)
    return d


def test_kubelet_unavailable_names_root_when_not_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = kubelet_unavailable(_bin_dir(tmp_path, ALL_BINARIES))
    assert reason is not None and "needs root" in reason


def test_kubelet_unavailable_names_the_missing_binaries_and_the_build_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    reason = kubelet_unavailable(_bin_dir(tmp_path, ("kubelet",)))
    assert reason is not None and "fakecri not built" in reason and "build_binaries.sh" in reason
    assert kubelet_unavailable(_bin_dir(tmp_path, ALL_BINARIES)) is None


def test_kubelet_configuration_stays_on_loopback_and_uses_the_fake_cri_for_everything(tmp_path: Path) -> None:
    cfg = kubelet_configuration(
        port=10250,
        healthz_port=10248,
        cri_endpoint="unix:///x/cri.sock",
        pod_logs_dir=tmp_path / "logs",
        volume_plugin_dir=tmp_path / "volumes",
    )
    assert (cfg["address"], cfg["healthzBindAddress"], cfg["readOnlyPort"]) == ("127.0.0.1", "127.0.0.1", 0)
    assert cfg["containerRuntimeEndpoint"] == cfg["imageServiceEndpoint"] == "unix:///x/cri.sock"
    assert (cfg["cgroupDriver"], cfg["cgroupsPerQOS"], cfg["enforceNodeAllocatable"]) == ("cgroupfs", False, [])
    # Nothing under the host's /usr/libexec or /var/log/pods: both point into the given directory.
    assert cfg["volumePluginDir"] == str(tmp_path / "volumes") and cfg["podLogsDir"] == str(tmp_path / "logs")


def _check(cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUTOPO_CACHE": str(cache)}
    return subprocess.run(["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, env=env, check=False)


def test_build_check_counts_a_cache_without_the_kubelet_or_fakecri_as_incomplete(tmp_path: Path) -> None:
    first = _check(tmp_path)
    assert first.returncode == 3
    bin_dir = Path(first.stdout.strip())
    bin_dir.mkdir(parents=True)
    for n in ALL_BINARIES:
        if n not in ("kubelet", "fakecri"):
            _bin_dir(bin_dir.parent, (n,))
    assert _check(tmp_path).returncode == 3
    _bin_dir(bin_dir.parent, ("kubelet", "fakecri"))
    done = _check(tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, str(bin_dir))
