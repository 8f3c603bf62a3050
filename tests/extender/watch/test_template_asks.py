"""What hand-written claim templates ask, as the templates informer keeps it (gputopo.extender.watch.templateasks):
a pod naming one waits until the templates are listed, is read again when its template arrives or changes,
and reads its own namespace's template only."""

from __future__ import annotations

from typing import Any

from gputopo.engine.dra.claims import claim_template
from gputopo.extender.watch.cache import ClusterCache
from gputopo.model import PodRequest
from gputopo.model.claimask import ClaimAsk
from gputopo.model.dra import DEVICE_CLASS, block_class
from tests.extender.harness import JSON, Env, node_obj, pod_obj

CLIQUES = "gpu.gputopo.io/nvlinkCliques"


def template_obj(name: str, devices: dict[str, Any], ns: str = "default") -> JSON:
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": devices}}}


def block(size: int) -> dict[str, Any]:
    return {"requests": [{"name": "gpus", "exactly": {"deviceClassName": block_class(size), "count": 1}}]}


def singles(n: int) -> dict[str, Any]:
    return {
        "requests": [{"name": "gpus", "exactly": {"deviceClassName": DEVICE_CLASS, "count": n}}],
        "constraints": [{"matchAttribute": CLIQUES}],
    }


def own_pod(name: str, template: str, ns: str = "default") -> JSON:
    pod = pod_obj(name, 0, namespace=ns)
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpus"}]}
    pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
    return pod


def asked(cache: ClusterCache, uid: str) -> tuple[int, bool, str] | str:
    """The ledger's reading of a pod: (GPUs, a whole block, the NVLink policy), else its problem."""
    rec = cache.ledger.pods[uid]
    if rec.request is None:
        return rec.problem
    return rec.request.gpus, rec.request.block, rec.request.nvlink.value


def test_a_pod_listed_before_the_templates_waits_then_asks_its_templates_block() -> None:
    cache = ClusterCache()  # an extender starting: its pod informer lists first
    cache.replace("pods", [own_pod("p", "quad")])
    got = asked(cache, "uid-default-p")
    assert isinstance(got, str) and got.startswith("waiting: ResourceClaimTemplates not read yet")
    cache.replace("resourceclaimtemplates", [template_obj("quad", block(4))])
    assert asked(cache, "uid-default-p") == (4, True, "required")


def test_a_pods_record_follows_its_template_as_it_changes_and_goes() -> None:
    cache = ClusterCache()
    cache.replace("resourceclaimtemplates", [template_obj("mine", block(4))])
    cache.replace("pods", [own_pod("p", "mine")])
    assert asked(cache, "uid-default-p") == (4, True, "required")
    cache.apply("resourceclaimtemplates", "MODIFIED", template_obj("mine", singles(2)))
    assert asked(cache, "uid-default-p") == (2, False, "required")
    loose = {"requests": [{"name": "x", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 3}}]}
    cache.apply("resourceclaimtemplates", "MODIFIED", template_obj("mine", loose))
    got = asked(cache, "uid-default-p")
    assert isinstance(got, str) and "need not be one NVLink clique" in got
    cache.apply("resourceclaimtemplates", "DELETED", template_obj("mine", {}))
    assert "uid-default-p" not in cache.ledger.pods  # asks nothing of gputopo now: kube-scheduler's alone


def test_a_template_created_after_its_pod_is_read_at_the_pods_next_filter(env: Env) -> None:
    env.add_nodes(node_obj("whole", "dgx-1v"), node_obj("broken", "dgx-1v", in_use=[1, 5]))
    pod = own_pod("p", "late")
    assert env.passed(pod, ["whole", "broken"]) == ["whole", "broken"]  # no such template yet: not ours
    env.source.put("resourceclaimtemplates", template_obj("late", block(4)))
    env.resync()
    assert env.passed(pod, ["whole", "broken"]) == ["whole"]  # a free quad: as gputopo.io/gpu-clique4


def test_the_table_keeps_only_templates_that_ask_and_never_gputopos_own() -> None:
    cache = ClusterCache()
    own = claim_template(PodRequest(gpus=4), list_attributes=False).body("default")
    cache.replace(
        "resourceclaimtemplates",
        [template_obj("quad", block(4)), template_obj("nothing", {"requests": []}), own],
    )
    assert cache.asks.asks == {("default", "quad"): ClaimAsk(4, True)}
    assert cache.asks("default", (own["metadata"]["name"], "nothing")) == ("", ClaimAsk())
