"""ComputeDomains through the extender: a pod's IMEX channel claim read from the ResourceClaimTemplate it names
(NVIDIA's DRA driver makes one per ComputeDomain), its ComputeDomain's pods kept in one NVLink domain, another
ComputeDomain's channel refused, and pods of none steered onto the trays whose channel is taken."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.gang.imex import DRIVER_NODE_LABEL
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.computedomains import (
    MAX_NUM_NODES,
    ChannelTemplates,
    ComputeDomainSizes,
    compute_domain_size,
)
from gputopo.extender.wire import WireError, pod_info
from gputopo.model.claimtemplate import CHANNEL_DEVICE_CLASS, TemplateError, read_claim_template, template_meta
from gputopo.model.dra import DEVICE_CLASS
from gputopo.model.pod import MAX_POD_CLAIMS
from tests.extender.harness import JSON, Env, node_obj, pod_obj

TRAYS = {"a1": "rack-a", "a2": "rack-a", "b1": "rack-b", "b2": "rack-b"}
NAMES = sorted(TRAYS)


def tray(name: str, rack: str) -> JSON:
    node = node_obj(name, "gb200-tray")
    node["metadata"]["labels"]["nvidia.com/gpu.clique"] = rack
    return node


def template(name: str, device_class: str = CHANNEL_DEVICE_CLASS, *, first: bool = False, ns: str = "default") -> JSON:
    request: JSON = {"name": "channel"}
    if first:
        request["firstAvailable"] = [{"name": "x", "deviceClassName": device_class}]
    else:
        request["exactly"] = {"deviceClassName": device_class}
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": {"requests": [request]}}}}


def cd_pod(name: str, gpus: int, cd: str | None, *, node: str | None = None, **ann: str) -> JSON:
    pod = pod_obj(name, gpus, ann, node=node, phase="Running" if node else "Pending")
    if cd is not None:
        pod["spec"]["resourceClaims"] = [{"name": "imex", "resourceClaimTemplateName": cd}]
    return pod


@pytest.fixture
def racks(env: Env) -> Env:
    env.source.put("resourceclaimtemplates", template("cd-a"))
    env.source.put("resourceclaimtemplates", template("cd-b"))
    env.add_nodes(*(tray(n, r) for n, r in TRAYS.items()))
    return env


def fails(env: Env, pod: JSON, names: list[str]) -> dict[str, str]:
    """Why each node failed, where none passed (kube-scheduler reads reasons only then)."""
    out = env.filter(pod, names)
    return {**out["FailedNodes"], **out["FailedAndUnresolvableNodes"]}


# --------------------------------------------------------------------------------------------------
# reading the claim


@pytest.mark.parametrize(
    ("obj", "channel"),
    [
        pytest.param(template("t"), True, id="exactly the channel class"),
        pytest.param(template("t", first=True), True, id="the channel class among firstAvailable"),
        pytest.param(template("t", DEVICE_CLASS), False, id="gputopo's GPUs"),
        pytest.param(template("t", "compute-domain-daemon.nvidia.com"), False, id="the IMEX daemon's class"),
        pytest.param({"metadata": {"name": "t", "namespace": "default"}, "spec": {}}, False, id="no requests"),
    ],
)
def test_a_template_is_a_channel_template_by_its_device_class(obj: JSON, channel: bool) -> None:
    got = read_claim_template(obj)
    assert (got.meta.key, got.channel) == (("default", "t"), channel)


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        pytest.param({"metadata": {"name": "t"}}, "metadata.namespace", id="no namespace"),
        pytest.param({"metadata": {"name": "t", "namespace": "n"}, "spec": []}, "spec is not", id="spec a list"),
        pytest.param(
            {"metadata": {"name": "t", "namespace": "n"}, "spec": {"spec": {"devices": {"requests": {}}}}},
            "spec.spec.devices.requests",
            id="requests a map",
        ),
        pytest.param(
            {"metadata": {"name": "t", "namespace": "n"}, "spec": {"spec": {"devices": {"requests": [1]}}}},
            "spec.spec.devices.requests[0]",
            id="a request not an object",
        ),
    ],
)
def test_an_unreadable_template_is_refused_naming_the_field(obj: JSON, field: str) -> None:
    with pytest.raises(TemplateError, match=re.escape(field)):
        read_claim_template(obj)


@pytest.mark.parametrize(
    ("claims", "expected"),
    [
        pytest.param(None, (), id="none"),
        pytest.param([{"name": "c", "resourceClaimTemplateName": "t"}], ("t",), id="a template"),
        pytest.param([{"name": "c", "resourceClaimName": "shared"}], (), id="a claim named directly is not read"),
    ],
)
def test_a_pods_claim_templates_are_read(claims: Any, expected: tuple[str, ...]) -> None:
    pod = pod_obj("p", 1)
    if claims is not None:
        pod["spec"]["resourceClaims"] = claims
    assert pod_info(pod).claim_templates == expected


@pytest.mark.parametrize(
    "claims", [{"c": 1}, [{"name": "c"}] * (MAX_POD_CLAIMS + 1), [{"resourceClaimTemplateName": 3}]]
)
def test_unreadable_pod_claims_name_the_field(claims: Any) -> None:
    pod = pod_obj("p", 1)
    pod["spec"]["resourceClaims"] = claims
    with pytest.raises(WireError, match=re.escape("Pod.spec.resourceClaims")):
        pod_info(pod)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.just(CHANNEL_DEVICE_CLASS),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["metadata", "name", "namespace", "spec", "devices", "requests", "exactly", "firstAvailable"]
            )
            | st.sampled_from(["deviceClassName", "resourceClaimTemplateName"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@given(JSONISH)
def test_any_template_object_is_read_or_refused_naming_it(obj: Any) -> None:
    try:
        got = read_claim_template(obj)
    except TemplateError as e:
        assert str(e).startswith("ResourceClaimTemplate ")
        return
    (namespace, name), channel = got.meta.key, got.channel
    assert isinstance(namespace, str) and isinstance(name, str) and isinstance(channel, bool)


@given(JSONISH)
def test_any_pod_claims_are_read_or_refused_naming_the_field(claims: Any) -> None:
    pod = pod_obj("p", 1)
    pod["spec"]["resourceClaims"] = claims
    try:
        got = pod_info(pod).claim_templates
    except WireError as e:
        assert "Pod.spec.resourceClaims" in str(e)
        return
    assert all(isinstance(n, str) and n for n in got)


def test_a_pod_naming_a_template_waits_until_the_templates_are_listed() -> None:
    seen: list[object] = []
    channels = ChannelTemplates(lambda *a: None, seen.append)
    cd, why = channels("ns", ("gputopo-gpus-4", "imex"))
    assert cd is None and why.startswith("waiting: ResourceClaimTemplates not read yet (the pod names ns/imex")
    assert channels("ns", ("gputopo-gpus-4",)) == (None, "")  # gputopo's own templates are known
    channels.replace([template("imex", ns="ns")])
    assert seen == [None] and channels("ns", ("imex",)) == ("ns/imex", "")
    assert channels("ns", ("other",)) == (None, "")  # listed and not a channel template
    channels.apply("DELETED", template("imex", ns="ns"))
    assert seen == [None, {("ns", "imex")}] and channels("ns", ("imex",)) == (None, "")


def test_a_static_cluster_has_no_templates_to_wait_for() -> None:
    cache = ClusterCache()
    cache.load_static([])
    assert cache.channels("ns", ("imex",)) == (None, "")


def test_a_channel_claim_alone_opts_a_pod_in_and_sets_its_compute_domain(racks: Env) -> None:
    racks.add_pods(cd_pod("w", 4, "cd-a"))
    rec = racks.ledger.pods["uid-default-w"]
    assert rec.request is not None and rec.request.compute_domain == "default/cd-a"
    assert racks.filter(cd_pod("plain", 4, None), NAMES)["NodeNames"] == NAMES  # no claim: passes through


def test_pods_listed_before_the_templates_wait_then_serve_the_channel_once_they_are_listed() -> None:
    cache = ClusterCache()  # an extender starting: its pod informer lists first
    cache.replace("pods", [cd_pod("w", 4, "cd-a", node="a1"), cd_pod("p", 4, "cd-a")])
    pending = cache.ledger.pods["uid-default-p"]
    assert pending.request is None and pending.problem.startswith("waiting: ResourceClaimTemplates not read yet")
    assert cache.ledger.pods.serving() == {}
    cache.replace("resourceclaimtemplates", [template("cd-a")])
    assert cache.ledger.pods.serving() == {"a1": frozenset({"default/cd-a"})}
    again = cache.ledger.pods["uid-default-p"].request
    assert again is not None and again.compute_domain == "default/cd-a"


# --------------------------------------------------------------------------------------------------
# placement


def test_a_compute_domains_pods_follow_its_first_pod_into_one_nvlink_domain(racks: Env) -> None:
    first, second = cd_pod("w-0", 4, "cd-a"), cd_pod("w-1", 4, "cd-a")
    racks.add_pods(first, second)
    assert racks.passed(first, NAMES) == NAMES  # none placed: any domain
    assert racks.bind(first, "b1") == ""
    assert racks.passed(second, NAMES) == ["b2"]
    assert fails(racks, second, ["a1", "a2", "b1"]) == dict.fromkeys(
        ["a1", "a2"], "outside NVLink domain rack-b of ComputeDomain default/cd-a"
    ) | {"b1": "fewer than 4 free GPUs"}


def test_a_tray_serving_another_compute_domains_channel_is_refused(racks: Env) -> None:
    a, b = cd_pod("a-0", 2, "cd-a"), cd_pod("b-0", 2, "cd-b")
    racks.add_pods(a, b)
    assert racks.bind(a, "a1") == ""
    assert fails(racks, b, ["a1"]) == {"a1": "IMEX channel serves another ComputeDomain than default/cd-b"}
    assert racks.passed(b, NAMES) == ["a2", "b1", "b2"]


def test_a_small_pod_of_no_compute_domain_takes_a_served_tray_first_and_a_needed_free_tray_last(racks: Env) -> None:
    a = cd_pod("a-0", 2, "cd-a")
    racks.add_pods(a)
    assert racks.bind(a, "a1") == ""
    small = cd_pod("small", 1, None, **{"gputopo.io/nvlink": "required"})
    scores = racks.prioritize(small, NAMES)
    assert max(scores, key=scores.__getitem__) == "a1"  # its channel is taken: its GPUs serve no CD pod
    assert scores["a2"] < min(scores["b1"], scores["b2"])  # rack-a's free tray is kept for cd-a


def test_a_whole_tray_pod_of_no_compute_domain_is_not_steered(racks: Env) -> None:
    racks.add_pods(a := cd_pod("a-0", 2, "cd-a"))
    assert racks.bind(a, "a1") == ""
    whole = cd_pod("whole", 4, None, **{"gputopo.io/nvlink": "required"})
    scores = racks.prioritize(whole, ["a2", "b1", "b2"])
    assert max(scores, key=scores.__getitem__) == "a2"  # best fit as ever: the fuller rack's free tray first


# --------------------------------------------------------------------------------------------------
# what NVIDIA's driver says: its label on templates and nodes


def with_uid(obj: JSON, uid: str) -> JSON:
    """A template or node as NVIDIA's driver labels it for the ComputeDomain `uid`."""
    obj["metadata"].setdefault("labels", {})[DRIVER_NODE_LABEL] = uid
    return obj


