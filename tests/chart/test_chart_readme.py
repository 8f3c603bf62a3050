"""The chart's README values table is generated from values.yaml and the schema, and committed fresh."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.chart.helm import CHART, ROOT, values_doc

SCRIPT = ROOT / "scripts" / "chart_values_doc.py"


def test_chart_readme_values_table_is_what_the_generator_prints() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_chart_readme_lists_every_value_once() -> None:
    readme = (CHART / "README.md").read_text()
    for doc in values_doc().walk((CHART / "values.yaml").read_text()):
        assert readme.count(f"| `{doc.path}` |") == 1, doc.path


def test_ct_config_lints_this_chart_with_its_ci_scenarios() -> None:
    ct = yaml.safe_load((ROOT / "ct.yaml").read_text())
    assert ct["chart-dirs"] == ["charts"]
    assert ct["validate-maintainers"] is False
    assert (ROOT / ct["chart-dirs"][0] / "gputopo" / "ci").is_dir()
