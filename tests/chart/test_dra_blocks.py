"""The chart's clique-block classes (agent.dra.blocks, agent.dra.extendedResources,
agent.dra.gpuExtendedResource): which DeviceClasses each Kubernetes release gets, what they select, which
extended resource each carries, and that the agent and the webhook are told the same."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gputopo.engine.dra.devices import DEVICE_CLASS
from gputopo.model.dra import BLOCK_SIZES, block_class, block_resource
from tests.chart.helm import CI_DIR, Doc, by_kind, container, env_of, one, run_helm, template_args

RELEASES = ("1.34.4", "1.35.2", "1.36.0", "1.37.2")


def render_at(version: str, **values: str) -> list[Doc]:
    sets = {"agent.dra.enabled": "true", "webhook.enabled": "true"}
    sets |= {k.replace("__", "."): v for k, v in values.items()}
    cmd = template_args((CI_DIR / "webhook-values.yaml",), sets)
    cmd[cmd.index("--kube-version") + 1] = version
    return [d for d in yaml.safe_load_all(run_helm(cmd).stdout) if d]


def classes(docs: list[Doc]) -> dict[str, Any]:
    return {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "DeviceClass")}


@pytest.mark.parametrize(
    ("version", "values", "blocks", "extended"),
    [
        pytest.param("1.34.4", {}, False, False, id="1.34: singles only (no partitionable devices)"),
        pytest.param("1.35.2", {}, False, False, id="1.35: singles only (partitionable devices off)"),
        pytest.param("1.36.0", {}, True, True, id="1.36: block classes with their extended resources"),
        pytest.param("1.37.2", {}, True, True, id="1.37: block classes with their extended resources"),
        pytest.param("1.37.2", {"agent__dra__extendedResources": "false"}, True, False, id="extended resources off"),
        pytest.param("1.37.2", {"agent__dra__blocks": "false"}, False, False, id="blocks off"),
    ],
)
def test_each_release_gets_the_classes_it_can_serve(
    version: str, values: dict[str, str], blocks: bool, extended: bool
) -> None:
    docs = render_at(version, **values)
    found = classes(docs)
    names = [DEVICE_CLASS, *(block_class(s) for s in BLOCK_SIZES)] if blocks else [DEVICE_CLASS]
    assert sorted(found) == sorted(names)
    for size in BLOCK_SIZES if blocks else ():
        spec = found[block_class(size)]
        assert spec.get("extendedResourceName") == (block_resource(size) if extended else None)
        expression = spec["selectors"][0]["cel"]["expression"]
        assert expression.endswith(f'device.attributes["gpu.gputopo.io"].blockSize == {size}')
        assert '"blockSize" in device.attributes["gpu.gputopo.io"]' in expression  # never a missing-key error
    assert "extendedResourceName" not in found[DEVICE_CLASS]
    args = container(one(docs, "DaemonSet", component="agent"))["args"]
    assert ("--dra-blocks" in args) is blocks
    env = env_of(container(one(docs, "Deployment", component="scheduler"), "extender"))
    assert (env.get("GPUTOPO_DRA_BLOCKS") == "true") is blocks  # the webhook's claims ask what is published


def test_the_singles_class_selects_single_gpus_with_or_without_the_attribute() -> None:
    expression = classes(render_at("1.34.4"))[DEVICE_CLASS]["selectors"][0]["cel"]["expression"]
    assert expression == (
        'device.driver == "gpu.gputopo.io" && (!("blockSize" in device.attributes["gpu.gputopo.io"]) || '
        'device.attributes["gpu.gputopo.io"].blockSize == 1)'
    )


@pytest.mark.parametrize(("version", "mapped"), [("1.35.2", False), ("1.36.0", True)])
def test_nvidia_gpu_maps_onto_the_singles_only_when_asked_and_served(version: str, mapped: bool) -> None:
    assert "extendedResourceName" not in classes(render_at(version))[DEVICE_CLASS]
    spec = classes(render_at(version, agent__dra__gpuExtendedResource="true"))[DEVICE_CLASS]
    assert spec.get("extendedResourceName") == ("nvidia.com/gpu" if mapped else None)


@pytest.mark.parametrize("value", ["blocks", "extendedResources", "gpuExtendedResource"])
def test_the_block_values_are_booleans(value: str) -> None:
    cmd = template_args((), {"agent.dra.enabled": "true", f"agent.dra.{value}": "yes"})
    proc = run_helm(cmd, check=False)
    assert proc.returncode != 0
    assert value in proc.stderr


def test_mapping_nvidia_gpu_without_dra_fails_naming_the_value() -> None:
    proc = run_helm(template_args((), {"agent.dra.gpuExtendedResource": "true"}), check=False)
    assert proc.returncode != 0
    assert "agent.dra.gpuExtendedResource maps nvidia.com/gpu onto gputopo's DRA devices" in proc.stderr