def test_the_channel_templates_name_the_compute_domain_of_a_uid() -> None:
    channels = ChannelTemplates(lambda *a: None)
    channels.replace([with_uid(template("cd-a"), "u-a"), with_uid(template("gpus", DEVICE_CLASS), "u-g")])
    assert channels.compute_domain_of("u-a") == "default/cd-a"
    assert channels.compute_domain_of("u-g") is None  # not a channel template
    channels.apply("MODIFIED", with_uid(template("cd-a"), "u-a2"))
    assert (channels.compute_domain_of("u-a"), channels.compute_domain_of("u-a2")) == (None, "default/cd-a")
    channels.apply("DELETED", with_uid(template("cd-a"), "u-a2"))
    assert channels.compute_domain_of("u-a2") is None


@given(JSONISH)
def test_any_template_labels_give_a_uid_or_none(labels: Any) -> None:
    try:
        uid = template_meta({"metadata": {"name": "t", "namespace": "n", "labels": labels}}).compute_domain_uid
    except TemplateError as e:
        assert "ResourceClaimTemplate n/t: metadata.labels" in str(e)
        return
    assert uid is None or (isinstance(uid, str) and uid)


@pytest.mark.parametrize("uid", ["u-a", "u-unknown"], ids=["a known ComputeDomain", "an unknown UID"])
def test_a_tray_the_driver_labelled_for_another_compute_domain_is_refused_until_unlabelled(
    racks: Env, uid: str
) -> None:
    racks.source.put("resourceclaimtemplates", with_uid(template("cd-a"), "u-a"))
    racks.add_nodes(with_uid(tray("a1", "rack-a"), uid))  # its pod is no pod of gputopo's
    b = cd_pod("b-0", 4, "cd-b")
    racks.add_pods(b)
    assert fails(racks, b, ["a1"]) == {"a1": "IMEX channel serves another ComputeDomain than default/cd-b"}
    assert racks.passed(b, NAMES) == ["a2", "b1", "b2"]
    racks.add_nodes(tray("a1", "rack-a"))  # the driver took its label off
    assert racks.passed(b, NAMES) == NAMES


