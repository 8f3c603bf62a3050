"""helm lint accepts the chart with every CI scenario file, and the schema rejects bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart.helm import CHART, KUBE_VERSION, ci_values_files, render_fails, run_helm


def test_every_documented_scenario_has_a_ci_values_file() -> None:
    names = {p.name for p in ci_values_files()}
    assert {
        "default-values.yaml",
        "webhook-values.yaml",
        "cert-manager-values.yaml",
        "custom-tiers-values.yaml",
        "dra-values.yaml",
    } <= names


@pytest.mark.parametrize("values_file", ci_values_files(), ids=lambda p: p.name)
def test_helm_lint_strict_passes_for_scenario(values_file: Path) -> None:
    proc = run_helm(["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, "-f", str(values_file)])
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param({"unknownTopLevel": "1"}, "additional properties", id="unknown top-level value"),
        pytest.param({"scheduler__replicas": "0"}, "minimum", id="zero scheduler replicas"),
        pytest.param({"extender__metricsPort": "0"}, "minimum", id="the probes need the metrics port"),
        pytest.param({"extender__maxRequestBytes": "1024"}, "maxRequestBytes", id="body limit under 64 KiB"),
        pytest.param({"extender__replicas": "2"}, "additional properties", id="no separate extender Deployment"),
        pytest.param({"webhook__failurePolicy": "Sometimes"}, "failurePolicy", id="bad webhook failurePolicy"),
        pytest.param({"agent__backend": "cuda"}, "backend", id="unknown agent backend"),
        pytest.param({"scheduler__extender__weight": "0"}, "weight", id="extender weight must be positive"),
        pytest.param({"logLevel": "loud"}, "logLevel", id="unknown log level"),
    ],
)
def test_schema_rejects_invalid_values(sets: dict[str, str], expected: str) -> None:
    assert expected in render_fails(**sets)


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param(
            {"certManager__enabled": "true", "tls__existingSecret": "mine"},
            "exclusive",
            id="cert-manager and an existing Secret",
        ),
        pytest.param(
            {"webhook__enabled": "true", "tls__existingSecret": "mine"},
            "tls.caBundle",
            id="webhook with an existing Secret needs its CA",
        ),
        pytest.param(
            {"webhook__enabled": "true", "scheduler__enabled": "false"},
            "webhook.enabled needs scheduler.enabled",
            id="webhook without the scheduler pods that serve it",
        ),
    ],
)
def test_impossible_combinations_fail_with_an_actionable_message(sets: dict[str, str], expected: str) -> None:
    assert expected in render_fails(**sets)


def test_template_without_kube_version_names_the_required_version() -> None:
    # helm assumes Kubernetes 1.20 when it has no cluster; the chart must refuse that loudly.
    proc = run_helm(["template", "gputopo", str(CHART)], check=False)
    assert proc.returncode != 0
    assert "requires kubeVersion: >=1.30.0-0" in proc.stderr
    assert run_helm(["template", "gputopo", str(CHART), "--kube-version", KUBE_VERSION]).returncode == 0
