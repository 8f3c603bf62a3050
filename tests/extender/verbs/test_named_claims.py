"""A pod under gputopo-scheduler that names a pre-made ResourceClaim (`resourceClaimName`): a claim of one whole
block is filtered and ranked as the same block asked by extended resource, a claim of N GPUs of one clique as
the N-GPU pod under `gputopo.io/nvlink: required`, any other ask of gputopo's devices fails every node with one
sentence naming the claim, and a claim already allocated (shared, or re-used) is passed through to the node it
holds (docs/install.md, "Your own claims")."""

from __future__ import annotations

import pytest

from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from tests.extender.claimobjs import ASKS, TRIO, add_trio, block_pod, claim_obj, claim_pod, quad, template_obj
from tests.extender.harness import JSON, Env, gputopo_pod

NODES = TRIO


@pytest.fixture
def three(env: Env) -> Env:
    """The trio of DGX-1V nodes (`add_trio`) and the claims the pods name."""
    for name, devices in ASKS:
        env.source.put("resourceclaims", claim_obj(name, devices))
    env.source.put("resourceclaimtemplates", template_obj("quad-template", quad()))
    add_trio(env)
    return env


def test_a_block_claim_pod_is_filtered_and_ranked_as_the_extended_resource_pod(three: Env) -> None:
    mine, theirs = claim_pod("p", "quad"), block_pod("p-resource")
    assert three.filter(mine, NODES) == three.filter(theirs, NODES)
    assert three.passed(mine, NODES) == ["whole", "half"]
    assert three.prioritize(mine, NODES) == three.prioritize(theirs, NODES)


def test_a_clique_claim_pod_is_recorded_and_filtered_as_the_annotated_pod(three: Env) -> None:
    mine, theirs = claim_pod("p", "clique4"), gputopo_pod("p-annotated", 4)
    assert three.filter(mine, NODES) == three.filter(theirs, NODES)
    three.add_pods(mine)
    rec = three.ledger.pods["uid-default-p"]
    assert rec.request is not None and (rec.gpus, rec.request.gpus, rec.request.nvlink.value) == (4, 4, "required")
    assert rec.named_claims == ("clique4",)


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        pytest.param(
            claim_pod("p", "two-quads"),
            "ResourceClaim default/two-quads: spec.devices.requests[0].exactly.count: 2: a pod asks",
            id="two blocks",
        ),
        pytest.param(
            claim_pod("p", "quad", resources={"nvidia.com/gpu": "2"}),
            "ResourceClaim quad beside nvidia.com/gpu: 2: a pod asks for GPUs one way",
            id="beside nvidia.com/gpu",
        ),
        pytest.param(
            claim_pod("p", "quad", resources={"gputopo.io/gpu-clique2": "1"}),
            "ResourceClaim quad beside gputopo.io/gpu-clique2",
            id="beside a block resource",
        ),
        pytest.param(claim_pod("p", "quad", "clique2"), "ResourceClaims quad and clique2 both ask", id="two claims"),
        pytest.param(
            claim_pod("p", "clique4", nvlink="preferred"), "asks 4 GPUs of one NVLink clique", id="nvlink preferred"
        ),
    ],
)
def test_what_gputopo_cannot_place_fails_every_node_with_one_sentence(three: Env, pod: JSON, says: str) -> None:
    reasons = three.reasons(pod, NODES)
    assert len(reasons) == 1
    assert says in next(iter(reasons)), reasons


def test_a_named_claim_beside_a_template_that_asks_is_refused_naming_both(three: Env) -> None:
    pod = claim_pod("p", "quad")
    pod["spec"]["resourceClaims"].append({"name": "t", "resourceClaimTemplateName": "quad-template"})
    (reason,) = three.reasons(pod, NODES)
    assert "ResourceClaimTemplate quad-template and ResourceClaim quad both ask" in reason


def test_a_claim_allocated_for_another_pod_passes_the_pod_through_to_its_node(three: Env) -> None:
    three.source.put("resourceclaims", claim_obj("shared", quad(), on="half", gpus=(4, 5, 6, 7), to="uid-default-a"))
    three.resync()
    pod = claim_pod("b", "shared")
    assert three.passed(pod, NODES) == NODES  # kube-scheduler's DRA plugin holds it to `half`; gputopo does not fight
    three.add_pods(pod)
    assert "uid-default-b" not in three.ledger.pods
    assert three.bind(pod, "half") == ""
    stored = three.source.get("pods", "default", "b")
    assert stored is not None and PLACEMENT_ANNOTATION not in stored["metadata"].get("annotations", {})


def test_a_claim_allocated_for_this_pod_alone_is_bound_with_the_allocation_as_its_placement(three: Env) -> None:
    pod = claim_pod("p", "quad")
    three.add_pods(pod)
    assert three.passed(pod, NODES) == ["whole", "half"]
    # kube-scheduler's PreBind allocated the claim on the node gputopo chose, reserved for this pod.
    three.source.put("resourceclaims", claim_obj("quad", quad(), on="half", gpus=(4, 5, 6, 7), to="uid-default-p"))
    three.resync()
    assert three.bind(pod, "half") == ""
    stored = three.source.get("pods", "default", "p")
    assert stored is not None
    assert parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus == (4, 5, 6, 7)


def test_a_claim_created_after_its_pod_is_read_at_the_pods_next_filter(three: Env) -> None:
    pod = claim_pod("p", "late")
    assert three.passed(pod, NODES) == NODES  # no such claim yet: not gputopo's
    three.source.put("resourceclaims", claim_obj("late", quad()))
    three.resync()
    assert three.passed(pod, NODES) == ["whole", "half"]


def test_a_claim_asking_nothing_of_gputopo_passes_the_pod_through(three: Env) -> None:
    three.source.put(
        "resourceclaims",
        claim_obj("theirs", {"requests": [{"name": "x", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}),
    )
    three.resync()
    pod = claim_pod("p", "theirs")
    assert three.passed(pod, NODES) == NODES
    three.add_pods(pod)
    assert "uid-default-p" not in three.ledger.pods