def test_the_driver_label_pins_its_compute_domains_pods_to_the_labelled_trays_domain(racks: Env) -> None:
    racks.source.put("resourceclaimtemplates", with_uid(template("cd-a"), "u-a"))
    racks.source.put("computedomains", compute_domain("a", "cd-a", uid="u-a"))  # the UID's owner
    racks.add_nodes(with_uid(tray("b1", "rack-b"), "u-a"))
    a = cd_pod("a-0", 4, "cd-a")
    racks.add_pods(a)
    assert racks.passed(a, NAMES) == ["b1", "b2"]


def gang(cd: str, size: int, gpus: int) -> list[JSON]:
    group = {"gputopo.io/group": "g", "gputopo.io/group-size": str(size)}
    return [cd_pod(f"g-{i}", gpus, cd, **group, **{"gputopo.io/stage": str(i)}) for i in range(size)]


@pytest.fixture
def beside_cd_b(racks: Env) -> list[JSON]:
    """A one-GPU pod of cd-b on a1, and a gang of cd-a of two 3-GPU members: rack a is the fuller with room
    for both (a1's three free GPUs and a2), but a1's channel serves cd-b."""
    other = cd_pod("b-0", 1, "cd-b")
    racks.add_pods(other)
    assert racks.bind(other, "a1") == ""
    members = gang("cd-a", 2, 3)
    racks.add_pods(*members)
    return members


