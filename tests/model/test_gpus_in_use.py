"""The `gputopo.io/gpus-in-use` wire format: version 2 per pod, version 1 lists still read, strict
rejection naming the annotation, and a parser that raises nothing but AnnotationError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.model import (
    MAX_IN_USE_BYTES,
    MAX_IN_USE_PODS,
    AnnotationError,
    GpusInUse,
    parse_gpus_in_use,
    parse_gpus_in_use_report,
)


def v1_reader(text: str, gpu_count: int) -> frozenset[int]:
    """The reader gputopo shipped before version 2, verbatim: what an extender not yet upgraded does."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise AnnotationError("gputopo.io/gpus-in-use", text, "not a JSON list of GPU indices") from None
    if not isinstance(data, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in data):
        raise AnnotationError("gputopo.io/gpus-in-use", text, "not a JSON list of GPU indices")
    if any(i < 0 or i >= gpu_count for i in data):
        raise AnnotationError("gputopo.io/gpus-in-use", text, f"index out of range for {gpu_count} GPUs")
    return frozenset(data)


@pytest.mark.parametrize(
    "report",
    [
        pytest.param(GpusInUse(), id="nothing in use"),
        pytest.param(GpusInUse(other=frozenset({5})), id="other only"),
        pytest.param(GpusInUse(pods={"uid-a": frozenset({0, 1}), "uid-b": frozenset({7})}), id="pods only"),
        pytest.param(GpusInUse(pods={"uid-a": frozenset({3, 2})}, other=frozenset({6, 5})), id="pods and other"),
    ],
)
def test_version_2_round_trips(report: GpusInUse) -> None:
    text = report.to_annotation()
    assert parse_gpus_in_use_report(text, 8) == report
    assert parse_gpus_in_use(text, 8) == report.all


def test_the_encoding_is_compact_sorted_and_independent_of_insertion_order() -> None:
    a = GpusInUse(pods={"uid-b": frozenset({3, 2}), "uid-a": frozenset({1, 0})}, other=frozenset({7, 5}))
    b = GpusInUse(pods={"uid-a": frozenset({0, 1}), "uid-b": frozenset({2, 3})}, other=frozenset({5, 7}))
    assert (
        a.to_annotation() == b.to_annotation() == ('{"version":2,"pods":{"uid-a":[0,1],"uid-b":[2,3]},"other":[5,7]}')
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("[]", GpusInUse(), id="empty list"),
        pytest.param("[5, 0]", GpusInUse(other=frozenset({0, 5})), id="list: all other"),
        pytest.param('{"version":2}', GpusInUse(), id="version 2 without pods or other"),
        pytest.param('{"version":2,"pods":{"a":[]}}', GpusInUse(), id="a pod without GPUs says nothing"),
    ],
)
def test_lists_and_sparse_objects_are_read(text: str, expected: GpusInUse) -> None:
    assert parse_gpus_in_use_report(text, 8) == expected


def test_an_old_reader_given_version_2_fails_with_its_clear_error() -> None:
    text = GpusInUse(pods={"uid-a": frozenset({0})}).to_annotation()
    with pytest.raises(AnnotationError, match="not a JSON list of GPU indices"):
        v1_reader(text, 8)


HUGE_PODS = json.dumps({"version": 2, "pods": {f"u{i}": [] for i in range(MAX_IN_USE_PODS + 1)}})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param('{"version":3,"pods":{}}', "unsupported version 3", id="future version"),
        pytest.param('{"version":1,"other":[0]}', "unsupported version 1", id="version 1 is a list, not an object"),
        pytest.param('{"pods":{}}', "unsupported version None", id="no version"),
        pytest.param('{"version":true}', "unsupported version True", id="boolean version"),
        pytest.param('{"version":2.0}', "unsupported version 2.0", id="float version"),
        pytest.param('{"version":2,"other":[8]}', "index out of range for 8 GPUs", id="other index out of range"),
        pytest.param('{"version":2,"pods":{"a":[-1]}}', "index out of range", id="negative pod index"),
        pytest.param("[8]", "index out of range for 8 GPUs", id="version 1 index out of range"),
        pytest.param('{"version":2,"pods":{"a":[1],"b":[1,2]}}', "GPU 1 is in two pods", id="gpu in two pods"),
        pytest.param('{"version":2,"pods":{"a":[1]},"other":[1]}', "GPU 1 is both", id="gpu in a pod and other"),
        pytest.param('{"version":2,"pods":[[0]]}', "pods is not an object", id="pods not an object"),
        pytest.param('{"version":2,"pods":{"a":3}}', "not a JSON list of GPU indices", id="pod gpus not a list"),
        pytest.param('{"version":2,"other":[1.5]}', "not a JSON list of GPU indices", id="float index"),
        pytest.param("[true]", "not a JSON list of GPU indices", id="boolean index"),
        pytest.param('{"version":2,"pods":{"":[0]}}', "pod UID must be", id="empty uid"),
        pytest.param(json.dumps({"version": 2, "pods": {"u" * 129: [0]}}), "pod UID must be", id="uid too long"),
        pytest.param('{"version":2,"extra":1}', "unknown keys extra", id="unknown key"),
        pytest.param('"0,1"', "not a JSON list of GPU indices", id="a string"),
        pytest.param("nope", "not a JSON list of GPU indices", id="not json"),
        pytest.param("[" + "1" * 5000 + "]", "not a JSON list", id="integer too long to convert"),
        pytest.param("[" * 100_000, f"longer than {MAX_IN_USE_BYTES} bytes", id="huge text"),
        pytest.param(HUGE_PODS, f"more than {MAX_IN_USE_PODS} pods", id="too many pods"),
        pytest.param("[" * 20_000 + "]" * 20_000, "not a JSON list", id="deeply nested"),
    ],
)
def test_malformed_values_are_rejected_naming_the_annotation(text: str, why: str) -> None:
    with pytest.raises(AnnotationError) as err:
        parse_gpus_in_use_report(text, 8)
    assert err.value.key == "gputopo.io/gpus-in-use"
    assert why in str(err.value)


_index = st.integers(min_value=-3, max_value=12)
_uid = st.text(min_size=0, max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_near_v2 = st.fixed_dictionaries(
    {"version": st.sampled_from([2, 2, 2, 1, 3, "2", True])},
    optional={
        "pods": st.dictionaries(_uid, st.lists(_index, max_size=4), max_size=4) | _json,
        "other": st.lists(_index, max_size=4) | _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), _json.map(json.dumps), _near_v2.map(json.dumps)), st.none() | st.integers(0, 9))
def test_the_parser_raises_nothing_but_annotation_error(text: str, gpu_count: int | None) -> None:
    try:
        report = parse_gpus_in_use_report(text, gpu_count)
    except AnnotationError:
        return
    # Whatever it accepts is consistent and encodes to something it reads back the same.
    assert parse_gpus_in_use_report(report.to_annotation(), gpu_count) == report
    assert all(report.pods.values())
