"""The chart's `tierSets` reach the extender as the `sets` of GPUTOPO_TIERS, with or without `tiers`, and the
schema refuses a malformed set before anything is installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gputopo.tiers import DEFAULT_TIERS, TierConfig
from tests.chart.helm import container, env_of, one, render, run_helm, template_args

GB200 = {
    "name": "gb200",
    "match": {"nvidia.com/gpu.product": "NVIDIA-GB200"},
    "tiers": [
        {"name": "spine", "labels": ["fabric.topograph.run/tier-2"], "oversubscription": 2},
        {"name": "leaf", "labels": ["fabric.topograph.run/tier-1"]},
        {"name": "nvlink-domain", "labels": ["accelerator.topograph.run/domain"], "groupCap": 16},
    ],
}


def tiers_setting(tmp_path: Path, values: dict[str, object]) -> str | None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    env = env_of(container(one(render([path]), "Deployment", component="scheduler"), "extender"))
    value = env.get("GPUTOPO_TIERS")
    assert value is None or isinstance(value, str)
    return value


def test_tier_sets_alone_keep_the_default_tiers_beside_them(tmp_path: Path) -> None:
    setting = tiers_setting(tmp_path, {"tierSets": [GB200]})
    assert setting is not None
    tiers = TierConfig.model_validate_json(setting)
    assert tiers.tiers == DEFAULT_TIERS.tiers
    assert [s.name for s in tiers.sets] == ["gb200"]
    assert tiers.for_labels({"nvidia.com/gpu.product": "NVIDIA-GB200"})[0] == "gb200"
    assert tiers.sets[0].tiers[2].group_cap == 16


def test_the_ci_scenario_passes_its_own_tiers_and_a_set_for_gb200() -> None:
    env = env_of(container(one(render(["custom-tiers-values.yaml"]), "Deployment", component="scheduler"), "extender"))
    tiers = TierConfig.model_validate_json(env["GPUTOPO_TIERS"])
    assert tiers.names == ("pod", "rack", "nvlink-domain")
    assert tiers.of_set("gb200").switch_of({"fabric.topograph.run/tier-1": "r1"}, "rack") == "r1"


def test_no_tiers_and_no_sets_pass_no_setting(tmp_path: Path) -> None:
    assert tiers_setting(tmp_path, {"tiers": [], "tierSets": []}) is None


@pytest.mark.parametrize(
    ("tier_set", "words"),
    [
        pytest.param({k: v for k, v in GB200.items() if k != "match"}, "match", id="no-match"),
        pytest.param({**GB200, "match": {}}, "match", id="empty-match"),
        pytest.param({**GB200, "tiers": [{"name": "spine"}]}, "labels", id="a-tier-without-labels"),
        pytest.param({**GB200, "matches": {}}, "matches", id="unknown-key"),
    ],
)
def test_the_schema_refuses_a_malformed_tier_set(tmp_path: Path, tier_set: dict[str, object], words: str) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"tierSets": [tier_set]}))
    proc = run_helm(template_args([path]), check=False)
    assert proc.returncode != 0 and "tierSets" in proc.stderr and words in proc.stderr, proc.stderr
