"""Native PodGroups (scheduling.k8s.io/v1beta1) as gputopo groups: membership through
spec.schedulingGroup.podGroupName, size from gang.minCount, the topology key as a required tier;
annotations override; bad fields are named, never guessed at."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.model import AnnotationError, ControllerFacts, parse_pod_request
from gputopo.model import jobs as J
from gputopo.tiers import DEFAULT_TIERS

TIERS = [(t.name, t.labels) for t in DEFAULT_TIERS.tiers]
TIER_NAMES = DEFAULT_TIERS.names


def facts(*shapes: J.PodGroupShape) -> ControllerFacts:
    return ControllerFacts(podgroups={s.name: s for s in shapes})


@pytest.mark.parametrize(
    ("keys", "tier"),
    [
        ((), None),
        (("gputopo.io/network-leaf",), "leaf"),
        (("network.topology.nvidia.com/spine",), "spine"),
        (("topology.k8s.aws/network-node-layer-3",), "leaf"),
        (("nvidia.com/gpu.clique",), "nvlink-domain"),
        (("gputopo.io/network-leaf", "network.topology.nvidia.com/leaf"), "leaf"),
    ],
)
def test_a_topology_key_maps_to_the_tier_whose_labels_hold_it(keys: tuple[str, ...], tier: str | None) -> None:
    shape = J.podgroup_shape("train", 4, keys, TIERS)
    assert (shape.required_tier, shape.problem) == (tier, "")


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            ("kubernetes.io/hostname",),
            'invalid PodGroup train: spec.schedulingConstraints.topology[0].key="kubernetes.io/hostname": '
            "no gputopo tier reads this label (spine: gputopo.io/network-spine",
        ),
        (
            ("gputopo.io/network-leaf", "gputopo.io/network-spine"),
            "invalid PodGroup train: spec.schedulingConstraints.topology="
            '"gputopo.io/network-leaf,gputopo.io/network-spine": keys of more than one tier',
        ),
    ],
)
def test_a_topology_key_no_tier_reads_is_the_podgroups_problem(keys: tuple[str, ...], message: str) -> None:
    shape = J.podgroup_shape("train", 4, keys, TIERS)
    assert shape.required_tier is None and shape.problem.startswith(message)


def test_a_member_of_a_gang_podgroup_is_a_group_of_min_count_with_its_tier() -> None:
    got = J.infer_group(
        {}, {}, facts(J.podgroup_shape("train", 4, ("gputopo.io/network-leaf",), TIERS)), pod_group="train"
    )
    assert got is not None
    assert (got.group, got.size, got.rank, got.required_tier, got.controller) == (
        "podgroup/train",
        4,
        None,
        "leaf",
        "PodGroup",
    )
    req = parse_pod_request({}, 8, TIER_NAMES, got)
    assert (req.group, req.group_size, req.stage, req.required_tier) == ("podgroup/train", 4, None, "leaf")


def test_members_wait_until_the_podgroup_is_known() -> None:
    got = J.infer_group({}, {}, ControllerFacts(), pod_group="train")
    assert got is not None and got.size is None and got.waiting == "the PodGroup train is not known yet"


def test_a_basic_podgroup_is_no_gang_and_other_labels_still_count() -> None:
    basic = facts(J.PodGroupShape("web", None))
    assert J.infer_group({}, {}, basic, pod_group="web") is None
    lws = {J.LWS_NAME: "vllm", J.LWS_GROUP_INDEX: "0", J.LWS_WORKER_INDEX: "1"}
    got = J.infer_group(lws, {J.LWS_SIZE: "2"}, basic, pod_group="web")
    assert got is not None and got.group == "lws/vllm/0"


def test_the_podgroup_comes_before_controller_labels() -> None:
    # A Job the Job controller gave a PodGroup (KEP-5547): kube-scheduler gangs by the PodGroup.
    labels = {J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: "1"}
    got = J.infer_group(labels, {}, facts(J.PodGroupShape("train-pg", 2)), pod_group="train-pg")
    assert got is not None and (got.group, got.size) == ("podgroup/train-pg", 2)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({"gputopo.io/group": "mine", "gputopo.io/group-size": "3"}, ("mine", 3, None, "leaf")),
        ({"gputopo.io/group-size": "2"}, ("podgroup/train", 2, None, "leaf")),
        ({"gputopo.io/stage": "1"}, ("podgroup/train", 4, 1, "leaf")),
        ({"gputopo.io/required-tier": "spine"}, ("podgroup/train", 4, None, "spine")),
    ],
)
def test_annotations_override_what_the_podgroup_gives(
    annotations: dict[str, str], expected: tuple[str, int, int | None, str]
) -> None:
    shape = J.podgroup_shape("train", 4, ("gputopo.io/network-leaf",), TIERS)
    got = J.infer_group({}, annotations, facts(shape), pod_group="train")
    req = parse_pod_request(annotations, 8, TIER_NAMES, got)
    assert (req.group, req.group_size, req.stage, req.required_tier) == expected


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (
            "Train",
            None,
            'invalid PodGroup Train: spec.schedulingGroup.podGroupName="Train": must be a DNS-1123 subdomain',
        ),
        (
            "big",
            J.PodGroupShape("big", 5000),
            'invalid PodGroup big: spec.schedulingPolicy.gang.minCount="5000": must be between 1 and 4096 for gputopo',
        ),
        (
            "host",
            J.podgroup_shape("host", 2, ("kubernetes.io/hostname",), TIERS),
            'invalid PodGroup host: spec.schedulingConstraints.topology[0].key="kubernetes.io/hostname"',
        ),
    ],
)
def test_bad_podgroup_fields_are_named(name: str, shape: J.PodGroupShape | None, message: str) -> None:
    with pytest.raises(AnnotationError) as e:
        J.infer_group({}, {}, facts(shape) if shape else ControllerFacts(), pod_group=name)
    assert str(e.value).startswith(message)


def test_group_identity_names_the_podgroup_even_when_it_is_bad() -> None:
    assert J.group_identity({}, "train") == "podgroup/train"
    assert J.group_identity({}, "Bad Name") is None


@given(
    name=st.text(max_size=300),
    min_count=st.one_of(st.none(), st.integers(-5, 10_000)),
    keys=st.lists(st.sampled_from([*DEFAULT_TIERS.tiers[0].labels, "kubernetes.io/hostname", ""]), max_size=3),
)
def test_podgroup_inference_fails_only_with_a_named_error(name: str, min_count: int | None, keys: list[str]) -> None:
    shape = J.podgroup_shape(name, min_count, keys, TIERS)
    try:
        got = J.infer_group({}, {}, facts(shape), pod_group=name)
    except AnnotationError as e:
        assert str(e).startswith("invalid PodGroup ")
        return
    if got is None:
        assert min_count is None or not name
    else:
        assert got.group == f"podgroup/{name}" and got.size is not None and 1 <= got.size <= J.MAX_GROUP_SIZE