def test_a_compute_domain_gang_leaves_out_trays_serving_another_compute_domain(
    racks: Env, beside_cd_b: list[JSON]
) -> None:
    assert sorted(racks.passed(m, NAMES)[0] for m in beside_cd_b) == ["b1", "b2"]  # whole on rack b


def test_a_compute_domain_gang_that_only_fits_with_another_compute_domains_tray_says_which(
    racks: Env, beside_cd_b: list[JSON]
) -> None:
    (why,) = racks.reasons(beside_cd_b[0], ["a1", "a2"])
    assert why.endswith("; 1 node(s) serve another ComputeDomain's IMEX channel (the first a1)"), why


def test_a_compute_domain_gang_waits_for_room_in_the_domain_its_compute_domains_pods_run_in(racks: Env) -> None:
    solo = cd_pod("solo", 2, "cd-a")
    racks.add_pods(solo)
    assert racks.bind(solo, "b1") == ""
    members = gang("cd-a", 2, 4)  # rack a holds both members; rack b, where cd-a runs, only one
    racks.add_pods(*members)
    (why,) = racks.reasons(members[0], NAMES)
    assert why.endswith("; ComputeDomain default/cd-a runs in NVLink domain rack-b"), why


# --------------------------------------------------------------------------------------------------
# ComputeDomain objects, where served: numNodes


