"""Locate or build the pinned upstream binaries (kube-apiserver, kube-scheduler, kube-controller-manager,
kubectl, etcd, helm; also kubelet and fakecri, which only ``kubelet.RealKubelet`` needs and checks for
itself).

The build itself is ``build_binaries.sh`` next to this module (shipped as package data): it builds
from the Go module proxy once per machine into ``$GPUTOPO_CACHE/<version key>/bin`` and reuses that
directory afterwards. The script is the single source of truth for versions and the cache key;
this module only runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

BUILD_SCRIPT = Path(__file__).with_name("build_binaries.sh")
REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "helm")


class BinariesError(RuntimeError):
    """The binaries are missing or could not be built."""


def _script_env() -> dict[str, str]:
    # GPUTOPO_CACHE and the GPUTOPO_*_VERSION pins pass through the environment unchanged.
    return dict(os.environ)


def find_binaries() -> Path | None:
    """Return the bin directory if every binary is already built, else None. Builds nothing."""
    env_dir = os.environ.get("GPUTOPO_BIN_DIR")
    if env_dir:
        d = Path(env_dir)
        return d if all((d / b).is_file() for b in REQUIRED_BINARIES) else None
    complete, bin_dir = _check()
    return bin_dir if complete else None


def expected_bin_dir() -> Path:
    """The directory the build script uses (whether or not it is complete)."""
    return _check()[1]


def kubernetes_version(bin_dir: Path) -> tuple[int, int, int]:
    """The (major, minor, patch) of the kube-scheduler in ``bin_dir``, from ``--version`` ("Kubernetes
    v1.37.2"): what version-dependent behaviour (e2e expectations) keys on, whichever way the directory
    was chosen (the build's cache key or ``GPUTOPO_BIN_DIR``)."""
    out = subprocess.run(
        [str(bin_dir / "kube-scheduler"), "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise BinariesError(f"{bin_dir / 'kube-scheduler'} --version printed no version: {out.strip()!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def _check() -> tuple[bool, Path]:
    """Ask the build script, without building: (all binaries present, their directory)."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"],
        capture_output=True,
        text=True,
        env=_script_env(),
        check=False,
    )
    return proc.returncode == 0, Path(proc.stdout.strip().splitlines()[-1])


def run_script(
    argv: Sequence[str], progress: Callable[[str], None] | None, env: Mapping[str, str] | None = None
) -> tuple[int, str, list[str]]:
    """Run a build script: its exit status, its stdout, and the last 40 lines of its stderr, each of
    which goes to ``progress`` as it comes. ``env`` None: this process's environment."""
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        for raw in proc.stderr:
            line = raw.rstrip("\n")
            tail.append(line)
            if progress is not None:
                progress(line)
        out = proc.stdout.read()
        rc = proc.wait()
    return rc, out, list(tail)


def ensure_binaries(progress: Callable[[str], None] | None = None) -> Path:
    """Build the binaries if needed (first run: tens of minutes) and return the bin directory.

    ``progress`` receives each line the build script writes to stderr (its progress messages and
    the Go toolchain's output). Honours ``GPUTOPO_CACHE`` and the ``GPUTOPO_*_VERSION`` pins;
    ``GPUTOPO_BIN_DIR`` names a ready directory and skips the script.
    """
    env_dir = os.environ.get("GPUTOPO_BIN_DIR")
    if env_dir:
        d = Path(env_dir)
        missing = [b for b in REQUIRED_BINARIES if not (d / b).is_file()]
        if missing:
            raise BinariesError(f"GPUTOPO_BIN_DIR={d} lacks {', '.join(missing)}")
        return d
    rc, out, tail = run_script(["bash", str(BUILD_SCRIPT)], progress, env=_script_env())
    if rc != 0:
        raise BinariesError(f"{BUILD_SCRIPT} failed with exit status {rc}; last output:\n" + "\n".join(tail))
    lines = out.strip().splitlines()
    if not lines:
        raise BinariesError(f"{BUILD_SCRIPT} printed no bin directory")
    bin_dir = Path(lines[-1])
    missing = [b for b in REQUIRED_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BinariesError(f"{bin_dir} lacks {', '.join(missing)} after the build")
    return bin_dir
