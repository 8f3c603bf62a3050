"""The wire models: round trips, strict validation, and errors that name the annotation and value."""

from __future__ import annotations

import json

import pytest

from gputopo.model import (
    AnnotationError,
    NetworkKind,
    NvlinkPolicy,
    Placement,
    RunnerUp,
    Spread,
    format_gpus_in_use,
    is_gputopo_pod,
    parse_gpus_in_use,
    parse_placement,
    parse_pod_request,
    parse_quantity_bytes,
    parse_topology,
)
from gputopo.systems import SYSTEMS, build_system


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_topology_annotation_round_trips_for_every_named_system(name: str) -> None:
    topo = build_system(name, "node-a")
    text = topo.to_annotation()
    assert parse_topology(text) == topo
    assert text == parse_topology(text).to_annotation(), "serialisation must be deterministic"
    assert '", "' not in text and '": ' not in text, "compact JSON separators"


def test_topology_annotation_uses_design_md_camel_case_keys() -> None:
    doc = json.loads(build_system("dgx-h100").to_annotation())
    assert set(doc) == {"version", "gpus", "nvlink", "degradedLinks", "nics"}
    assert {"index", "uuid", "model", "memoryMiB", "pciBusId", "numaNode", "health", "reasons"} <= set(doc["gpus"][0])
    assert {"generation", "gbpsPerLink", "nvswitch", "links"} <= set(doc["nvlink"])
    assert {"name", "linkLayer", "state", "rateGbps", "numaNode", "pciBusId", "gpuAffinity"} <= set(doc["nics"][0])
    assert "fabric" not in doc, "fabric appears only for multi-node NVLink domains"
    assert "fabric" in json.loads(build_system("gb200-tray").to_annotation())


def _doc(**changes: object) -> str:
    doc = json.loads(build_system("hgx-a100-4").to_annotation())
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("not json", "not JSON", id="not-json"),
        pytest.param("[1,2]", "must be a JSON object", id="not-an-object"),
        pytest.param(_doc(version=2), "unsupported schema version 2", id="unknown-schema-version"),
        pytest.param(
            _doc(nvlink={"generation": 3, "gbpsPerLink": 25, "nvswitch": False, "links": [[0, 4], [4, 0]]}),
            "expected 4x4",
            id="links-matrix-wrong-size",
        ),
        pytest.param(
            _doc(nvlink={"links": [[0, 4, 4, 4], [3, 0, 4, 4], [4, 4, 0, 4], [4, 4, 4, 0]]}),
            "not symmetric",
            id="links-matrix-asymmetric",
        ),
        pytest.param(_doc(surprise=1), "surprise", id="unknown-key-rejected"),
        pytest.param(
            _doc(degradedLinks=[{"gpu": 9, "link": 0, "state": "down"}]), "names GPU 9", id="degraded-gpu-out-of-range"
        ),
    ],
)
def test_invalid_topology_is_an_error_naming_the_annotation(text: str, fragment: str) -> None:
    with pytest.raises(AnnotationError) as err:
        parse_topology(text)
    assert "gputopo.io/topology" in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("text", "count", "expected"),
    [
        pytest.param("[]", 8, frozenset(), id="empty"),
        pytest.param("[0,5]", 8, frozenset({0, 5}), id="two-gpus"),
    ],
)
def test_gpus_in_use_parses_index_lists(text: str, count: int, expected: frozenset[int]) -> None:
    assert parse_gpus_in_use(text, count) == expected
    assert parse_gpus_in_use(format_gpus_in_use(set(expected)), count) == expected


@pytest.mark.parametrize("text", ["{}", "[1.5]", "[true]", "[-1]", "[8]", "nope"])
def test_gpus_in_use_rejects_anything_but_valid_indices(text: str) -> None:
    with pytest.raises(AnnotationError, match=r"gputopo\.io/gpus-in-use"):
        parse_gpus_in_use(text, 8)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param(None, False, id="no-annotations"),
        pytest.param({"app": "x"}, False, id="foreign-annotations"),
        pytest.param({"gputopo.io/placement": "{}"}, False, id="only-our-output-annotation"),
        pytest.param({"gputopo.io/nvlink": "required"}, True, id="opted-in"),
    ],
)
def test_pod_opt_in_needs_a_request_annotation(annotations: dict[str, str] | None, expected: bool) -> None:
    assert is_gputopo_pod(annotations) is expected