def compute_domain(name: str, template: str, num_nodes: Any = 0, ns: str = "default", uid: str = "") -> JSON:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": ns, **({"uid": uid} if uid else {})},
        "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": template}}},
    }


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        pytest.param({"metadata": {"name": "cd"}}, "metadata.namespace", id="no namespace"),
        pytest.param(compute_domain("cd", ""), "spec.channel.resourceClaimTemplate.name", id="no template"),
        pytest.param(
            {"metadata": {"name": "cd", "namespace": "n"}, "spec": {"channel": []}}, "spec.channel is", id="a list"
        ),
        pytest.param(compute_domain("cd", "t", -1), "spec.numNodes", id="numNodes below 0"),
        pytest.param(compute_domain("cd", "t", "4"), "spec.numNodes", id="numNodes a string"),
        pytest.param(compute_domain("cd", "t", True), "spec.numNodes", id="numNodes a boolean"),
        pytest.param(compute_domain("cd", "t", MAX_NUM_NODES + 1), "spec.numNodes", id="numNodes past the bound"),
    ],
)
def test_an_unreadable_compute_domain_is_refused_naming_the_field(obj: JSON, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        compute_domain_size(obj)


@given(JSONISH)
def test_any_compute_domain_object_is_read_or_refused_with_a_value_error(obj: Any) -> None:
    try:
        _, (_, template), n = compute_domain_size(obj)
    except ValueError:
        return
    assert isinstance(template, str) and template and 0 <= n <= MAX_NUM_NODES


def test_compute_domain_sizes_follow_their_objects() -> None:
    sizes = ComputeDomainSizes(lambda *a: None)
    sizes.replace([compute_domain("train", "train-channel", 16), {"metadata": {}}])  # the bad one is skipped
    assert sizes.num_nodes("default/train-channel") == 16 and sizes.num_nodes("default/other") == 0
    sizes.apply("ADDED", compute_domain("serve", "serve-channel", 2, ns="inference"))
    assert sizes.num_nodes("inference/serve-channel") == 2
    sizes.apply("ADDED", compute_domain("train-2", "train-channel", 8))  # the same template: the latest
    assert sizes.num_nodes("default/train-channel") == 8
    sizes.apply("DELETED", compute_domain("train-2", "train-channel", 8))
    assert sizes.num_nodes("default/train-channel") == 16  # the other one's is kept
    sizes.apply("DELETED", compute_domain("train", "train-channel", 16))
    assert sizes.num_nodes("default/train-channel") == 0


def test_the_first_pod_of_a_compute_domain_waits_for_a_domain_with_room_for_its_num_nodes(racks: Env) -> None:
    racks.source.put("computedomains", compute_domain("a", "cd-a", 2))
    plain = cd_pod("plain", 1, None, **{"gputopo.io/nvlink": "required"})
    racks.add_pods(plain)
    assert racks.bind(plain, "a1") == ""  # rack a has room on one tray for a whole-tray pod
    first = cd_pod("a-0", 4, "cd-a")
    racks.add_pods(first)
    assert racks.passed(first, NAMES) == ["b1", "b2"]
    racks.source.put("computedomains", compute_domain("a", "cd-a", 3))
    racks.resync()
    assert racks.reasons(first, NAMES) == {
        "fewer than 4 free GPUs",
        "NVLink domain has room for fewer nodes than ComputeDomain default/cd-a asks for",
    }
