"""The extender over DRA: ResourceSlices and ResourceClaims join a node's GPUs in use (gputopo/extender/watch/cache.py),
and a pod converted for DRA counts the GPUs of its gputopo claim template (gputopo/extender/wire.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.watch import dramerge
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.source import Informer
from gputopo.extender.wire import pod_gpus
from gputopo.kube import KubeError
from gputopo.model import TOPOLOGY_ANNOTATION, GpusInUse
from gputopo.model.dra import DRIVER, in_use_by_node, pod_claim_gpus, template_gpus
from gputopo.systems import build_system
from tests.extender.fake import FakeSource
from tests.extender.harness import pod_obj

NODE = "dra-a"


def _node(name: str = NODE, in_use: GpusInUse | None = None) -> dict[str, Any]:
    ann = {TOPOLOGY_ANNOTATION: build_system("dgx-1v", name).to_annotation()}
    if in_use is not None:
        ann["gputopo.io/gpus-in-use"] = in_use.to_annotation()
    return {"metadata": {"name": name, "annotations": ann, "labels": {}}}


def _slice(node: str = NODE, driver: str = DRIVER) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}"} for i in range(8)],
        },
    }


def _claim(uid: str, gpus: list[int], pod: str | None, pool: str = NODE, namespace: str = "ns") -> dict[str, Any]:
    results = [{"request": "gpus", "driver": DRIVER, "pool": pool, "device": f"gpu-{i}"} for i in gpus]
    return {
        "metadata": {"uid": uid, "namespace": namespace, "name": f"claim-{uid}"},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": pod}] if pod else [],
        },
    }


def _pod(uid: str, namespace: str = "ns", *, gputopo: bool = True) -> dict[str, Any]:
    """A pending pod of `namespace` (a gputopo pod, which the ledger holds, or a plain one, which it does not)."""
    return pod_obj(
        f"pod-{uid}", 2, {"gputopo.io/nvlink": "required"} if gputopo else None, namespace=namespace, uid=uid
    )


def _report(cache: ClusterCache, node: str = NODE) -> GpusInUse:
    return cache.ledger.nodes[node].report


def _in_use(cache: ClusterCache, without_pod: str = "") -> frozenset[int]:
    """The node's GPUs in use as pod `without_pod` sees them (the bind's re-check: its own are free)."""
    return cache.ledger.node_states.in_use(NODE, _report(cache), without_pod)


def test_claims_on_our_slices_join_the_agents_report_per_pod() -> None:
    cache = ClusterCache()
    cache.replace("nodes", [_node(in_use=GpusInUse(pods={"agent-pod": frozenset({7})}))])
    cache.replace("pods", [_pod("pod-1")])
    cache.replace("resourceslices", [_slice(), _slice(driver="gpu.nvidia.com")])
    cache.replace("resourceclaims", [_claim("c1", [0, 1], "pod-1"), _claim("c2", [5], None)])
    assert _report(cache) == GpusInUse(
        pods={"agent-pod": frozenset({7}), "pod-1": frozenset({0, 1})}, other=frozenset({5})
    )


def test_a_claims_events_change_the_node_without_the_node_changing() -> None:
    cache = ClusterCache()
    cache.replace("nodes", [_node()])
    cache.replace("pods", [_pod("pod-1"), _pod("pod-2")])
    cache.replace("resourceslices", [_slice()])
    cache.replace("resourceclaims", [])
    assert _report(cache) == GpusInUse()
    cache.apply("resourceclaims", "ADDED", _claim("c1", [2, 3], "pod-1"))
    assert _report(cache).pods == {"pod-1": frozenset({2, 3})}
    cache.apply("resourceclaims", "DELETED", _claim("c1", [2, 3], "pod-1"))
    assert _report(cache) == GpusInUse()
    # A slice deleted (the agent gone): its claims count for no node.
    cache.apply("resourceclaims", "ADDED", _claim("c2", [4], "pod-2"))
    cache.apply("resourceslices", "DELETED", _slice())
    assert _report(cache) == GpusInUse()


def test_a_node_update_keeps_its_claims() -> None:
    cache = ClusterCache()
    cache.replace("pods", [_pod("pod-1")])
    cache.replace("resourceslices", [_slice()])
    cache.replace("resourceclaims", [_claim("c1", [6], "pod-1")])
    cache.replace("nodes", [_node()])  # the Node arrives after the claims
    assert _report(cache).pods == {"pod-1": frozenset({6})}
    cache.apply("nodes", "MODIFIED", _node(in_use=GpusInUse(other=frozenset({0}))))
    assert _report(cache) == GpusInUse(pods={"pod-1": frozenset({6})}, other=frozenset({0}))


@pytest.mark.parametrize(
    ("pods", "claim_namespace", "report"),
    [
        pytest.param(
            [_pod("p1", "ns")],
            "ns",
            GpusInUse(pods={"p1": frozenset({0, 1})}),
            id="claim and pod in one namespace: its own",
        ),
        pytest.param(
            [_pod("p1", "other")], "ns", GpusInUse(other=frozenset({0, 1})), id="pod of another namespace: other"
        ),
        pytest.param([], "ns", GpusInUse(other=frozenset({0, 1})), id="pod unknown: other"),
        pytest.param(
            [_pod("p1", "ns", gputopo=False)],
            "ns",
            GpusInUse(other=frozenset({0, 1})),
            id="a plain pod (not held): other",
        ),
    ],
)
def test_a_claims_gpus_count_for_its_pod_only_in_the_claims_namespace(
    pods: list[dict[str, Any]], claim_namespace: str, report: GpusInUse
) -> None:
    cache = ClusterCache()
    cache.replace("nodes", [_node()])
    cache.replace("pods", pods)
    cache.replace("resourceslices", [_slice()])
    cache.replace("resourceclaims", [_claim("c1", [0, 1], "p1", namespace=claim_namespace)])
    assert _report(cache) == report
    # Held either way: no pod's what-if frees a GPU the claim holds unless the claim is that pod's own.
    assert _in_use(cache, without_pod="p1") == (frozenset() if report.pods else {0, 1})


@pytest.mark.parametrize(
    ("arrivals", "report"),
    [
        pytest.param(
            [("ADDED", _pod("p1", "ns"))], GpusInUse(pods={"p1": frozenset({3})}), id="pod arrives after: attributed"
        ),
        pytest.param(
            [("ADDED", _pod("p1", "other"))],
            GpusInUse(other=frozenset({3})),
            id="pod of another namespace arrives: other",
        ),
        pytest.param(
            [("ADDED", _pod("p1", "ns")), ("DELETED", _pod("p1", "ns"))],
            GpusInUse(other=frozenset({3})),
            id="pod arrives, then goes: other again, still held",
        ),
        pytest.param(
            [("RELIST", _pod("p1", "ns"))],
            GpusInUse(pods={"p1": frozenset({3})}),
            id="pod arrives in a relist: attributed",
        ),
    ],
)
def test_a_pod_arriving_after_its_claim_re_merges_the_claim(
    arrivals: list[tuple[str, dict[str, Any]]], report: GpusInUse
) -> None:
    cache = ClusterCache()
    cache.replace("nodes", [_node()])
    cache.replace("pods", [])
    cache.replace("resourceslices", [_slice()])
    cache.replace("resourceclaims", [_claim("c1", [3], "p1")])
    assert _report(cache) == GpusInUse(other=frozenset({3}))
    for event, pod in arrivals:
        if event == "RELIST":
            cache.replace("pods", [pod])
        else:
            cache.apply("pods", event, pod)
    assert _report(cache) == report


def test_a_what_if_without_a_pod_frees_its_own_claim_and_no_other() -> None:
    """`gputopo explain`'s view (ClusterCache.forget_pod): the pod's own claim dropped with it; a claim
    of another namespace naming its UID still holds."""
    cache = ClusterCache()
    cache.replace("nodes", [_node()])
    cache.replace("pods", [_pod("p1", "ns")])
    cache.replace("resourceslices", [_slice()])
    cache.replace("resourceclaims", [_claim("own", [0, 1], "p1"), _claim("foreign", [4, 5], "p1", namespace="x")])
    assert _report(cache) == GpusInUse(pods={"p1": frozenset({0, 1})}, other=frozenset({4, 5}))
    cache.ledger.forget_reported("p1")  # the preempt verb's view of a victim: only what is its own
    assert _in_use(cache) == {4, 5}
    cache.forget_pod(_pod("p1", "ns"))
    assert _report(cache) == GpusInUse(other=frozenset({4, 5}))


def test_a_pod_event_re_merges_only_the_pools_of_the_claims_reserved_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cost per pod event: the claims of the pools its claims are on, none for a pod no claim names."""
    nodes = [f"n{i}" for i in range(20)]
    cache = ClusterCache()
    cache.replace("nodes", [_node(n) for n in nodes])
    cache.replace("pods", [])
    cache.replace("resourceslices", [_slice(n) for n in nodes])
    cache.replace("resourceclaims", [_claim(f"{n}-{g}", [g], f"p-{n}-{g}", pool=n) for n in nodes for g in range(4)])
    merged: list[int] = []
    real = in_use_by_node

    def counting(claims: Any, slices: Any, pod_namespace: Any) -> dict[str, GpusInUse]:
        merged.append(len(list(claims)))
        return real(claims, slices, pod_namespace)

    monkeypatch.setattr(dramerge, "in_use_by_node", counting)
    for i in range(100):
        cache.apply("pods", "ADDED", _pod(f"unnamed-{i}"))
    assert merged == []
    cache.apply("pods", "ADDED", _pod("p-n7-2"))
    assert merged == [4]  # pool n7's claims, not the 80 of all pools
    assert _report(cache, "n7").pods == {"p-n7-2": frozenset({2})}


