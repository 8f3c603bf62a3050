"""API paths from checked parts: every namespace and name that goes into a path or a query is checked as
Kubernetes checks it (a DNS-1123 label for a namespace, a DNS-1123 subdomain for a name) and escaped; input
that fails is refused naming the part, with no request to the API server.

Surfaces: `gputopo.kube.apipath` (every path the extender and agent send), the webhook's review (DRA mode:
its namespace goes into the template read's path), the bind's pod namespace, name and node, the agent's
field selector on its node's name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gputopo.extender.app import create_listeners
from gputopo.extender.settings import Settings
from gputopo.extender.webhook.claimtemplates import ClaimTemplates, templates_path
from gputopo.kube import (
    COMPUTEDOMAINS,
    LEASES,
    NODES,
    PODS,
    RESOURCECLAIMS,
    RESOURCECLAIMTEMPLATES,
    InvalidName,
    KubeError,
    binding_path,
    events_path,
    on_node,
)
from gputopo.kube.apipath import api_path
from gputopo.model import GPU_RESOURCE
from tests.extender.fake import FakeSource
from tests.extender.harness import Env, gputopo_pod, node_obj

# What a hostile caller puts where a name goes: path escapes, query and fragment injection, encoded
# slashes, upper case, whitespace and control characters, non-ASCII look-alikes, and lengths past the limits.
HOSTILE = [
    pytest.param("..", id="dot-dot"),
    pytest.param(".", id="dot"),
    pytest.param("a/b", id="slash"),
    pytest.param("x/resourceclaims", id="slash into another collection"),
    pytest.param("%2F", id="encoded slash"),
    pytest.param("a%2e%2e", id="encoded dot-dot"),
    pytest.param("a?watch=true", id="query"),
    pytest.param("a#frag", id="fragment"),
    pytest.param("Team-A", id="upper case"),
    pytest.param(" team", id="leading space"),
    pytest.param("team\n", id="trailing newline"),
    pytest.param("te\x00am", id="NUL"),
    pytest.param("tëam", id="non-ASCII letter"),
    pytest.param("٤", id="Arabic-Indic digit"),
    pytest.param("-team", id="leading dash"),
    pytest.param("team-", id="trailing dash"),
    pytest.param("a" * 254, id="over 253"),
    pytest.param("a,spec.nodeName!=x", id="selector terms"),
]
# Too long for a namespace (63), fine for a name (253).
LONG_LABEL = "a" * 64


@pytest.mark.parametrize("bad", HOSTILE)
@pytest.mark.parametrize("kind", [PODS, LEASES, RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, COMPUTEDOMAINS])
def test_a_hostile_namespace_or_name_never_becomes_a_path(kind: Any, bad: str) -> None:
    with pytest.raises(InvalidName, match=r"namespace .* is not a DNS-1123 label"):
        kind.path(bad)
    with pytest.raises(InvalidName, match=r"name .* is not a DNS-1123 subdomain"):
        kind.path("ml", bad)


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_names_in_every_other_builder_are_refused(bad: str) -> None:
    builders: list[Callable[[], str]] = [
        lambda: NODES.path(name=bad),
        lambda: events_path(bad),
        lambda: binding_path(bad, "p"),
        lambda: binding_path("ml", bad),
        lambda: templates_path(bad, "gputopo-gpus-1"),
        lambda: on_node(bad),
    ]
    for build in builders:
        with pytest.raises(InvalidName):
            build()


@pytest.mark.parametrize(
    ("namespace", "name", "path"),
    [
        pytest.param("ml", "", "/api/v1/namespaces/ml/pods", id="a collection"),
        pytest.param("ml", "train-0", "/api/v1/namespaces/ml/pods/train-0", id="an object"),
        pytest.param("a" * 63, "b" * 253, f"/api/v1/namespaces/{'a' * 63}/pods/{'b' * 253}", id="at the limits"),
        pytest.param("ml", "a.b-1", "/api/v1/namespaces/ml/pods/a.b-1", id="a subdomain name with dots"),
    ],
)
def test_names_kubernetes_accepts_make_the_path_they_always_made(namespace: str, name: str, path: str) -> None:
    assert PODS.path(namespace, name) == path


@pytest.mark.parametrize(
    ("call", "words"),
    [
        pytest.param(lambda: PODS.path(LONG_LABEL), "not a DNS-1123 label", id="a 64-character namespace"),
        pytest.param(lambda: api_path("", "v1", "pods", "ml", "", "binding"), "needs an object name", id="no name"),
        pytest.param(lambda: api_path("", "v1", "pods", "ml", "p", "exec"), "subresource 'exec'", id="exec"),
        pytest.param(lambda: api_path("", "v1", "pods", "ml", "p", "../x"), "subresource", id="a subresource path"),
    ],
)
def test_the_builder_refuses_parts_outside_what_gputopo_sends(call: Any, words: str) -> None:
    with pytest.raises(InvalidName, match=words):
        call()


# --------------------------------------------------------------------------------------------------
# the webhook (DRA mode): a forged review's namespace or name is refused before any read


class CountingTemplates:
    """A template reader that counts the reads (every template absent)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def get(self, path: str) -> dict[str, Any]:
        self.paths.append(path)
        raise KubeError(404, "not found", "NotFound", method="GET", path=path)


