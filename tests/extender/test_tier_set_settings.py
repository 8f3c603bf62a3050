"""GPUTOPO_TIERS carries tier sets (docs/configuration.md, "Tier sets per hardware shape"); a bad one is
refused naming the variable and where in the document it is wrong."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gputopo.extender.settings import describe_error, load_settings
from gputopo.tiers import DEFAULT_TIERS

TOPOGRAPH = [
    {"name": "spine", "labels": ["fabric.topograph.run/tier-2"]},
    {"name": "leaf", "labels": ["fabric.topograph.run/tier-1"]},
    {"name": "nvlink-domain", "labels": ["accelerator.topograph.run/domain"], "groupCap": 16},
]
GB200 = {"name": "gb200", "match": {"nvidia.com/gpu.product": "NVIDIA-GB200"}, "tiers": TOPOGRAPH}


def test_tier_sets_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUTOPO_TIERS", json.dumps({"sets": [GB200]}))
    tiers = load_settings().tiers
    assert tiers.tiers == DEFAULT_TIERS.tiers
    assert tiers.for_labels({"nvidia.com/gpu.product": "NVIDIA-GB200"})[0] == "gb200"
    assert tiers.of_set("gb200").tiers[2].group_cap == 16


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        pytest.param(
            {"sets": [{**GB200, "match": {}}]},
            "GPUTOPO_TIERS at sets.0.match: Dictionary should have at least 1 item",
            id="empty-match",
        ),
        pytest.param(
            {"sets": [{**GB200, "tiers": TOPOGRAPH[:2]}]},
            "GPUTOPO_TIERS: tier set 'gb200' has tiers spine, leaf; every set needs the top-level tiers' names",
            id="a-tier-missing",
        ),
        pytest.param({"sets": [GB200, GB200]}, "GPUTOPO_TIERS: tier set 'gb200' is named twice", id="duplicate-name"),
    ],
)
def test_a_bad_tier_set_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, document: dict[str, object], expected: str
) -> None:
    monkeypatch.setenv("GPUTOPO_TIERS", json.dumps(document))
    with pytest.raises(ValidationError) as err:
        load_settings()
    assert describe_error(err.value).startswith(expected), describe_error(err.value)
