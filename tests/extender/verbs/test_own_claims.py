"""A pod under gputopo-scheduler that names its own ResourceClaimTemplate (gputopo.model.claimask): a template
of one whole block is filtered, ranked and bound exactly as the same block asked by extended resource, a
template of N GPUs of one clique as the N-GPU pod under `gputopo.io/nvlink: required`, and any other ask of
gputopo's devices fails every node with one sentence naming the template (docs/install.md, "Your own
claims")."""

from __future__ import annotations

import pytest

from gputopo.engine.dra.claims import claim_template
from gputopo.model import PLACEMENT_ANNOTATION, PodRequest, parse_placement
from tests.extender.claimobjs import ASKS, TRIO, add_trio, block_pod, template_obj
from tests.extender.harness import JSON, Env, gputopo_pod, pod_obj

NODES = TRIO
OWN = claim_template(PodRequest(gpus=4), list_attributes=False)


def own_pod(name: str, *templates: str, resources: dict[str, str] | None = None, **ann: str) -> JSON:
    """A pod whose claims come from `templates`, with `resources` (limits) beside them."""
    pod = pod_obj(name, 0, {f"gputopo.io/{k}": v for k, v in ann.items()})
    pod["spec"]["containers"][0]["resources"] = {
        "limits": dict(resources or {}),
        "claims": [{"name": f"c{i}"} for i in range(len(templates))],
    }
    pod["spec"]["resourceClaims"] = [{"name": f"c{i}", "resourceClaimTemplateName": t} for i, t in enumerate(templates)]
    return pod


@pytest.fixture
def three(env: Env) -> Env:
    """The trio of DGX-1V nodes (`add_trio`) and the templates the pods name."""
    for name, devices in ASKS:
        env.source.put("resourceclaimtemplates", template_obj(name, devices))
    env.source.put("resourceclaimtemplates", OWN.body("default"))
    add_trio(env)
    return env


def test_a_block_template_pod_is_filtered_and_ranked_as_the_extended_resource_pod(three: Env) -> None:
    mine, theirs = own_pod("tp4", "quad"), block_pod("tp4-resource")
    assert three.filter(mine, NODES) == three.filter(theirs, NODES)
    assert three.passed(mine, NODES) == ["whole", "half"]
    assert three.prioritize(mine, NODES) == three.prioritize(theirs, NODES)


def test_a_block_template_pod_is_bound_to_the_same_block_with_the_same_sentence(three: Env) -> None:
    placed = {}
    for pod in (own_pod("tp4", "quad"), block_pod("tp4-resource")):
        three.add_pods(pod)
        three.filter(pod, NODES)
        assert three.bind(pod, "half") == ""
        stored = three.source.get("pods", "default", pod["metadata"]["name"])
        assert stored is not None
        placed[pod["metadata"]["name"]] = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        three.source.delete("pods", "default", pod["metadata"]["name"])
        three.resync()
    mine, theirs = placed["tp4"], placed["tp4-resource"]
    assert mine.gpus == theirs.gpus == (4, 5, 6, 7)
    assert mine.reason == theirs.reason and "are block-4-5-6-7, the first free 4-GPU block" in mine.reason


@pytest.mark.parametrize("n", [2, 4])
def test_a_clique_template_pod_is_filtered_and_ranked_as_the_annotated_pod(three: Env, n: int) -> None:
    mine, theirs = own_pod(f"tp{n}", f"clique{n}"), gputopo_pod(f"tp{n}-annotated", n)
    assert three.filter(mine, NODES) == three.filter(theirs, NODES)
    assert three.prioritize(mine, NODES) == three.prioritize(theirs, NODES)


def test_a_clique_template_pod_is_recorded_and_bound_as_the_annotated_pod(three: Env) -> None:
    placed = []
    for pod in (own_pod("tp4", "clique4"), gputopo_pod("tp4-annotated", 4)):
        name = pod["metadata"]["name"]
        three.add_pods(pod)
        rec = three.ledger.pods[f"uid-default-{name}"]
        assert rec.request is not None and (rec.gpus, rec.request.gpus, rec.request.nvlink.value) == (4, 4, "required")
        three.filter(pod, NODES)
        assert three.bind(pod, "half") == ""
        stored = three.source.get("pods", "default", name)
        assert stored is not None
        placed.append(parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION]))
        three.source.delete("pods", "default", name)
        three.resync()
    assert placed[0].gpus == placed[1].gpus == (4, 5, 6, 7)
    assert placed[0].reason == placed[1].reason


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        pytest.param(
            own_pod("p", "two-quads"),
            "ResourceClaimTemplate default/two-quads: spec.devices.requests[0].exactly.count: 2: a pod asks",
            id="two blocks",
        ),
        pytest.param(
            own_pod("p", "quad", resources={"nvidia.com/gpu": "2"}),
            "ResourceClaimTemplate quad beside nvidia.com/gpu: 2: a pod asks for GPUs one way",
            id="beside nvidia.com/gpu",
        ),
        pytest.param(
            own_pod("p", "quad", resources={"gputopo.io/gpu-clique2": "1"}),
            "ResourceClaimTemplate quad beside gputopo.io/gpu-clique2",
            id="beside a block resource",
        ),
        pytest.param(
            own_pod("p", "quad", OWN.name, nvlink="required"),
            f"ResourceClaimTemplate quad beside gputopo's ResourceClaimTemplate {OWN.name}",
            id="beside gputopo's own template",
        ),
        pytest.param(
            own_pod("p", "quad", "clique2"),
            "ResourceClaimTemplates quad and clique2 both ask",
            id="two templates asking",
        ),
        pytest.param(
            own_pod("p", "clique4", nvlink="preferred"),
            "asks 4 GPUs of one NVLink clique",
            id="nvlink preferred contradicts the clique",
        ),
        pytest.param(own_pod("p", "quad", nvlink="ignore"), "is one NVLink clique", id="nvlink ignore on a block"),
    ],
)
def test_what_gputopo_cannot_place_fails_every_node_with_one_sentence(three: Env, pod: JSON, says: str) -> None:
    reasons = three.reasons(pod, NODES)
    assert len(reasons) == 1
    assert says in next(iter(reasons)), reasons


def test_a_pod_whose_template_asks_nothing_of_gputopo_passes_through(three: Env) -> None:
    three.source.put("resourceclaimtemplates", template_obj("nothing-of-ours", {"requests": []}))
    three.resync()
    pod = own_pod("p", "nothing-of-ours")
    assert three.passed(pod, NODES) == NODES
    three.add_pods(pod)
    assert "uid-default-p" not in three.ledger.pods


@pytest.mark.parametrize(("scheduler", "ours"), [("gputopo-scheduler", True), ("default-scheduler", False)])
def test_the_watch_tracks_an_own_claim_pod_only_under_our_scheduler(three: Env, scheduler: str, ours: bool) -> None:
    pod = own_pod("p", "quad")
    pod["spec"]["schedulerName"] = scheduler
    three.add_pods(pod)
    rec = three.ledger.pods.get("uid-default-p")
    assert (rec is not None and rec.request is not None and rec.request.block) is ours