def _review(namespace: Any, name: Any, *, pod_namespace: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "annotations": {"gputopo.io/nvlink": "required"}}
    if pod_namespace is not None:
        meta["namespace"] = pod_namespace
    container = {"name": "main", "image": "x", "resources": {"limits": {GPU_RESOURCE: "4"}}}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "name": name,
            "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [container]}},
        },
    }


def _webhook(reads: CountingTemplates) -> TestClient:
    listeners = create_listeners(Settings(dra=True), cluster=FakeSource(), watch=False)
    listeners.webhook.state.claim_templates = ClaimTemplates(reads)
    return TestClient(listeners.webhook)


@pytest.mark.parametrize("bad", HOSTILE)
@pytest.mark.parametrize("where", ["namespace", "name", "pod namespace"])
def test_a_forged_review_with_a_hostile_namespace_or_name_is_refused_with_no_api_request(where: str, bad: str) -> None:
    reads = CountingTemplates()
    review = {
        "namespace": _review(bad, "train-0"),
        "name": _review("ml", bad),
        "pod namespace": _review("ml", "train-0", pod_namespace=bad),
    }[where]
    r = _webhook(reads).post("/mutate", json=review)
    assert r.status_code == 200
    resp: Mapping[str, Any] = r.json()["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == 400
    assert "is not a DNS-1123" in resp["status"]["message"] and "the review's" in resp["status"]["message"]
    assert reads.paths == []  # nothing read, in any namespace


def test_an_honest_review_reads_its_own_namespaces_template_once() -> None:
    reads = CountingTemplates()
    r = _webhook(reads).post("/mutate", json=_review("ml", "train-0", pod_namespace="ml"))
    assert r.json()["response"]["allowed"] is True
    assert len(reads.paths) == 1 and reads.paths[0].startswith("/apis/resource.k8s.io/v1/namespaces/ml/")


def test_a_flood_of_forged_reviews_makes_no_request_and_leaves_the_honest_one_its_read() -> None:
    reads = CountingTemplates()
    client = _webhook(reads)
    for i in range(200):
        bad = ["x/resourceclaims", f"..%2F{i}", f"a?watch=true&i={i}", "X" * (i + 1)][i % 4]
        assert client.post("/mutate", json=_review(bad, "p")).json()["response"]["allowed"] is False
    assert reads.paths == []
    assert client.post("/mutate", json=_review("ml", "p")).json()["response"]["allowed"] is True
    assert len(reads.paths) == 1


# --------------------------------------------------------------------------------------------------
# bind: the pod's namespace, name and node go into the GET and Binding paths


@pytest.mark.parametrize("bad", HOSTILE[:8])
@pytest.mark.parametrize("where", ["PodNamespace", "PodName", "Node"])
def test_a_bind_with_a_hostile_name_is_refused_before_any_request(env: Env, where: str, bad: str) -> None:
    env.add_nodes(node_obj("n1"))
    pod = gputopo_pod("p", 8)
    env.source.calls.clear()
    body = {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"} | {where: bad}
    r = env.call("bind", body)
    assert r.status == 200 and r.json()["Error"].startswith("bind refused: ")
    assert "is not a DNS-1123" in r.json()["Error"]
    assert env.source.calls == []  # no GET of the pod, no Binding


def test_a_bind_with_valid_names_does_reach_the_api_server(env: Env) -> None:
    """The control for the case above: the same bind, names intact, reads the pod it does not know."""
    env.add_nodes(node_obj("n1"))
    pod = gputopo_pod("p", 8)
    env.source.calls.clear()
    env.call("bind", {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"})
    assert env.source.calls != []