@pytest.mark.parametrize(
    ("obj", "kind"),
    [
        (
            {"metadata": {"name": "x"}, "spec": {"driver": DRIVER, "pool": {"name": "a", "generation": 1}}},
            "resourceslices",
        ),
        (_claim("bad", [], None) | {"status": {"allocation": {"devices": {"results": "nope"}}}}, "resourceclaims"),
    ],
)
def test_an_unreadable_dra_object_is_skipped_and_counted(obj: dict[str, Any], kind: Any) -> None:
    seen: list[tuple[str, str]] = []
    cache = ClusterCache()
    cache.on_bad_object = lambda k, reason: seen.append((k, reason))
    cache.replace("nodes", [_node()])
    cache.replace(kind, [obj])
    cache.apply(kind, "ADDED", obj)
    assert [k for k, _ in seen] == [kind, kind]
    assert _report(cache) == GpusInUse()


@pytest.mark.parametrize(
    ("name", "gpus"),
    [
        ("gputopo-gpus-4-nvlink-1a2b3c4d", 4),
        ("gputopo-gpus-1-0badbeef", 1),
        ("gputopo-gpus-04-x", None),
        ("gputopo-gpus-", None),
        ("my-gputopo-gpus-4", None),
        ("gputopo-gpus-9999-x", None),
        ("other", None),
    ],
)
def test_gputopo_templates_give_their_gpu_count_and_no_other_name_does(name: str, gpus: int | None) -> None:
    assert template_gpus(name) == gpus


