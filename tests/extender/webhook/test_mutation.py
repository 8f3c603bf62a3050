"""The mutating webhook's decision: which pods get spec.schedulerName, and the wire format."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from gputopo.extender.webhook.mutation import mutate_pod
from gputopo.model import SCHEDULER_NAME


def _pod(annotations: dict[str, str] | None = None, scheduler: str | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train-0", "namespace": "ml"},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }
    if annotations is not None:
        pod["metadata"]["annotations"] = annotations
    if scheduler is not None:
        pod["spec"]["schedulerName"] = scheduler
    return pod


def _review(
    obj: dict[str, Any] | None, operation: str = "CREATE", kind: str = "Pod", sub_resource: str = ""
) -> dict[str, Any]:
    request: dict[str, Any] = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": "", "version": "v1", "kind": kind},
        "resource": {"group": "", "version": "v1", "resource": kind.lower() + "s"},
        "requestKind": {"group": "", "version": "v1", "kind": kind},
        "namespace": "ml",
        "operation": operation,
        "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": None,
        "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
    }
    if sub_resource:
        request["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def _patch(out: dict[str, Any]) -> list[dict[str, Any]] | None:
    resp = out["response"]
    if "patch" not in resp:
        return None
    assert resp["patchType"] == "JSONPatch"
    patch: list[dict[str, Any]] = json.loads(base64.b64decode(resp["patch"]))
    return patch


SET_SCHEDULER = [{"op": "add", "path": "/spec/schedulerName", "value": SCHEDULER_NAME}]

CASES = [
    pytest.param(_pod({"gputopo.io/nvlink": "required"}), SET_SCHEDULER, id="gputopo annotation, no scheduler: set it"),
    pytest.param(
        _pod({"gputopo.io/group": "llama"}, scheduler="default-scheduler"),
        SET_SCHEDULER,
        id="gputopo annotation, defaulted scheduler: replace it",
    ),
    pytest.param(
        _pod({"gputopo.io/group": "llama"}, scheduler=""), SET_SCHEDULER, id="empty scheduler name counts as unset"
    ),
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}, scheduler="volcano"),
        None,
        id="explicit other scheduler is respected",
    ),
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}, scheduler=SCHEDULER_NAME),
        None,
        id="already gputopo-scheduler: no patch",
    ),
    pytest.param(_pod({"example.com/team": "ml"}), None, id="only foreign annotations: untouched"),
    pytest.param(
        _pod({"notgputopo.io/x": "1", "gputopo.iox/y": "2"}),
        None,
        id="look-alike prefixes do not opt in",
    ),
    pytest.param(_pod(None), None, id="no annotations at all: untouched"),
]


@pytest.mark.parametrize(("pod", "expected_patch"), CASES)
def test_pod_create_gets_scheduler_name_only_when_opted_in(
    pod: dict[str, Any], expected_patch: list[dict[str, Any]] | None
) -> None:
    out = mutate_pod(_review(pod))
    assert out["apiVersion"] == "admission.k8s.io/v1"
    assert out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert out["response"]["allowed"] is True
    assert _patch(out) == expected_patch


@pytest.mark.parametrize(
    ("review", "why"),
    [
        pytest.param(_review(_pod({"gputopo.io/nvlink": "required"}), operation="UPDATE"), "update", id="update"),
        pytest.param(
            _review({"metadata": {"annotations": {"gputopo.io/a": "b"}}}, kind="ConfigMap"), "kind", id="configmap"
        ),
        pytest.param(
            _review(_pod({"gputopo.io/nvlink": "required"}), sub_resource="ephemeralcontainers"),
            "subresource",
            id="subresource",
        ),
        pytest.param(_review(None), "no object", id="no object"),
    ],
)
def test_anything_but_a_pod_create_is_allowed_unchanged(review: dict[str, Any], why: str) -> None:
    out = mutate_pod(review)
    assert out["response"]["allowed"] is True, why
    assert _patch(out) is None, why


def test_scheduler_name_is_configurable() -> None:
    out = mutate_pod(_review(_pod({"gputopo.io/nvlink": "required"})), scheduler_name="gpu-sched")
    assert _patch(out) == [{"op": "add", "path": "/spec/schedulerName", "value": "gpu-sched"}]


def test_response_carries_only_the_response_and_is_json_serialisable() -> None:
    out = mutate_pod(_review(_pod({"gputopo.io/nvlink": "required"})))
    assert set(out) == {"apiVersion", "kind", "response"}
    assert set(out["response"]) == {"uid", "allowed", "patchType", "patch"}
    json.dumps(out)


def test_the_patch_applies_to_the_pod() -> None:
    pod = _pod({"gputopo.io/nvlink": "required"}, scheduler="default-scheduler")
    patch = _patch(mutate_pod(_review(pod)))
    assert patch is not None
    for op in patch:  # a minimal JSONPatch "add" at /spec/<field>
        assert op["op"] == "add"
        _, top, field = op["path"].split("/")
        pod[top][field] = op["value"]
    assert pod["spec"]["schedulerName"] == SCHEDULER_NAME


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({}, id="empty"),
        pytest.param({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, id="no request"),
        pytest.param(
            {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}},
            id="v1beta1",
        ),
        pytest.param({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}, id="no uid"),
    ],
)
def test_malformed_review_raises_value_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        mutate_pod(bad)
