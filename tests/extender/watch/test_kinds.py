"""The watched kinds, each declared once (`gputopo.kube.kinds.WATCHED`), against everything that must agree
with that declaration: the extender's cache handles exactly those kinds, the extender lists and watches each
at its declared path, and the chart's RBAC grants the scheduler pod's service account what each needs and
no list or watch on anything else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputopo.extender.watch.cache import ClusterCache, check_handlers
from gputopo.extender.watch.handlers import KindHandler
from gputopo.extender.watch.source import KubeSource
from gputopo.kube import (
    KIND_NAMES,
    WATCHED,
    InvalidName,
    WatchedKind,
    lease_path,
    node_path,
    pod_path,
    pods_path,
    watched,
)
from tests.chart.helm import NAMESPACE, Doc, by_kind, one, render
from tests.kube.scripted import kubeconfig

AGENTS_NS = "gputopo-system"

# --------------------------------------------------------------------------------------------------
# (a) one cache handler per declared kind, none for any other


@pytest.fixture(scope="module")
def cache() -> ClusterCache:
    return ClusterCache()


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_every_declared_kind_has_a_cache_handler_and_a_list_of_it_counts_as_listed(
    cache: ClusterCache, kind: str
) -> None:
    assert isinstance(cache.handlers[kind], KindHandler)
    cache.replace(kind, [])
    assert kind in cache.synced


def test_the_cache_handles_exactly_the_declared_kinds(cache: ClusterCache) -> None:
    assert sorted(cache.handlers) == sorted(KIND_NAMES)


def _noop() -> KindHandler:
    return KindHandler(lambda items: None, lambda event_type, obj: None)


def test_a_handler_for_an_undeclared_kind_is_refused() -> None:
    handlers = {kind: _noop() for kind in KIND_NAMES}
    with pytest.raises(ValueError, match="undeclared kinds \\['deviceclasses'\\]"):
        check_handlers({**handlers, "deviceclasses": _noop()})


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_declared_kind_without_a_handler_is_refused(kind: str) -> None:
    with pytest.raises(ValueError, match=f"without one \\['{kind}'\\]"):
        check_handlers({k: _noop() for k in KIND_NAMES if k != kind})


def test_events_of_an_undeclared_kind_are_refused(cache: ClusterCache) -> None:
    with pytest.raises(KeyError, match="not a watched kind"):
        cache.replace("deviceclasses", [])
    with pytest.raises(KeyError, match="not a watched kind"):
        cache.apply("deviceclasses", "ADDED", {"metadata": {"name": "x"}})


# --------------------------------------------------------------------------------------------------
# (c) each kind's path, for every namespace and for one

PATHS: dict[str, tuple[str | None, str | None]] = {
    # kind: (every namespace / cluster scope, namespace "ns"); None where the scope does not apply
    "nodes": ("/api/v1/nodes", None),
    "pods": ("/api/v1/pods", "/api/v1/namespaces/ns/pods"),
    "leases": (None, "/apis/coordination.k8s.io/v1/namespaces/ns/leases"),
    "jobs": ("/apis/batch/v1/jobs", "/apis/batch/v1/namespaces/ns/jobs"),
    "podgroups": (
        "/apis/scheduling.k8s.io/v1beta1/podgroups",
        "/apis/scheduling.k8s.io/v1beta1/namespaces/ns/podgroups",
    ),
    "resourceclaims": (
        "/apis/resource.k8s.io/v1/resourceclaims",
        "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims",
    ),
    "resourceslices": ("/apis/resource.k8s.io/v1/resourceslices", None),
    "resourceclaimtemplates": (
        "/apis/resource.k8s.io/v1/resourceclaimtemplates",
        "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaimtemplates",
    ),
    "computedomains": (
        "/apis/resource.nvidia.com/v1beta1/computedomains",
        "/apis/resource.nvidia.com/v1beta1/namespaces/ns/computedomains",
    ),
    "jobsets": ("/apis/jobset.x-k8s.io/v1alpha2/jobsets", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets"),
    "resourcequotas": ("/api/v1/resourcequotas", "/api/v1/namespaces/ns/resourcequotas"),
}


def test_the_path_table_covers_every_declared_kind() -> None:
    assert sorted(PATHS) == sorted(KIND_NAMES)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_each_kinds_path_for_every_namespace_and_for_one(kind: str) -> None:
    everywhere, in_ns = PATHS[kind]
    declared = watched(kind)
    for namespace, expected in ((None, everywhere), ("ns", in_ns)):
        if expected is None:
            with pytest.raises(ValueError):
                declared.path(namespace)
        else:
            assert declared.path(namespace) == expected
            assert declared.path(namespace, "a.b-1") == f"{expected}/a.b-1"
            with pytest.raises(InvalidName, match="not a DNS-1123 subdomain"):
                declared.path(namespace, "a b")  # names are checked, never sent as given


def test_the_path_helpers_are_the_declared_paths() -> None:
    assert node_path() == watched("nodes").path() and node_path("n") == watched("nodes").path(name="n")
    assert pods_path() == watched("pods").path() and pods_path("ns") == watched("pods").path("ns")
    assert pod_path("ns", "p") == watched("pods").path("ns", "p")
    assert lease_path("ns", "l") == watched("leases").path("ns", "l")


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[KubeSource, list[str]]]:
    src = KubeSource(kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9"), AGENTS_NS)
    asked: list[str] = []

    def list_items(path: str, **_: Any) -> tuple[list[Any], str]:
        asked.append(path)
        return [], "1"

    monkeypatch.setattr(src.api, "list_items", list_items)
    yield src, asked
    src.close()


@pytest.mark.parametrize("kind", WATCHED, ids=lambda k: k.name)
def test_the_extender_lists_each_kind_at_its_declared_path(
    source: tuple[KubeSource, list[str]], kind: WatchedKind
) -> None:
    src, asked = source
    src.list_objects(kind.name)
    assert asked == [kind.path(AGENTS_NS if kind.one_namespace else None)]


# --------------------------------------------------------------------------------------------------
# (b) the chart's RBAC for the scheduler pod's service account against the table

DRA = {"agent__dra__enabled": "true"}
# Resources the extender's account may list besides the watched kinds, each with why.
OTHER_READS: dict[tuple[str, str], frozenset[str]] = {
    # the claim templates' collector lists the templates no pod names any more (a one-off list, no watch)
    ("resource.k8s.io", "resourceclaimtemplates"): frozenset({"list"}),
}
Grants = dict[tuple[str, str], set[str]]


def _grants(docs: list[Doc]) -> tuple[Grants, Grants]:
    """What the rendered roles bound to the scheduler's service account grant: (cluster-wide, in the
    release namespace). Rules limited to named objects grant no list or watch of the kind."""
    account = one(docs, "ServiceAccount", component="scheduler")["metadata"]["name"]
    cluster: Grants = {}
    namespaced: Grants = {}
    for binding_kind, role_kind, into in (
        ("ClusterRoleBinding", "ClusterRole", cluster),
        ("RoleBinding", "Role", namespaced),
    ):
        roles = {d["metadata"]["name"]: d for d in by_kind(docs, role_kind)}
        for binding in by_kind(docs, binding_kind):
            if not any(s.get("kind") == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
                continue
            role = roles.get(binding["roleRef"]["name"])
            if role is None or binding["roleRef"]["kind"] != role_kind:
                continue  # a built-in role (system:kube-scheduler): not the chart's to check
            assert role_kind == "ClusterRole" or role["metadata"]["namespace"] == NAMESPACE
            for rule in role.get("rules", []):
                if rule.get("resourceNames"):
                    continue
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        into.setdefault((group, resource), set()).update(rule["verbs"])
    return cluster, namespaced


@pytest.mark.parametrize("sets", [{}, DRA], ids=["default", "dra"])
def test_the_charts_rbac_grants_the_extender_what_each_declared_kind_needs(sets: dict[str, str]) -> None:
    cluster, namespaced = _grants(render(**sets))
    for kind in WATCHED:
        key = (kind.group, kind.resource)
        granted = namespaced.get(key, set()) if kind.one_namespace else cluster.get(key, set())
        if kind.rbac_optional and not sets:
            assert not granted, f"{kind.name}: granted only with agent.dra.enabled"
            continue
        assert kind.verbs <= granted, f"{kind.name}: needs {sorted(kind.verbs)}, granted {sorted(granted)}"


@pytest.mark.parametrize("sets", [{}, DRA], ids=["default", "dra"])
def test_the_charts_rbac_grants_the_extender_no_list_or_watch_of_undeclared_kinds(sets: dict[str, str]) -> None:
    declared = {(k.group, k.resource) for k in WATCHED}
    for grants in _grants(render(**sets)):
        for key, verbs in grants.items():
            reads = verbs & {"list", "watch", "*"}
            if key in declared or not reads:
                continue
            assert reads <= OTHER_READS.get(key, frozenset()), f"{key}: {sorted(reads)} granted, not a watched kind"