def test_pod_request_defaults_follow_design_md() -> None:
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, 4)
    assert (req.gpus, req.nvlink, req.network, req.spread, req.group) == (
        4,
        NvlinkPolicy.REQUIRED,
        NetworkKind.ANY,
        Spread.NODE,
        None,
    )


def test_pod_request_parses_every_annotation() -> None:
    req = parse_pod_request(
        {
            "gputopo.io/nvlink": "preferred",
            "gputopo.io/min-gpu-memory": "100Gi",
            "gputopo.io/group": "llama-70b",
            "gputopo.io/group-size": "4",
            "gputopo.io/stage": "2",
            "gputopo.io/network": "infiniband",
            "gputopo.io/spread": "none",
            "gputopo.io/required-tier": "spine",
            "gputopo.io/preferred-tier": "leaf",
        },
        8,
    )
    assert req.min_gpu_memory_mib == 100 * 1024
    assert (req.group, req.group_size, req.stage) == ("llama-70b", 4, 2)
    assert (req.required_tier, req.preferred_tier) == ("spine", "leaf")
    assert req.spread is Spread.NONE and req.network is NetworkKind.INFINIBAND and req.nvlink is NvlinkPolicy.PREFERRED


@pytest.mark.parametrize(
    ("annotations", "key", "why"),
    [
        pytest.param({"gputopo.io/nvlink": "sometimes"}, "gputopo.io/nvlink", "must be one of", id="bad-nvlink"),
        pytest.param({"gputopo.io/min-gpu-memory": "lots"}, "gputopo.io/min-gpu-memory", "quantity", id="bad-memory"),
        pytest.param({"gputopo.io/network": "ethernet"}, "gputopo.io/network", "must be one of", id="bad-network"),
        pytest.param(
            {"gputopo.io/group": "Llama_70B", "gputopo.io/group-size": "2"},
            "gputopo.io/group",
            "DNS-1123",
            id="bad-group-name",
        ),
        pytest.param({"gputopo.io/group": "g"}, "gputopo.io/group", "group-size", id="group-without-size"),
        pytest.param(
            {"gputopo.io/group-size": "4"}, "gputopo.io/group-size", "gputopo.io/group", id="size-without-group"
        ),
        pytest.param(
            {"gputopo.io/group": "g", "gputopo.io/group-size": "four"},
            "gputopo.io/group-size",
            "integer",
            id="size-not-integer",
        ),
        pytest.param(
            {"gputopo.io/group": "g", "gputopo.io/group-size": "0"}, "gputopo.io/group-size", "between", id="size-zero"
        ),
        pytest.param(
            {"gputopo.io/group": "g", "gputopo.io/group-size": "4", "gputopo.io/stage": "4"},
            "gputopo.io/stage",
            "between 0 and 3",
            id="stage-out-of-range",
        ),
        pytest.param(
            {"gputopo.io/required-tier": "rack"}, "gputopo.io/required-tier", "unknown tier", id="unknown-tier"
        ),
        pytest.param(
            {"gputopo.io/nvlnk": "required"}, "gputopo.io/nvlnk", "unknown gputopo annotation", id="typo-in-key"
        ),
    ],
)
def test_malformed_pod_annotation_error_names_annotation_and_value(
    annotations: dict[str, str], key: str, why: str
) -> None:
    with pytest.raises(AnnotationError) as err:
        parse_pod_request(annotations, 4)
    assert err.value.key == key
    assert f"invalid annotation {key}=" in str(err.value)
    assert json.dumps(annotations[key]) in str(err.value)
    assert why in str(err.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80Gi", 80 * 1024**3), ("100G", 100 * 10**9), ("81920Mi", 81920 * 1024**2), ("1.5Ti", int(1.5 * 1024**4))],
)
def test_quantities_follow_kubernetes_suffixes(text: str, expected: int) -> None:
    assert parse_quantity_bytes(text) == expected


def test_placement_annotation_round_trips_with_runner_up() -> None:
    p = Placement(
        node="gpu-07", gpus=(0, 1, 2, 3), score=9, reason="why", runner_up=RunnerUp(node="gpu-09", score=7, why="split")
    )
    doc = json.loads(p.to_annotation())
    assert doc["runnerUp"] == {"node": "gpu-09", "score": 7, "why": "split"}
    assert parse_placement(p.to_annotation()) == p


def test_placement_annotation_rejects_garbage() -> None:
    with pytest.raises(AnnotationError, match=r"gputopo\.io/placement"):
        parse_placement('{"node": "x"}')
