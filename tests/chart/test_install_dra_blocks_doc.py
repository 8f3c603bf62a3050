"""docs/install.md, "Clique blocks: what a pod can ask for": every YAML example a user copies is checked
against what the chart renders on 1.37 (the classes and extended resources it names exist), what the
extender reads (the block a pod asks for) and what the webhook builds (the prioritized-list claim)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from gputopo.engine.dra.claims import check_spec, claim_template
from gputopo.extender.watch.parsers import resolve_pod
from gputopo.extender.wire import pod_info
from gputopo.model.dra import BLOCK_SIZES, block_class, block_resource
from gputopo.model.request import PodRequest
from tests.chart.helm import by_kind, run_helm, template_args
from tests.paths import REPO

SECTION = "### Clique blocks: what a pod can ask for"


def section() -> str:
    text = (REPO / "docs" / "install.md").read_text()
    start = text.index(SECTION)
    return text[start : min(text.index("\n## ", start), text.index("\n### ", start + 1))]


def examples() -> list[dict[str, Any]]:
    blocks = re.findall(r"```yaml\n(.*?)```", section(), re.S)
    return [d for b in blocks for d in yaml.safe_load_all(b) if d]


def rendered_classes() -> dict[str, dict[str, Any]]:
    cmd = template_args((), {"agent.dra.enabled": "true"})
    cmd[cmd.index("--kube-version") + 1] = "1.37.2"
    docs = [d for d in yaml.safe_load_all(run_helm(cmd).stdout) if d]
    return {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "DeviceClass")}


def _classes_named(devices: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for r in devices["requests"]:
        for d in r.get("firstAvailable") or [r["exactly"]]:
            out.add(d["deviceClassName"])
    return out


def test_the_section_shows_each_way_to_ask() -> None:
    kinds = [d["kind"] for d in examples()]
    assert kinds.count("Pod") == 3 and kinds.count("ResourceClaimTemplate") == 2


def test_every_class_and_extended_resource_the_examples_name_is_one_the_chart_renders() -> None:
    classes = rendered_classes()
    resources = {spec.get("extendedResourceName") for spec in classes.values()}
    for doc in examples():
        if doc["kind"] == "ResourceClaimTemplate":
            devices = doc["spec"]["spec"]["devices"]
            check_spec(devices)
            assert _classes_named(devices) <= set(classes)
        if doc["kind"] == "Pod":
            for c in doc["spec"]["containers"]:
                for name in c["resources"].get("limits", {}):
                    assert name == "nvidia.com/gpu" or name in resources


def test_the_table_lists_the_classes_the_chart_renders() -> None:
    text = section()
    for size in BLOCK_SIZES:
        assert f"| `{block_class(size)}` |" in text and f"`{block_resource(size)}` |" in text
    assert sorted(rendered_classes()) == sorted(["gpu.gputopo.io", *(block_class(s) for s in BLOCK_SIZES)])


def test_the_extended_resource_pod_is_a_gputopo_pod_asking_one_whole_block() -> None:
    pod = next(d for d in examples() if d["metadata"]["name"] == "tp4")
    pod["metadata"]["namespace"] = "default"
    resolved = resolve_pod(pod_info(pod), ("spine", "leaf"))
    assert resolved.request is not None
    assert (resolved.request.gpus, resolved.request.block) == (4, True)


@pytest.mark.parametrize("name", ["quad-or-clique"])
def test_the_prioritized_list_is_the_claim_the_webhook_builds(name: str) -> None:
    template = next(d for d in examples() if d["metadata"]["name"] == name)
    built = claim_template(PodRequest(gpus=4), list_attributes=False, blocks=True)
    assert template["spec"]["spec"]["devices"] == built.devices
