"""Inputs read as Kubernetes reads them: integers in annotations and labels are ASCII digits only, within
bounds; JSON annotations take integers only as JSON numbers; a pod holds no more GPUs than it asks for,
whatever its `gputopo.io/placement` lists; a domain's cap comes from what all of its trays agree on (else
the chart's tier), and one tray's malformed cap label leaves out only that tray. The label is one the
agents' admission policy forbids them to write."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan
from gputopo.engine.gang.rack import LABEL_DOMAIN_CAP
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import AnnotationError, LabelError, Placement, parse_placement, parse_pod_request
from gputopo.model.joblabels import index
from gputopo.model.names import OPERATOR_LABEL_KEYS, PLACEMENT_ANNOTATION
from gputopo.model.topology import parse_topology
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS, TierConfig
from tests.engine.gang.test_rack import members, rack, tray
from tests.extender.harness import Env, gputopo_pod, node_obj, pod_obj

ROOT = Path(__file__).resolve().parents[2]

# What int() takes and Kubernetes' parsers do not, and what no parser should take.
NOT_ASCII_DIGITS = [
    pytest.param("٤", id="Arabic-Indic four"),
    pytest.param("４", id="full-width four"),
    pytest.param("²", id="superscript two"),
    pytest.param("1_0", id="underscore"),
    pytest.param("+4", id="plus sign"),
    pytest.param("-1", id="minus sign"),
    pytest.param(" 4 ", id="spaces"),
    pytest.param("4\n", id="trailing newline"),
    pytest.param("4.0", id="decimal"),
    pytest.param("0x4", id="hex"),
    pytest.param("", id="empty"),
    pytest.param("9" * 5000, id="5000 digits"),
]


@pytest.mark.parametrize("value", NOT_ASCII_DIGITS)
@pytest.mark.parametrize(
    ("key", "others"),
    [
        pytest.param("gputopo.io/group-size", {"gputopo.io/group": "g"}, id="group-size"),
        pytest.param("gputopo.io/stage", {"gputopo.io/group": "g", "gputopo.io/group-size": "8"}, id="stage"),
        pytest.param("gputopo.io/tp-size", {}, id="tp-size"),
    ],
)
def test_an_annotation_integer_that_is_not_ascii_digits_is_refused_naming_it(
    key: str, others: dict[str, str], value: str
) -> None:
    with pytest.raises(AnnotationError) as err:
        parse_pod_request({**others, key: value}, 4)
    assert err.value.key == key and "ASCII digits only" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "field", "want"),
    [
        pytest.param("gputopo.io/tp-size", "8", "tp_size", 8, id="tp-size 8"),
        pytest.param("gputopo.io/group-size", "4096", "group_size", 4096, id="group-size at its bound"),
        pytest.param("gputopo.io/group-size", "0004", "group_size", 4, id="leading zeros are still digits"),
    ],
)
def test_ascii_digits_within_bounds_are_read(key: str, value: str, field: str, want: int) -> None:
    ann = {"gputopo.io/group": "g", key: value} if "group" in key else {key: value}
    assert getattr(parse_pod_request(ann, 4), field) == want


@pytest.mark.parametrize("value", NOT_ASCII_DIGITS)
def test_a_controller_index_label_that_is_not_ascii_digits_is_refused(value: str) -> None:
    with pytest.raises(LabelError, match="must be a non-negative integer"):
        index("batch.kubernetes.io/job-completion-index", value)


@pytest.mark.parametrize(
    "gpu",
    [
        pytest.param("4", id="a string"),
        pytest.param("+4", id="a signed string"),
        pytest.param("1_0", id="an underscore string"),
        pytest.param(4.0, id="a float"),
        pytest.param(True, id="a boolean"),
    ],
)
def test_json_annotations_take_integers_only_as_json_integers(gpu: Any) -> None:
    text = json.dumps({"node": "n1", "gpus": [gpu], "score": 1, "reason": "x"})
    with pytest.raises(AnnotationError, match=PLACEMENT_ANNOTATION):
        parse_placement(text)
    topo = json.loads(build_system("dgx-h100", "n1").to_annotation())
    topo["gpus"][0]["index"] = gpu
    with pytest.raises(AnnotationError):
        parse_topology(json.dumps(topo))


# --------------------------------------------------------------------------------------------------
# a pod that asks no GPU holds none


def _placed(name: str, gpus: int, listed: range, node: str = "n1") -> dict[str, Any]:
    placement = Placement(node=node, gpus=tuple(listed), score=1, reason="forged")
    return pod_obj(
        name, gpus, {PLACEMENT_ANNOTATION: placement.to_annotation()}, node=node, phase="Running", namespace="t1"
    )


@pytest.mark.parametrize(
    ("gpus", "listed"),
    [
        pytest.param(0, range(8), id="a GPU-less pod listing all 8"),
        pytest.param(1, range(8), id="a 1-GPU pod listing all 8"),
    ],
)
def test_a_pod_holds_no_gpus_by_a_placement_listing_more_than_it_asks(env: Env, gpus: int, listed: range) -> None:
    env.add_nodes(node_obj("n1"))
    env.add_pods(*(_placed(f"squat-{i}", gpus, listed) for i in range(50)))  # a flood of them, one tenant
    other = gputopo_pod("honest", 7 if gpus else 8)  # what another tenant may still have there
    assert env.passed(other, ["n1"]) == ["n1"]
    assert len(env.ledger.node_for("n1").in_use) <= (1 if gpus else 0)


def test_a_pod_whose_placement_lists_what_it_asks_holds_those_gpus(env: Env) -> None:
    """The control: the same annotation on a pod that asks 8 GPUs holds them."""
    env.add_nodes(node_obj("n1"))
    env.add_pods(_placed("p", 8, range(8)))
    assert env.passed(gputopo_pod("honest", 1), ["n1"]) == []


# --------------------------------------------------------------------------------------------------
# per-domain caps: what all of a domain's trays agree on, else the chart's tier; one bad label, one tray


def _domains(plan: GroupPlan | GroupFailure) -> Counter[str]:
    assert isinstance(plan, GroupPlan), plan
    return Counter(a.node.location["nvlink-domain"] or "" for a in plan.assignments)


def _relabel(nodes: list[NodeState], i: int, value: str | None, tiers: TierConfig = DEFAULT_TIERS) -> None:
    labels = {k: v for k, v in nodes[i].labels.items() if k != LABEL_DOMAIN_CAP}
    if value is not None:
        labels[LABEL_DOMAIN_CAP] = value
    nodes[i] = node_state(nodes[i].name, nodes[i].topology, labels=labels, tiers=tiers)


def _tiers(group_cap: int | None) -> TierConfig:
    return TierConfig(
        tiers=tuple(
            t if t.name != "nvlink-domain" else t.model_copy(update={"group_cap": group_cap})
            for t in DEFAULT_TIERS.tiers
        )
    )


@pytest.mark.parametrize(
    ("one_tray", "group_cap", "want"),
    [
        pytest.param("8", None, {"a": 8, "b": 8}, id="all agree on 8: the cap holds"),
        pytest.param("1", None, {"a": 16}, id="one tray says 1: no agreement, no cap (no tier cap), never 1"),
        pytest.param("1", 8, {"a": 8, "b": 8}, id="one tray says 1: the tier's groupCap, not 1"),
        pytest.param(None, None, {"a": 16}, id="one tray unlabelled: no agreement, the tier's (none)"),
        pytest.param("x", None, {"a": 8, "b": 8}, id="one tray malformed: that tray out, the others' 8 holds"),
        pytest.param("٤", None, {"a": 8, "b": 8}, id="one tray non-ASCII digit: that tray out"),
    ],
)
def test_one_trays_cap_label_never_sets_its_neighbours_cap(
    one_tray: str | None, group_cap: int | None, want: dict[str, int]
) -> None:
    tiers = _tiers(group_cap)
    nodes = [node_state(n.name, n.topology, labels=n.labels, tiers=tiers) for n in rack("a", cap=8) + rack("b", cap=8)]
    _relabel(nodes, 0, one_tray, tiers)
    plan = plan_group("g", members(16, 16), nodes, tiers)
    assert _domains(plan) == Counter(want)
    if one_tray in ("x", "٤"):
        assert isinstance(plan, GroupPlan) and nodes[0].name not in {a.node.name for a in plan.assignments}


def test_a_malformed_cap_on_every_tray_is_named_once_with_a_count() -> None:
    plan = plan_group("g", members(4, 16), rack("a", 4, cap=0))
    assert isinstance(plan, GroupFailure)
    assert f"label {LABEL_DOMAIN_CAP}='0' is not a whole number" in plan.message
    assert "(and 3 more tray(s) left out for their cap label)" in plan.message
    assert plan.message.count(LABEL_DOMAIN_CAP) <= 2


def test_a_malformed_cap_in_one_domain_leaves_the_other_domain_whole() -> None:
    nodes = rack("a", cap=16) + [tray(f"b-tray-{i:02d}", "b", cap=0) for i in range(1, 19)]
    assert _domains(plan_group("g", members(16, 16), nodes)) == Counter({"a": 16})


# --------------------------------------------------------------------------------------------------
# the agents' admission policy forbids them the operator's labels


def _agent_policy() -> dict[str, Any]:
    for doc in yaml.safe_load_all((ROOT / "manifests" / "gputopo.yaml").read_text()):
        if doc and doc.get("kind") == "ValidatingAdmissionPolicy" and doc["metadata"]["name"].endswith("-agent"):
            return dict(doc)
    raise AssertionError("no agent ValidatingAdmissionPolicy in manifests/gputopo.yaml")


def test_the_agent_policy_forbids_every_operator_label_and_the_cap_among_them() -> None:
    variables = {v["name"]: v["expression"] for v in _agent_policy()["spec"]["variables"]}
    listed = set(yaml.safe_load(variables["operatorLabels"]))
    assert listed == set(OPERATOR_LABEL_KEYS) and LABEL_DOMAIN_CAP in listed
    checks = [v["expression"] for v in _agent_policy()["spec"]["validations"]]
    assert any("variables.operatorLabels.all(" in c for c in checks)
