"""The extender sees every pod of gputopo's profile by default (managedResources empty), so that a group's
members without GPUs are placed with their group; a user's list narrows it and is rendered as given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import render, scheduler_config


def _managed(docs: list[dict[str, Any]]) -> Any:
    (ext,) = scheduler_config(docs)["extenders"]
    return ext["managedResources"]


def test_by_default_kube_scheduler_sends_the_extender_every_pod_of_the_profile() -> None:
    assert _managed(render()) == []


@pytest.mark.parametrize(
    "managed",
    [
        [{"name": "nvidia.com/gpu", "ignoredByScheduler": False}],
        [{"name": "nvidia.com/gpu", "ignoredByScheduler": False}, {"name": "example.com/fpga"}],
    ],
)
def test_a_users_list_is_kept_as_given(tmp_path: Path, managed: list[dict[str, Any]]) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"scheduler": {"extender": {"managedResources": managed}}}))
    assert _managed(render([values])) == managed
