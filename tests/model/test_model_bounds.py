"""Value bounds of the wire models, and fuzzing of every annotation parser and the snapshot file: hostile
or corrupt values give a clean error naming the annotation (or the node), fast, never another exception."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.clusterfile import ClusterFileError, load_cluster
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.snapshot import node_state
from gputopo.model import (
    ANN_GROUP,
    ANN_GROUP_SIZE,
    ANN_MIN_GPU_MEMORY,
    ANN_NVLINK,
    ANN_STAGE,
    MAX_GPUS_PER_NODE,
    POD_OPT_IN_ANNOTATIONS,
    AnnotationError,
    FabricHealth,
    GpusInUse,
    NodeTopology,
    PodRequest,
    decode_health,
    parse_gpus_in_use_report,
    parse_placement,
    parse_pod_request,
    parse_quantity,
    parse_quantity_bytes,
    parse_topology,
    tray_health,
)
from gputopo.systems import build_system

# More examples: GPUTOPO_FUZZ_EXAMPLES=2000 (few by default: the suite runs on a busy 2-core CI).
FUZZ = settings(
    max_examples=int(os.environ.get("GPUTOPO_FUZZ_EXAMPLES", "60")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NASTY = ["NaN", "inf", "-inf", "1e400", "-1", "0", "0.5", "9" * 400, "", " ", "é" * 300, "80Gi", "2k", "1e-3"]


def _topology(**gpu0: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(build_system("hgx-a100-4", "n").to_annotation())
    doc["gpus"][0].update(gpu0)
    return doc


def _with(doc: dict[str, Any], path: str, value: Any) -> str:
    *parents, last = path.split(".")
    node: Any = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[int(last) if last.isdigit() else last] = value
    return json.dumps(doc)


def _gpus(n: int) -> list[dict[str, Any]]:
    return [{"index": i, "uuid": f"GPU-{i}", "model": "m", "memoryMiB": 1024} for i in range(n)]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (json.dumps(_topology(memoryMiB=0)), "memoryMiB must be > 0 unless the GPU is failed"),
        (json.dumps(_topology(memoryMiB=2**40)), "memoryMiB"),
        (_with(_topology(), "nvlink.gbpsPerLink", 1e999), "gbpsPerLink"),
        (_with(_topology(), "nvlink.gbpsPerLink", 1e6), "gbpsPerLink"),
        (_with(_topology(), "nvlink.gbpsPerLink", -1), "gbpsPerLink"),
        (_with(_topology(), "nics.0.rateGbps", float("nan")), "rateGbps"),
        (_with(_topology(), "nvlink.links", [[0, 4, 4, 4], [4], [4, 4, 0, 4], [4, 4, 4, 0]]), "links row 1 has 1"),
        (_with(_topology(), "nvlink.links", [[0, 4], [4, 0, 4, 4], [4, 4, 0, 4], [4, 4, 4, 0]]), "links row 0 has 2"),
        (_with(_topology(), "nvlink.links.0.1", 10**6), "links"),
        (json.dumps({"gpus": _gpus(MAX_GPUS_PER_NODE + 1)}), f"{MAX_GPUS_PER_NODE}"),
        (json.dumps(_topology(uuid="x" * 10_000)), "uuid"),
        (_with(_topology(), "degradedLinks", [{"gpu": 0, "link": 10**9, "state": "down"}]), "degradedLinks"),
        ('{"gpus": [' + "9" * 5000 + "]}", "not JSON"),
        ("[" * 50_000 + "]" * 50_000, "nesting too deep"),
        ("[" * 200_000 + "]" * 200_000, "longer than"),
    ],
    ids=[
        "zero memory",
        "a petabyte and more of memory",
        "infinite NVLink rate",
        "NVLink rate past the bound",
        "negative NVLink rate",
        "NaN NIC rate",
        "short row after the first",
        "short first row",
        "a million links between two GPUs",
        "more GPUs than a node can have",
        "10,000-character uuid",
        "degraded link number past the bound",
        "5,000-digit number",
        "nesting 50,000 deep",
        "nesting past the annotation size",
    ],
)
def test_out_of_bounds_topologies_are_annotation_errors(text: str, fragment: str) -> None:
    with pytest.raises(AnnotationError) as err:
        parse_topology(text)
    assert err.value.key == "gputopo.io/topology"
    assert fragment in err.value.why


def test_a_failed_gpu_may_report_no_memory_and_is_never_placed_on() -> None:
    # what the agent publishes for a GPU NVML lost; scoring divides by the memory of the GPUs it picks
    topo = parse_topology(json.dumps(_topology(memoryMiB=0, health="failed")))
    out = evaluate_node(node_state("n", topo), parse_pod_request({ANN_NVLINK: "ignore", ANN_MIN_GPU_MEMORY: "1Gi"}, 2))
    assert out.gpus and 0 not in out.gpus


def test_the_largest_allowed_node_parses() -> None:
    n = MAX_GPUS_PER_NODE
    links = [[0 if i == j else 18 for j in range(n)] for i in range(n)]
    topo = parse_topology(json.dumps({"gpus": _gpus(n), "nvlink": {"nvswitch": True, "links": links}}))
    assert len(topo.gpus) == n


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2", 2), ("2k", 2000), ("500m", 0.5), ("1e3", 1000), ("80Gi", 80 * 1024**3), ("+3", 3), (".5", 0.5)],
    ids=["plain", "decimal suffix", "milli", "exponent", "binary suffix", "signed", "leading dot"],
)
def test_quantities_follow_the_kubernetes_grammar(text: str, expected: float) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("NaN", "not a Kubernetes quantity"),
        ("inf", "not a Kubernetes quantity"),
        ("1e400", "out of range"),
        ("9223372036854775808", "out of range"),
        ("9" * 400, "longer than 64"),
        ("1ki", "not a Kubernetes quantity"),
        ("", "not a Kubernetes quantity"),
    ],
    ids=["NaN", "infinity", "1e400", "past int64", "400 digits", "lower-case binary suffix", "empty"],
)
def test_quantities_outside_the_grammar_or_int64_are_value_errors(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_quantity(text)


def test_memory_quantities_round_up_to_whole_bytes_and_refuse_negatives() -> None:
    assert parse_quantity_bytes("0.5") == 1
    with pytest.raises(ValueError, match="negative"):
        parse_quantity_bytes("-1Gi")


@pytest.mark.parametrize(
    ("annotations", "key"),
    [
        ({ANN_MIN_GPU_MEMORY: "9" * 400}, ANN_MIN_GPU_MEMORY),
        ({ANN_MIN_GPU_MEMORY: "1e400"}, ANN_MIN_GPU_MEMORY),
        ({ANN_MIN_GPU_MEMORY: "NaN"}, ANN_MIN_GPU_MEMORY),
        ({ANN_MIN_GPU_MEMORY: "-80Gi"}, ANN_MIN_GPU_MEMORY),
        ({ANN_GROUP: "g", ANN_GROUP_SIZE: "9" * 4000}, ANN_GROUP_SIZE),
        ({ANN_GROUP: "g", ANN_GROUP_SIZE: "4", ANN_STAGE: "9" * 4000}, ANN_STAGE),
    ],
    ids=[
        "memory of 400 digits",
        "memory 1e400",
        "memory NaN",
        "negative memory",
        "group size of 4000 digits",
        "stage of 4000 digits",
    ],
)
def test_hostile_pod_annotations_are_annotation_errors_in_well_under_a_millisecond(
    annotations: dict[str, str], key: str
) -> None:
    start = time.perf_counter()
    with pytest.raises(AnnotationError) as err:
        parse_pod_request(annotations, 4)
    assert time.perf_counter() - start < 0.05  # generous for a busy CI; the parse itself takes microseconds
    assert err.value.key == key


def test_placement_gpu_indices_are_bounded_to_a_node() -> None:
    with pytest.raises(AnnotationError, match="gpus"):
        parse_placement('{"node":"n","gpus":[1000000000000000000],"score":1,"reason":"r"}')


_TP = {
    "group": 1,
    "groups": 2,
    "gpus": 16,
    "domain": "rack-a",
    "split": [{"domain": "rack-a", "tpGroups": 2}],
    "messageBytes": 1 << 30,
    "allReduceMs": 2.8,
}


def _placement_with_tp(**tp: Any) -> str:
    doc = {"node": "n", "gpus": [0, 1, 2, 3], "score": 1, "reason": "r", "tp": {**_TP, **tp}}
    return json.dumps({k: v for k, v in doc.items() if v is not None})


@pytest.mark.parametrize(
    ("tp", "field"),
    [
        ({"group": -1}, "tp.group"),
        ({"groups": 0}, "tp.groups"),
        ({"gpus": 10**12}, "tp.gpus"),
        ({"split": []}, "tp.split"),
        ({"split": [{"domain": "a", "tpGroups": 1}] * 4097}, "tp.split"),
        ({"split": [{"domain": "a", "tpGroups": 0}]}, "tp.split.0.tpGroups"),
        ({"domain": "d" * 10_000}, "tp.domain"),
        ({"allReduceMs": float("nan")}, "tp.allReduceMs"),
        ({"acrossAllReduceMs": -1}, "tp.acrossAllReduceMs"),
        ({"fill": [1] * 5000}, "tp.fill"),
        ({"capTrays": 0}, "tp.capTrays"),
        ({"messageBytes": 0}, "tp.messageBytes"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_out_of_bounds_tp_values_in_a_placement_are_annotation_errors_naming_the_field(
    tp: dict[str, Any], field: str
) -> None:
    with pytest.raises(AnnotationError, match=r"gputopo\.io/placement") as err:
        parse_placement(_placement_with_tp(**tp))
    assert field in str(err.value)


def test_a_placement_from_a_newer_extender_keeps_what_this_reader_knows() -> None:
    """Keys this version does not know (a newer extender's, mid-upgrade) are skipped; the GPUs stand."""
    doc = json.loads(_placement_with_tp(nextField={"x": 1}))
    doc["someday"] = [1, 2]
    doc["estimate"] = {"messageBytes": 1, "allReduceMs": 1.0, "newTime": 3}
    p = parse_placement(json.dumps(doc))
    assert p.gpus == (0, 1, 2, 3) and p.tp is not None and p.tp.domain == "rack-a"
    assert p.estimate is not None and p.estimate.all_reduce_ms == 1.0


# --------------------------------------------------------------------------------------------------
# Fuzz

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(NASTY),
)
json_values = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=10,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_topologies(draw: st.DrawFn) -> Any:
    doc: Any = json.loads(build_system(draw(st.sampled_from(["hgx-a100-4", "dgx-1v", "l40s-4"])), "n").to_annotation())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        if not path:
            doc = draw(json_values)
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return doc


