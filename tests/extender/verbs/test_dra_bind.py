"""Under DRA the placement a pod carries is the allocation of its claims: kube-scheduler writes the
allocation just before it calls bind, and the bind reads it even when the cache has not seen it yet
(gputopo/extender/verbs/binder.py); the claim names a pod gives are read hostile-safe (gputopo/extender/wire.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.wire import WireError, pod_info
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from gputopo.model.dra import DRIVER
from gputopo.model.pod import MAX_POD_CLAIMS
from tests.extender.harness import JSON, Env, gputopo_pod, node_obj

NODE = "dgx1"  # a DGX-1V: quads {0-3} and {4-7}, each a 4-GPU NVLink clique


def _slice(node: str = NODE) -> JSON:
    return {
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}"} for i in range(8)],
        },
    }


def _claim(name: str, gpus: list[int], pod_uid: str, pool: str = NODE, namespace: str = "default") -> JSON:
    results = [{"request": "gpus", "driver": DRIVER, "pool": pool, "device": f"gpu-{i}"} for i in gpus]
    return {
        "metadata": {"uid": f"uid-{name}", "namespace": namespace, "name": name},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": pod_uid}],
        },
    }


def _dra_pod(name: str, gpus: int, claim: str) -> JSON:
    pod = gputopo_pod(name, gpus)
    pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": f"gputopo-gpus-{gpus}"}]
    pod["status"]["resourceClaimStatuses"] = [{"name": "gpus", "resourceClaimName": claim}]
    return pod


@pytest.fixture
def dgx1(env: Env) -> Env:
    """GPUs 4 and 5 held by another pod's claim: gputopo's own choice for a 2-GPU clique is {6,7}
    (it keeps the whole quad {0-3}); the allocator's first fit takes {0,1}."""
    env.add_nodes(node_obj(NODE, "dgx-1v"))
    env.source.put("resourceslices", _slice())
    env.source.put("resourceclaims", _claim("busy", [4, 5], "uid-busy"))
    env.resync()
    return env


def _placed(env: Env, pod: JSON) -> tuple[int, ...]:
    stored = env.source.get("pods", "default", pod["metadata"]["name"])
    assert stored is not None
    return parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus


def _claim_reads(env: Env) -> list[str]:
    return [c for c in env.source.calls if c.startswith("get resourceclaim")]


@pytest.mark.parametrize(
    ("allocation", "cache_sees_it", "reads", "placed"),
    [
        pytest.param([0, 1], False, 1, (0, 1), id="allocation not yet in the cache: read fresh, named"),
        pytest.param([0, 1], True, 0, (0, 1), id="allocation already in the cache: named with no API read"),
        pytest.param([6, 7], False, 1, (6, 7), id="allocation equal to gputopo's choice: named"),
        pytest.param([0, 5], False, 1, (0, 5), id="allocation that is no clique: still named, it is what the pod got"),
    ],
)
def test_the_placement_names_the_claims_allocation(
    dgx1: Env, allocation: list[int], cache_sees_it: bool, reads: int, placed: tuple[int, ...]
) -> None:
    pod = _dra_pod("tp2", 2, "tp2-gpus")
    dgx1.add_pods(pod)
    # kube-scheduler's PreBind writes the allocation; the watch may bring it after the bind call.
    dgx1.source.put("resourceclaims", _claim("tp2-gpus", allocation, pod["metadata"]["uid"]))
    if cache_sees_it:
        dgx1.resync()
    before = len(_claim_reads(dgx1))
    assert dgx1.bind(pod, NODE) == ""
    assert _placed(dgx1, pod) == placed
    assert len(_claim_reads(dgx1)) - before == reads
    # Once the watch brings the claim, the node reports what the placement names: no mismatch.
    dgx1.resync()
    dgx1.extender.flush_events()
    assert [e for e in dgx1.source.events if e["reason"] == "TopologyPlacementMismatch"] == []


def test_an_allocation_gputopo_would_not_choose_says_so_in_the_reason(dgx1: Env) -> None:
    pod = _dra_pod("tp2", 2, "tp2-gpus")
    dgx1.add_pods(pod)
    dgx1.source.put("resourceclaims", _claim("tp2-gpus", [0, 5], pod["metadata"]["uid"]))
    assert dgx1.bind(pod, NODE) == ""
    stored = dgx1.source.get("pods", "default", "tp2")
    assert stored is not None
    reason = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION]).reason
    assert reason.startswith("GPUs [0, 5]: what kube-scheduler's DRA allocation gave")
    assert "would have chosen [6, 7]" in reason


@pytest.mark.parametrize(
    ("claim", "placed"),
    [
        pytest.param(None, (6, 7), id="claim not found: the cache's view stands (gputopo's choice)"),
        pytest.param(
            _claim("tp2-gpus", [0, 1], "uid-default-tp2", pool="other-node"),
            (6, 7),
            id="claim allocated on another node's pool: nothing of it is named here",
        ),
        pytest.param(
            {"metadata": {"name": "tp2-gpus", "namespace": "default"}, "status": {"allocation": "forged"}},
            (6, 7),
            id="malformed claim: the cache's view stands",
        ),
    ],
)
def test_a_claim_that_names_nothing_here_leaves_gputopos_choice(
    dgx1: Env, claim: JSON | None, placed: tuple[int, ...]
) -> None:
    pod = _dra_pod("tp2", 2, "tp2-gpus")
    dgx1.add_pods(pod)
    if claim is not None:
        dgx1.source.put("resourceclaims", claim)
    assert dgx1.bind(pod, NODE) == ""
    assert _placed(dgx1, pod) == placed


