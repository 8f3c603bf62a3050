"""The webhook's claims where the agents publish clique blocks (the extender's --dra-blocks): a clique of a
block size asks for a whole block first; a pod asking a block through its extended resource gets no claim
of the webhook's (kube-scheduler makes it); the keeper finds the template again by its name."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from gputopo.engine.dra.claims import claim_template, template_named
from gputopo.extender.settings import Settings
from gputopo.extender.webhook.claimtemplates import TemplateKeeper
from gputopo.extender.webhook.mutation import DraMode, admit_pod
from gputopo.model import GPU_RESOURCE, SCHEDULER_NAME, PodRequest
from tests.extender.webhook.test_dra import FakeTemplateApi, _live


def _pod(resources: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-0",
            "namespace": "ml",
            "annotations": annotations or {"gputopo.io/nvlink": "required"},
        },
        "spec": {"schedulerName": SCHEDULER_NAME, "containers": [{"name": "main", "resources": {"limits": resources}}]},
    }


def _review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": "CREATE",
            "object": pod,
        },
    }


def _ops(answer: dict[str, Any]) -> list[dict[str, Any]]:
    patch = answer["response"].get("patch")
    return json.loads(base64.b64decode(patch)) if patch else []


@pytest.mark.parametrize(
    ("gpus", "first_class"),
    [
        pytest.param(4, "clique4.gpu.gputopo.io", id="4: a whole 4-block first"),
        pytest.param(8, "clique8.gpu.gputopo.io", id="8: a whole 8-block first"),
        pytest.param(3, "gpu.gputopo.io", id="3: singles, as without blocks"),
    ],
)
def test_with_blocks_a_clique_claim_asks_for_a_whole_block_first(gpus: int, first_class: str) -> None:
    adm = admit_pod(_review(_pod({GPU_RESOURCE: str(gpus)})), dra=DraMode(list_attributes=True, blocks=True))
    assert adm.template is not None
    request = adm.template.devices["requests"][0]
    first = request["firstAvailable"][0] if "firstAvailable" in request else request["exactly"]
    assert first["deviceClassName"] == first_class
    assert template_named(adm.template.name, list_attributes=True, blocks=True) == adm.template


def test_a_pod_asking_a_block_gets_no_claim_of_the_webhooks() -> None:
    adm = admit_pod(_review(_pod({"gputopo.io/gpu-clique4": "1"})), dra=DraMode(blocks=True))
    assert adm.template is None
    assert not [op for op in _ops(adm.answer) if "resourceClaims" in op["path"]]


def test_blocks_without_dra_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="--dra-blocks shapes the claims of --dra"):
        Settings(dra_blocks=True)
    assert Settings(dra=True, dra_blocks=True).dra_blocks


@pytest.mark.parametrize(("keeper_blocks", "made"), [(True, 1), (False, 0)])
def test_the_keeper_makes_a_block_template_only_when_it_builds_blocks(keeper_blocks: bool, made: int) -> None:
    """A pod names the webhook's block-first template: a keeper of the same settings makes it; one without
    blocks finds no template of that name it would build, and makes nothing."""
    template = claim_template(PodRequest(gpus=4), list_attributes=False, blocks=True)
    api = FakeTemplateApi()
    keeper = TemplateKeeper(api, claims=DraMode(blocks=keeper_blocks))
    keeper.pod_changed(_live("w-0", template.name))
    assert keeper.ensure_pending() == made
    assert (api.names() == {("ml", template.name)}) is bool(made)
