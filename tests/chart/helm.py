"""Run helm against charts/gputopo and parse what it renders (shared by the chart tests).

helm is found, in order: ``$GPUTOPO_HELM``; ``$GPUTOPO_BIN_DIR/helm``; the pinned build of
``gputopo/localcluster/build_binaries.sh`` (checked, never started here); ``helm`` on PATH. Tests
that need helm skip with that explanation when none is found.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gputopo.localcluster.binaries import find_binaries
from gputopo.model import DEFAULT_NAMESPACE
from tests.paths import REPO

ROOT = REPO
CHART = ROOT / "charts" / "gputopo"
CI_DIR = CHART / "ci"
RELEASE = "gputopo"
NAMESPACE = DEFAULT_NAMESPACE
KUBE_VERSION = "1.34.4"

Doc = dict[str, Any]


@functools.cache
def find_helm() -> str | None:
    env = os.environ.get("GPUTOPO_HELM")
    if env:
        return env
    bin_dir = os.environ.get("GPUTOPO_BIN_DIR")
    if bin_dir and (Path(bin_dir) / "helm").is_file():
        return str(Path(bin_dir) / "helm")
    found = find_binaries()
    if found is not None and (found / "helm").is_file():
        return str(found / "helm")
    return shutil.which("helm")


def helm_or_skip() -> str:
    helm = find_helm()
    if helm is None:
        pytest.skip(
            "helm not found: set GPUTOPO_HELM, or build the pinned binaries with "
            "`bash gputopo/localcluster/build_binaries.sh`"
        )
    return helm


def run_helm(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    helm = helm_or_skip()
    proc = subprocess.run([helm, *args], capture_output=True, text=True, check=False, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def template_args(
    values_files: Iterable[str | Path] = (), sets: Mapping[str, str] | None = None, *extra: str
) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for f in values_files:
        args += ["-f", str(f)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return [*args, *extra]


@functools.cache
def _render_cached(values_files: tuple[str, ...], sets: tuple[tuple[str, str], ...]) -> tuple[Doc, ...]:
    proc = run_helm(template_args(values_files, dict(sets)))
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(values_files: Iterable[str | Path] = (), **sets: str) -> list[Doc]:
    """The rendered documents; ``sets`` are ``--set`` pairs with dots written as ``__``."""
    files = tuple(str(CI_DIR / f) if not Path(f).is_absolute() else str(f) for f in values_files)
    pairs = tuple(sorted((k.replace("__", "."), v) for k, v in sets.items()))
    return list(_render_cached(files, pairs))


def render_fails(**sets: str) -> str:
    """Render with ``sets`` expecting failure; returns helm's error output."""
    pairs = {k.replace("__", "."): v for k, v in sets.items()}
    proc = run_helm(template_args((), pairs), check=False)
    assert proc.returncode != 0, f"expected the render to fail for {pairs}"
    return proc.stderr


def by_kind(docs: Sequence[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: Sequence[Doc], kind: str, component: str | None = None, name: str | None = None) -> Doc:
    found = [
        d
        for d in by_kind(docs, kind)
        if (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
        and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} (component={component}, name={name}), found {len(found)}"
    return found[0]


def container(workload: Doc, name: str | None = None) -> Doc:
    containers: list[Doc] = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def env_of(c: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def scheduler_config(docs: Sequence[Doc]) -> Doc:
    cm = one(docs, "ConfigMap", component="scheduler")
    cfg: Doc = yaml.safe_load(cm["data"]["config.yaml"])
    return cfg


def ci_values_files() -> list[Path]:
    return sorted(CI_DIR.glob("*-values.yaml"))


@functools.cache
def values_doc() -> ModuleType:
    """scripts/chart_values_doc.py, the generator of the chart README's values table."""
    path = ROOT / "scripts" / "chart_values_doc.py"
    spec = importlib.util.spec_from_file_location("chart_values_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