@FUZZ
@given(doc=mutated_topologies())
def test_any_topology_either_parses_into_a_usable_node_or_is_an_annotation_error(doc: Any) -> None:
    try:
        topo = parse_topology(json.dumps(doc))
    except AnnotationError:
        return
    assert isinstance(topo, NodeTopology)
    state = node_state("n", topo)  # what the cache builds; then a 2-GPU request, which divides by memory
    for policy in ("required", "ignore"):
        evaluate_node(state, parse_pod_request({ANN_NVLINK: policy, ANN_MIN_GPU_MEMORY: "1Gi"}, 2))


_fabric_ints = st.one_of(st.integers(min_value=-1, max_value=2**32), st.integers(min_value=-(2**70), max_value=2**70))
fabric_values = st.one_of(
    st.none(),
    json_values,
    st.dictionaries(
        st.sampled_from(["state", "status", "healthMask", "health_mask", "clusterUuid", "other"]),
        st.one_of(
            st.sampled_from(["not-supported", "not-started", "in-progress", "completed", "COMPLETED", "done"]),
            _fabric_ints,
            json_values,
        ),
        max_size=5,
    ),
)


@FUZZ
@given(fabrics=st.lists(fabric_values, min_size=4, max_size=4))
def test_any_gpu_fabric_either_parses_into_a_fabric_health_or_is_an_annotation_error(fabrics: list[Any]) -> None:
    doc: Any = json.loads(build_system("gb200-tray", "n").to_annotation())
    for gpu, fabric in zip(doc["gpus"], fabrics, strict=True):
        gpu["fabric"] = fabric
    try:
        topo = parse_topology(json.dumps(doc))
    except AnnotationError as e:
        assert e.key == "gputopo.io/topology"
        return
    for gpu in topo.gpus:
        assert decode_health(gpu.fabric)[0] in FabricHealth
    assert node_state("n", topo).fabric is tray_health(topo.gpus)[0]


