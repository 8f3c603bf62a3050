"""The real-kubelet harness without a kubelet: when it refuses to run, its configuration, and the
build script's notion of a complete cache (which now includes the kubelet and fakecri)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gputopo.localcluster.binaries import BUILD_SCRIPT
from gputopo.localcluster.kubelet import (
    _NAMESPACE_SETUP,
    FIXED_DEVICE_PLUGIN_DIR,
    in_private_mounts,
    kubelet_configuration,
    kubelet_unavailable,
)

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


def _mount_fields(mountinfo: str, point: Path) -> list[str] | None:
    """The optional fields (``shared:N``, ...) of the mount whose mount point is ``point``, or None."""
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if fields[4] == str(point):
            found = fields[6 : fields.index("-")]  # the last mount at a point is the one seen
    return found


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_kubelet_namespace_hands_the_kubelet_a_root_dir_that_is_already_a_shared_mount(tmp_path: Path) -> None:
    # A kubelet whose root is not on a shared mount bind-mounts it onto itself while it creates its
    # sockets under it; a rename racing that mount failed with EXDEV. Shared already, it mounts nothing.
    (tmp_path / "root").mkdir()
    (tmp_path / "device-plugins").mkdir()
    FIXED_DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)  # as RealKubelet.start makes it
    argv = in_private_mounts(_NAMESPACE_SETUP, tmp_path, ["cat", "/proc/self/mountinfo"])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    fields = _mount_fields(out, tmp_path / "root")
    assert fields is not None, "the root dir is no mount point of its own"
    assert any(f.startswith("shared:") for f in fields), fields
    # ... and none of it leaks onto the host's mounts.
    assert _mount_fields(Path("/proc/self/mountinfo").read_text(), tmp_path / "root") is None