def test_a_pod_converted_for_dra_asks_for_its_templates_gpus() -> None:
    resources: dict[str, Any] = {"claims": [{"name": "gpus"}]}
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": resources}],
        "resourceClaims": [
            {"name": "gpus", "resourceClaimTemplateName": "gputopo-gpus-4-nvlink-1a2b3c4d"},
            {"name": "other", "resourceClaimName": "someone-elses"},
        ],
    }
    assert pod_claim_gpus(spec) == 4
    assert pod_gpus(spec) == 4
    # nvidia.com/gpu, where a pod still names it, is the count.
    resources["limits"] = {"nvidia.com/gpu": "2"}
    assert pod_gpus(spec) == 2
    assert pod_claim_gpus({"resourceClaims": "junk"}) == 0


@pytest.mark.parametrize(
    ("kind", "status", "not_here"),
    [
        ("resourceclaims", 403, True),
        ("resourceslices", 403, True),
        ("resourceslices", 404, True),
        ("podgroups", 403, False),  # a PodGroup the chart always grants: a 403 is a real error
        ("pods", 403, False),
    ],
)
def test_the_dra_kinds_forbidden_count_as_not_here(kind: Any, status: int, not_here: bool) -> None:
    """Without the chart's DRA RBAC the extender's list of claims and slices gets 403: listed empty,
    looked for again later, never a crash loop; any other kind's 403 is an error."""
    source = FakeSource()

    def refuse(_kind: Any) -> tuple[list[Any], str]:
        raise KubeError(status, "forbidden", "Forbidden")

    source.list_objects = refuse  # type: ignore[method-assign,assignment]
    cache = ClusterCache()
    inf = Informer(source, kind, cache, not_served_recheck_seconds=0)
    if not_here:
        inf.relist()
        assert not inf.served and kind in cache.synced
    else:
        with pytest.raises(KubeError):
            inf.relist()