def test_another_namespaces_claim_of_the_same_name_is_never_read(dgx1: Env) -> None:
    pod = _dra_pod("tp2", 2, "tp2-gpus")
    dgx1.add_pods(pod)
    # Another tenant's claim of the same name: the bind reads the pod's namespace only.
    dgx1.source.put("resourceclaims", _claim("tp2-gpus", [0, 1], "uid-tenant-b-pod", namespace="tenant-b"))
    dgx1.source.put("resourceclaims", _claim("tp2-gpus", [6, 7], pod["metadata"]["uid"]))
    assert dgx1.bind(pod, NODE) == ""
    assert _placed(dgx1, pod) == (6, 7)
    assert _claim_reads(dgx1)[-1] == "get resourceclaim default/tp2-gpus"


def _pod(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> JSON:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": spec or {}, "status": status or {}}


@pytest.mark.parametrize(
    ("pod", "names"),
    [
        pytest.param(_pod(), (), id="no claims: none"),
        pytest.param(
            _pod({"resourceClaims": [{"name": "a", "resourceClaimName": "shared-claim"}]}),
            ("shared-claim",),
            id="a claim named in the spec",
        ),
        pytest.param(
            _pod(
                {"resourceClaims": [{"name": "a", "resourceClaimTemplateName": "t"}]},
                {"resourceClaimStatuses": [{"name": "a", "resourceClaimName": "p-a-x1"}]},
            ),
            ("p-a-x1",),
            id="a template's claim, from the status",
        ),
        pytest.param(
            _pod(status={"resourceClaimStatuses": [{"name": "a"}]}),
            (),
            id="a template's claim not made yet: none",
        ),
        pytest.param(
            _pod(status={"extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-x"}}),
            ("p-extended-resources-x",),
            id="the claim kube-scheduler made for an extended resource",
        ),
        pytest.param(
            _pod(
                {"resourceClaims": [{"name": "a", "resourceClaimName": "c"}]},
                {"resourceClaimStatuses": [{"name": "a", "resourceClaimName": "c"}]},
            ),
            ("c",),
            id="a name given twice: read once",
        ),
    ],
)
def test_a_pods_claim_names_are_read(pod: JSON, names: tuple[str, ...]) -> None:
    assert pod_info(pod).claim_names == names


@pytest.mark.parametrize(
    ("pod", "field"),
    [
        pytest.param(
            _pod(status={"resourceClaimStatuses": [{"name": "a", "resourceClaimName": "../../nodes/x"}]}),
            "status.resourceClaimStatuses[0].resourceClaimName",
            id="a path in a claim name: refused",
        ),
        pytest.param(
            _pod({"resourceClaims": [{"name": "a", "resourceClaimName": "x" * 254}]}),
            "spec.resourceClaims[0].resourceClaimName",
            id="an oversized claim name: refused",
        ),
        pytest.param(
            _pod(status={"resourceClaimStatuses": [{"name": "a", "resourceClaimName": 7}]}),
            "status.resourceClaimStatuses[0].resourceClaimName",
            id="a claim name that is no string: refused",
        ),
        pytest.param(
            _pod(status={"resourceClaimStatuses": ["c"]}),
            "status.resourceClaimStatuses[0]",
            id="a status entry that is no object: refused",
        ),
        pytest.param(
            _pod(status={"resourceClaimStatuses": [{"name": "a"}] * (MAX_POD_CLAIMS + 1)}),
            "status.resourceClaimStatuses",
            id="a flood of claim statuses: refused",
        ),
        pytest.param(
            _pod(status={"extendedResourceClaimStatus": {"resourceClaimName": "Upper"}}),
            "status.extendedResourceClaimStatus.resourceClaimName",
            id="an extended-resource claim name that is no object name: refused",
        ),
    ],
)
def test_hostile_claim_names_are_refused_naming_the_field(pod: JSON, field: str) -> None:
    with pytest.raises(WireError, match=field.replace("[", r"\[").replace("]", r"\]")):
        pod_info(pod)


@pytest.mark.parametrize(
    ("devices", "placed"),
    [
        pytest.param(["block-6-7"], (6, 7), id="a block claim is placed on its GPUs"),
        pytest.param(["block-0-1", "gpu-1"], (0, 1), id="a block and one of its GPUs: each GPU once"),
    ],
)
def test_the_placement_names_a_block_claims_gpus(dgx1: Env, devices: list[str], placed: tuple[int, ...]) -> None:
    pod = _dra_pod("tp2", 2, "tp2-gpus")
    dgx1.add_pods(pod)
    claim = _claim("tp2-gpus", [], pod["metadata"]["uid"])
    results = [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
    claim["status"]["allocation"]["devices"]["results"] = results
    dgx1.source.put("resourceclaims", claim)
    assert dgx1.bind(pod, NODE) == ""
    assert _placed(dgx1, pod) == placed