@FUZZ
@given(key=st.sampled_from([*_TP, "capTrays", "fill", "fillStraddles", "leftOutTrays"]), value=json_values)
def test_any_tp_value_in_a_placement_either_parses_or_is_an_annotation_error(key: str, value: Any) -> None:
    try:
        p = parse_placement(_placement_with_tp(**{key: value}))
    except AnnotationError as e:
        assert e.key == "gputopo.io/placement"
        return
    assert p.tp is not None and p.tp.groups >= 1 and len(p.tp.split) >= 1


@FUZZ
@given(text=st.one_of(st.text(max_size=40), json_values.map(json.dumps)), gpu_count=st.sampled_from([None, 0, 8]))
def test_any_gpus_in_use_value_either_parses_or_is_an_annotation_error(text: str, gpu_count: int | None) -> None:
    try:
        assert isinstance(parse_gpus_in_use_report(text, gpu_count), GpusInUse)
    except AnnotationError as e:
        assert e.key == "gputopo.io/gpus-in-use"


@FUZZ
@given(
    annotations=st.dictionaries(
        st.sampled_from([*POD_OPT_IN_ANNOTATIONS, "gputopo.io/placement", "gputopo.io/other"]),
        st.one_of(st.text(max_size=12), st.sampled_from(NASTY)),
        max_size=5,
    ),
    gpus=st.integers(min_value=-2, max_value=2**64),
)
def test_any_pod_annotations_either_parse_or_are_an_annotation_error(annotations: dict[str, str], gpus: int) -> None:
    try:
        assert isinstance(parse_pod_request(annotations, gpus), PodRequest)
    except AnnotationError as e:
        assert e.key in annotations or e.key == "nvidia.com/gpu"


@FUZZ
@given(doc=mutated_topologies())
def test_a_bad_snapshot_node_stops_startup_with_an_error_naming_it(tmp_path_factory: Any, doc: Any) -> None:
    path = Path(tmp_path_factory.mktemp("snap")) / "cluster.yaml"
    path.write_text(
        yaml.safe_dump({"nodes": [{"name": "good", "fixture": "l40s-4"}, {"name": "fuzzed", "topology": doc}]})
    )
    try:
        load_cluster(path)
    except ClusterFileError as e:
        assert "(fuzzed)" in str(e) or "nodes[1]" in str(e), str(e)
