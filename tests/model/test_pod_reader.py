"""The one Pod reader (gputopo.model.podspec): Kubernetes' rules for a pod's GPU request, table by table,
and the quantity field fuzzed."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity

from gputopo.model import GPU_RESOURCE, MAX_QUANTITY
from gputopo.model.podspec import PodSpecError, read_pod_gpus


def c(name: str, limits: Any = None, requests: Any = None, *, sidecar: bool = False) -> dict[str, Any]:
    """A container asking for `limits`/`requests` GPUs (None: not given)."""
    res: dict[str, Any] = {}
    if limits is not None:
        res["limits"] = {GPU_RESOURCE: limits}
    if requests is not None:
        res["requests"] = {GPU_RESOURCE: requests}
    out: dict[str, Any] = {"name": name, "resources": res}
    if sidecar:
        out["restartPolicy"] = "Always"
    return out


def spec(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"containers": containers, **({"initContainers": init} if init is not None else {})}


@pytest.mark.parametrize(
    ("pod", "total", "containers"),
    [
        pytest.param(spec([c("a", "4")]), 4, (("a", 4),), id="a-limit"),
        pytest.param(spec([c("a", requests="2")]), 2, (("a", 2),), id="a-request-alone"),
        pytest.param(spec([c("a", "3", "3")]), 3, (("a", 3),), id="request-equal-to-limit"),
        pytest.param(spec([c("a", "1"), {"name": "cpu"}, c("b", 2)]), 3, (("a", 1), ("cpu", 0), ("b", 2)), id="sum"),
        pytest.param(spec([c("a", "1")], [c("i", "4")]), 4, (("a", 1),), id="init-larger-than-apps"),
        pytest.param(spec([c("a", "4")], [c("i", "2"), c("j", "3")]), 4, (("a", 4),), id="apps-larger-than-init"),
        pytest.param(spec([c("a", "2")], [c("s", "1", sidecar=True)]), 3, (("a", 2),), id="sidecar-adds-up"),
        pytest.param(
            spec([c("a", "1")], [c("s", "1", sidecar=True), c("i", "4")]),
            5,
            (("a", 1),),
            id="init-runs-beside-earlier-sidecars",
        ),
        pytest.param(
            spec([c("a", "1")], [c("i", "4"), c("s", "1", sidecar=True)]),
            4,
            (("a", 1),),
            id="init-before-the-sidecar-runs-alone",
        ),
        pytest.param(
            spec([], [c("s", "2", sidecar=True), c("t", "3", sidecar=True)]),
            5,
            (),
            id="sidecars-alone",
        ),
        pytest.param(spec([c("a", "1k")]), 1000, (("a", 1000),), id="decimal-suffix"),
        pytest.param(spec([c("a", 2)]), 2, (("a", 2),), id="json-number"),
        pytest.param(spec([c("a", 2.0)]), 2, (("a", 2),), id="json-float-whole"),
        pytest.param(spec([{"name": "a", "resources": {"limits": {"cpu": "1"}}}]), 0, (("a", 0),), id="no-gpus"),
        pytest.param({}, 0, (), id="empty-spec"),
        pytest.param(spec([{"resources": None}]), 0, (("#0", 0),), id="unnamed-without-resources"),
    ],
)
def test_the_rules(pod: dict[str, Any], total: int, containers: tuple[tuple[str, int], ...]) -> None:
    got = read_pod_gpus(pod)
    assert (got.total, got.containers) == (total, containers)


@pytest.mark.parametrize(
    ("pod", "needle"),
    [
        pytest.param(spec([c("a", "x")]), "spec.containers[0].resources.limits.nvidia.com/gpu", id="not-a-quantity"),
        pytest.param(spec([c("a", "500m")]), "not a whole, non-negative", id="fraction"),
        pytest.param(spec([c("a", "-1")]), "not a whole, non-negative", id="negative"),
        pytest.param(spec([c("a", True)]), "is not a Kubernetes quantity", id="boolean"),
        pytest.param(spec([c("a", float("nan"))]), "not a finite number", id="nan"),
        pytest.param(spec([c("a", "1e400")]), "out of range", id="beyond-int64"),
        pytest.param(spec([c("a", "2", "4")]), "differs from the limit 2", id="request-differs-from-limit"),
        pytest.param(
            spec([], [c("i", requests="x")]), "spec.initContainers[0].resources.requests", id="init-field-named"
        ),
        pytest.param(spec([c("a", str(MAX_QUANTITY)), c("b", "1")]), "in all", id="sum-beyond-int64"),
        pytest.param({"containers": "x"}, "spec.containers must be a list", id="containers-not-a-list"),
        pytest.param({"containers": [1]}, "spec.containers[0] must be a container", id="container-not-an-object"),
        pytest.param(spec([{"resources": "x"}]), "spec.containers[0].resources must be an object", id="resources"),
        pytest.param(spec([{"resources": {"limits": 1}}]), "resources.limits must be an object", id="limits"),
    ],
)
def test_malformed_fields_are_named(pod: dict[str, Any], needle: str) -> None:
    with pytest.raises(PodSpecError) as err:
        read_pod_gpus(pod)
    assert needle in str(err.value)


def test_another_resource_and_where() -> None:
    pod = {"containers": [{"name": "a", "resources": {"limits": {"example.com/gpu": "x"}}}]}
    assert read_pod_gpus(pod).total == 0
    with pytest.raises(PodSpecError, match=r"^Pod\.spec\.containers\[0\]\.resources\.limits\.example\.com/gpu: "):
        read_pod_gpus(pod, "Pod.spec", "example.com/gpu")


_quantities = st.one_of(
    st.text(max_size=80),
    st.text(st.sampled_from("0123456789.+-eEkKMGTPimun "), max_size=30),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=500, deadline=None)
@given(raw=_quantities, kind=st.sampled_from(["limits", "requests"]))
def test_any_quantity_is_a_count_or_an_error_naming_the_field(raw: Any, kind: str) -> None:
    pod = {"containers": [{"name": "a", "resources": {kind: {GPU_RESOURCE: raw}}}]}
    try:
        got = read_pod_gpus(pod).total
    except PodSpecError as e:
        assert f"spec.containers[0].resources.{kind}.{GPU_RESOURCE}: " in str(e)
        return
    # What was accepted is exactly the whole, non-negative value Kubernetes reads, within int64.
    assert isinstance(raw, str | int | float) and not isinstance(raw, bool)
    assert 0 <= got <= MAX_QUANTITY
    text = raw.strip() if isinstance(raw, str) else repr(raw)
    assert Decimal(got) == parse_quantity(text)
