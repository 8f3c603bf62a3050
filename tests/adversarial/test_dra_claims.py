"""ResourceClaims as the extender reads them (gputopo/extender/watch/dramerge.py): a claim's status is
written by whoever may update `resourceclaims/status` in its namespace, so a tenant can forge its
`reservedFor` to name a pod UID of another namespace. A consumer reference is in the claim's namespace
by API definition: such a claim's GPUs stay in use, under `other`, and never count as that pod's own.

Bounds: another tenant's pod keeps the GPUs it holds (the filter sees them used); evicting it frees
none of the forged claim's GPUs (the preempt verb drops a node they fill); its own bind's re-check
takes none of them."""

from __future__ import annotations

import json

import pytest

from gputopo.model import PLACEMENT_ANNOTATION, GpusInUse, parse_placement
from gputopo.model.dra import DRIVER, MAX_RESERVED_FOR
from tests.extender.harness import JSON, Env, node_obj, pod_obj

NODE = "a"  # a DGX-1V: NVLink quads {0-3} and {4-7}
VICTIM_UID = "uid-tenant-b-victim"


def _slice() -> JSON:
    return {
        "metadata": {"name": f"{NODE}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}"} for i in range(8)],
        },
    }


def _forged(gpus: list[int], pod_uids: list[str], namespace: str = "tenant-a") -> JSON:
    """A claim of `namespace` whose status says our GPUs `gpus` are allocated and reserved for `pod_uids`."""
    results = [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"} for i in gpus]
    return {
        "metadata": {"uid": f"claim-{namespace}", "namespace": namespace, "name": "forged"},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "victim", "uid": u} for u in pod_uids],
        },
    }


def _victim(gpus: list[int]) -> JSON:
    """Tenant B's pod, bound to the node and holding `gpus` (its placement)."""
    ann = {PLACEMENT_ANNOTATION: json.dumps({"node": NODE, "gpus": gpus, "score": 9, "reason": "r"})}
    pod = pod_obj("victim", len(gpus), ann, namespace="tenant-b", node=NODE, phase="Running")
    pod["spec"]["priority"] = 1
    return pod


@pytest.fixture
def forged(env: Env) -> Env:
    """Tenant B's victim holds quad {0-3}; tenant A's forged claim holds quad {4-7} "for" the victim."""
    env.add_nodes(node_obj(NODE, "dgx-1v"))
    env.source.put("resourceslices", _slice())
    env.source.put("resourceclaims", _forged([4, 5, 6, 7], [VICTIM_UID]))
    env.add_pods(_victim([0, 1, 2, 3]))
    return env


def test_a_forged_claim_hides_none_of_another_tenants_gpus(forged: Env) -> None:
    """Were the claim the victim's, its GPUs would replace the victim's placement: quad {0-3} would look free."""
    assert forged.ledger.nodes[NODE].report == GpusInUse(other=frozenset({4, 5, 6, 7}))
    assert forged.ledger.pod_gpus(NODE, VICTIM_UID) == frozenset({0, 1, 2, 3})
    out = forged.filter(pod_obj("new", 4, {"gputopo.io/nvlink": "required"}, namespace="tenant-c"), [NODE])
    assert NODE not in (out.get("NodeNames") or [])


def test_evicting_the_named_pod_frees_none_of_the_forged_claims_gpus(forged: Env) -> None:
    """The preempt verb's what-if: an 8-GPU pod fits once the victim goes only if the claim went with it."""
    high = pod_obj("high", 8, {"gputopo.io/nvlink": "ignore"}, namespace="tenant-c")
    body = {"Pod": high, "NodeNameToMetaVictims": {NODE: {"Pods": [{"UID": VICTIM_UID}], "NumPDBViolations": 0}}}
    r = forged.call("preempt", body)
    assert r.status == 200
    assert r.json()["NodeNameToMetaVictims"] == {}


def test_the_named_pods_own_bind_takes_none_of_the_forged_claims_gpus(env: Env) -> None:
    """A pending pod of tenant B whose UID the claim names: its bind's re-check frees only what is its own."""
    env.add_nodes(node_obj(NODE, "dgx-1v"))
    env.source.put("resourceslices", _slice())
    pod = pod_obj("next", 4, {"gputopo.io/nvlink": "required"}, namespace="tenant-b")
    env.source.put("resourceclaims", _forged([0, 1, 2, 3], [pod["metadata"]["uid"]]))
    env.add_pods(pod)
    assert env.bind(pod, NODE) == ""
    stored = env.source.get("pods", "tenant-b", "next")
    assert stored is not None
    assert parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus == (4, 5, 6, 7)


@pytest.mark.parametrize(
    ("reserved_for", "claim_namespace", "report"),
    [
        pytest.param(
            [VICTIM_UID], "tenant-b", GpusInUse(pods={VICTIM_UID: frozenset({4})}), id="own namespace: its own"
        ),
        pytest.param([VICTIM_UID], "tenant-a", GpusInUse(other=frozenset({4})), id="another namespace's pod: other"),
        pytest.param(["no-such-pod"], "tenant-a", GpusInUse(other=frozenset({4})), id="a UID no pod has: other"),
        pytest.param(
            [VICTIM_UID] * 2 + [f"u{i}" for i in range(MAX_RESERVED_FOR - 2)],
            "tenant-a",
            GpusInUse(other=frozenset({4})),
            id="the victim among 256 consumers: other",
        ),
    ],
)
def test_a_claims_consumer_counts_only_in_the_claims_namespace(
    env: Env, reserved_for: list[str], claim_namespace: str, report: GpusInUse
) -> None:
    env.add_nodes(node_obj(NODE, "dgx-1v"))
    env.source.put("resourceslices", _slice())
    env.add_pods(_victim([0]))
    env.source.put("resourceclaims", _forged([4], reserved_for, namespace=claim_namespace))
    env.resync()
    assert env.ledger.nodes[NODE].report == report
