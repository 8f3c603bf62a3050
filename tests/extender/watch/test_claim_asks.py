"""What pre-made ResourceClaims ask, as the ResourceClaims informer keeps it (gputopo.extender.watch.dramerge,
templateasks.ClaimAsks): a pod naming one is read again when its claim arrives, changes, is allocated or goes,
and the claims Kubernetes makes from a template or for an extended resource are never kept."""

from __future__ import annotations

import pytest

from gputopo.extender.watch.cache import ClusterCache
from gputopo.model.claimask import ClaimAsk
from gputopo.model.dra import DEVICE_CLASS
from tests.extender.claimobjs import claim_obj, claim_pod, quad, singles


def asked(cache: ClusterCache, uid: str) -> tuple[int, bool, str] | str | None:
    """The ledger's reading of a pod: (GPUs, a whole block, the NVLink policy), else its problem; None: not held."""
    rec = cache.ledger.pods.get(uid)
    if rec is None:
        return None
    if rec.request is None:
        return rec.problem
    return rec.request.gpus, rec.request.block, rec.request.nvlink.value


def test_a_claim_arriving_after_its_annotated_pod_reads_the_pod_again() -> None:
    cache = ClusterCache()
    cache.replace("resourceclaims", [])
    cache.replace("pods", [claim_pod("p", "mine", nvlink="required")])
    assert asked(cache, "uid-default-p") != (4, False, "required")  # no such claim yet: it asks nothing
    cache.apply("resourceclaims", "ADDED", claim_obj("mine", singles(4)))
    assert asked(cache, "uid-default-p") == (4, False, "required")


def test_a_pods_record_follows_its_claim_as_it_changes_and_goes() -> None:
    cache = ClusterCache()
    cache.replace("resourceclaims", [claim_obj("mine", quad())])
    cache.replace("pods", [claim_pod("p", "mine")])
    assert asked(cache, "uid-default-p") == (4, True, "required")
    cache.apply("resourceclaims", "MODIFIED", claim_obj("mine", singles(2)))
    assert asked(cache, "uid-default-p") == (2, False, "required")
    loose = {"requests": [{"name": "x", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 3}}]}
    cache.apply("resourceclaims", "MODIFIED", claim_obj("mine", loose))
    got = asked(cache, "uid-default-p")
    assert isinstance(got, str) and "ResourceClaim default/mine" in got and "need not be one NVLink clique" in got
    cache.apply("resourceclaims", "DELETED", claim_obj("mine", loose))
    assert asked(cache, "uid-default-p") is None  # asks nothing of gputopo now: kube-scheduler's alone


def test_a_claim_allocated_for_another_pod_pins_the_pods_naming_it() -> None:
    cache = ClusterCache()
    cache.replace("resourceclaims", [claim_obj("mine", quad())])
    cache.replace("pods", [claim_pod("p", "mine", nvlink="required"), claim_pod("q", "mine")])
    assert asked(cache, "uid-default-q") == (4, True, "required")
    allocated = claim_obj("mine", quad(), on="n1", gpus=(0, 1, 2, 3), to="uid-default-p")
    cache.apply("resourceclaims", "MODIFIED", allocated)
    assert cache.claims("default", ("mine",), "uid-default-p") == ("mine", ClaimAsk(4, True), "")
    assert cache.claims("default", ("mine",), "uid-default-q") == ("mine", ClaimAsk(4, True), "n1")
    assert asked(cache, "uid-default-q") is None  # passed through: its claim holds it to n1
    assert asked(cache, "uid-default-p") == (4, True, "required")


@pytest.mark.parametrize(
    "annotation",
    ["resource.kubernetes.io/pod-claim-name", "resource.kubernetes.io/extended-resource-claim"],
)
def test_claims_kubernetes_made_for_a_pod_are_never_kept(annotation: str) -> None:
    made = claim_obj("p-gpus-x7k2q", quad())
    made["metadata"]["annotations"] = {annotation: "gpus"}
    cache = ClusterCache()
    cache.replace("resourceclaims", [made, claim_obj("mine", quad()), claim_obj("theirs", {"requests": []})])
    assert cache.dra.asks.asks == {("default", "mine"): ClaimAsk(4, True)}
    cache.apply("resourceclaims", "MODIFIED", made)
    assert ("default", "p-gpus-x7k2q") not in cache.dra.asks.asks
