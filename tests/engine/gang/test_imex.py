"""ComputeDomains in placement (gputopo.engine.gang.imex): a ComputeDomain's pods in one NVLink domain, never on a
node serving another ComputeDomain's IMEX channel; pods of none steered off the trays a ComputeDomain needs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.gang.imex import (
    FIRST,
    LAST,
    domains_of,
    group_candidates,
    nvlink_domain,
    pinned_domain,
    with_compute_domains,
    with_driver_labels,
)
from gputopo.engine.node.placement import Outcome, evaluate_node
from gputopo.engine.state.reasons import Code, Reason, code_for
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import PodRequest
from gputopo.systems import build_system, gb200_tray

CLIQUE = "nvidia.com/gpu.clique"


def tray(name: str, rack: str, in_use: Sequence[int] = ()) -> NodeState:
    return node_state(name, gb200_tray(name), labels={CLIQUE: rack}, in_use=frozenset(in_use))


# Two racks of three trays each (b9, full, is no candidate), and an 8-GPU node in no multi-node domain.
NODES = [tray("a1", "rack-a"), tray("a2", "rack-a"), tray("a3", "rack-a", [0, 1])]
NODES += [tray("b1", "rack-b"), tray("b2", "rack-b"), node_state("x1", build_system("dgx-h100", "x1"))]
WHERE = {n.name: nvlink_domain(n) for n in NODES} | {"b9": "rack-b"}


def run(
    req: PodRequest, serving: dict[str, frozenset[str]], nodes: Sequence[NodeState] = NODES, needs: int = 0
) -> list[Outcome]:
    outcomes = [evaluate_node(n, req) for n in nodes]
    served = {n: WHERE.get(n) for n in serving}
    return with_compute_domains(req, nodes, outcomes, serving, served, needs) or outcomes


def cd_pod(cd: str, gpus: int = 4) -> PodRequest:
    return PodRequest(gpus=gpus, compute_domain=cd)


@pytest.mark.parametrize(
    ("serving", "passing"),
    [
        pytest.param({}, ["a1", "a2", "b1", "b2", "x1"], id="none placed: any domain (a3 is half used)"),
        pytest.param({"a3": frozenset({"ns/cd"})}, ["a1", "a2"], id="placed in rack-a: only rack-a"),
        pytest.param({"b9": frozenset({"ns/cd"})}, ["b1", "b2"], id="placed on a full tray of rack-b: rack-b"),
        pytest.param(
            {"a1": frozenset({"ns/other"})}, ["a2", "b1", "b2", "x1"], id="another CD's channel: not that tray"
        ),
        pytest.param(
            {"a1": frozenset({"ns/cd"}), "b1": frozenset({"ns/other"})}, ["a1", "a2"], id="own domain, own tray ok"
        ),
    ],
)
def test_a_compute_domain_pod_goes_only_to_its_domain_and_never_to_another_cds_channel(
    serving: dict[str, frozenset[str]], passing: list[str]
) -> None:
    got = run(cd_pod("ns/cd"), serving)
    assert [n.name for n, o in zip(NODES, got, strict=True) if o.fits] == passing
    for o in got:
        if not o.fits and o.reason is Reason.COMPUTE_DOMAIN:
            assert o.code is Code.UNRESOLVABLE and "ns/cd" in o.message


@pytest.mark.parametrize(
    ("serving", "node", "message", "detail"),
    [
        pytest.param(
            {"a1": frozenset({"ns/cd"})},
            "b1",
            "outside NVLink domain rack-a of ComputeDomain ns/cd",
            "ComputeDomain ns/cd runs in NVLink domain rack-a; node b1 is in NVLink domain rack-b",
            id="other domain",
        ),
        pytest.param(
            {"a1": frozenset({"ns/cd"})},
            "x1",
            "outside NVLink domain rack-a of ComputeDomain ns/cd",
            "ComputeDomain ns/cd runs in NVLink domain rack-a; node x1 is in no NVLink domain",
            id="no domain",
        ),
        pytest.param(
            {"b2": frozenset({"ns/other"})},
            "b2",
            "IMEX channel serves another ComputeDomain than ns/cd",
            "node b2 serves the IMEX channel of ComputeDomain ns/other; one channel per node, and the pod's "
            "ComputeDomain is ns/cd",
            id="another CD",
        ),
    ],
)
def test_a_refusal_names_the_compute_domain_and_the_nodes(
    serving: dict[str, frozenset[str]], node: str, message: str, detail: str
) -> None:
    got = dict(zip((n.name for n in NODES), run(cd_pod("ns/cd"), serving), strict=True))[node]
    assert (got.reason, got.message, got.detail) == (Reason.COMPUTE_DOMAIN, message, detail)
    assert code_for(Reason.COMPUTE_DOMAIN) is Code.UNRESOLVABLE


def test_a_node_that_does_not_fit_keeps_its_own_reason() -> None:
    got = run(cd_pod("ns/cd"), {"b1": frozenset({"ns/cd"})})
    assert got[2].reason is not Reason.COMPUTE_DOMAIN  # a3: 2 GPUs in use, the pod wants 4


@pytest.mark.parametrize(
    ("gpus", "serving", "offsets"),
    [
        pytest.param(1, {"a3": frozenset({"ns/cd"})}, [LAST, LAST, FIRST, 0.0, 0.0, 0.0], id="sub-tray"),
        pytest.param(2, {"a3": frozenset({"ns/cd"})}, [LAST, LAST, FIRST, 0.0, 0.0, 0.0], id="half a tray"),
        pytest.param(4, {"a3": frozenset({"ns/cd"})}, [0.0] * 6, id="a whole tray strands nothing"),
        pytest.param(1, {"b9": frozenset({"ns/cd"})}, [0.0, 0.0, 0.0, LAST, LAST, 0.0], id="full tray of rack-b"),
    ],
)
def test_a_pod_of_no_compute_domain_is_steered_off_the_trays_one_needs(
    gpus: int, serving: dict[str, frozenset[str]], offsets: list[float]
) -> None:
    req = PodRequest(gpus=gpus)
    plain = [evaluate_node(n, req) for n in NODES]
    got = run(req, serving)
    assert [g.score - p.score if p.fits else 0.0 for g, p in zip(got, plain, strict=True)] == pytest.approx(offsets)
    assert [g.fits for g in got] == [p.fits for p in plain]  # steering never refuses


def test_nothing_changes_without_compute_domains() -> None:
    req = PodRequest(gpus=1)
    assert with_compute_domains(req, NODES, [evaluate_node(n, req) for n in NODES], {}, {}) is None


@pytest.mark.parametrize(
    ("serving", "expected"),
    [
        pytest.param({}, None, id="none placed"),
        pytest.param({"a1": frozenset({"ns/cd"})}, "rack-a", id="one domain"),
        pytest.param(
            {"a1": frozenset({"ns/cd"}), "b1": frozenset({"ns/cd"}), "b2": frozenset({"ns/cd"})},
            "rack-b",
            id="already split: the domain with most",
        ),
        pytest.param({"a1": frozenset({"ns/cd"}), "b1": frozenset({"ns/cd"})}, "rack-a", id="a tie: by name"),
        pytest.param({"x1": frozenset({"ns/cd"})}, None, id="on a node of no domain"),
        pytest.param({"a1": frozenset({"ns/other"})}, None, id="another CD's"),
    ],
)
def test_the_pinned_domain_is_where_the_compute_domain_runs(
    serving: dict[str, frozenset[str]], expected: str | None
) -> None:
    assert pinned_domain("ns/cd", serving, WHERE) == expected


@given(
    st.dictionaries(
        st.sampled_from(sorted(WHERE)),
        st.frozensets(st.sampled_from(["ns/cd", "ns/other", "x/y"]), min_size=1, max_size=2),
    )
)
def test_every_passing_node_of_a_compute_domain_pod_joins_its_domain_and_no_other_channel(
    serving: dict[str, frozenset[str]],
) -> None:
    served = {n: WHERE[n] for n in serving}
    pinned = pinned_domain("ns/cd", serving, served)
    held = domains_of("ns/cd", serving, served)
    assert (pinned is None) == (not held)
    for node, o in zip(NODES, run(cd_pod("ns/cd", 1), serving), strict=True):
        if o.fits:
            assert not serving.get(node.name, frozenset()) - {"ns/cd"}
            assert pinned is None or nvlink_domain(node) == pinned


# --------------------------------------------------------------------------------------------------
# NVIDIA's driver label, and a gang's candidates


@pytest.mark.parametrize(
    ("serving", "labelled", "expected"),
    [
        pytest.param({}, {"a1": "u-a"}, {"a1": {"ns/cd-a"}}, id="a known UID names its ComputeDomain"),
        pytest.param({}, {"a1": "u-x"}, {"a1": {"UID u-x"}}, id="an unknown UID is named by itself"),
        pytest.param(
            {"a1": frozenset({"ns/cd-a"})}, {"a1": "u-a"}, {"a1": {"ns/cd-a"}}, id="the label and the pods agree"
        ),
        pytest.param(
            {"b1": frozenset({"ns/cd-b"})},
            {"a1": "u-a"},
            {"a1": {"ns/cd-a"}, "b1": {"ns/cd-b"}},
            id="pods and labels on different nodes",
        ),
    ],
)
def test_the_driver_label_adds_the_compute_domain_a_node_serves(
    serving: dict[str, frozenset[str]], labelled: dict[str, str], expected: dict[str, set[str]]
) -> None:
    got = with_driver_labels(serving, labelled, {"u-a": "ns/cd-a"}.get)
    assert got == {n: frozenset(v) for n, v in expected.items()}


@given(
    st.dictionaries(st.sampled_from(sorted(WHERE)), st.frozensets(st.sampled_from(["cd-a", "cd-b"]), min_size=1)),
    st.dictionaries(st.sampled_from(sorted(WHERE)), st.sampled_from(["u-a", "u-b", "u-z"])),
)
def test_the_driver_label_only_adds(serving: dict[str, frozenset[str]], labelled: dict[str, str]) -> None:
    got = with_driver_labels(serving, labelled, {"u-a": "cd-a", "u-b": "cd-b"}.get)
    assert set(got) == set(serving) | set(labelled)
    assert all(serving.get(n, frozenset()) <= got[n] for n in got)
    assert all(len(got[n] - serving.get(n, frozenset())) <= 1 for n in got)


@pytest.mark.parametrize(
    ("serving", "kept", "said"),
    [
        pytest.param({}, ["a1", "a2", "a3", "b1", "b2", "x1"], "", id="nothing served: every node"),
        pytest.param(
            {"a3": frozenset({"cd-b"}), "b1": frozenset({"UID u-z"})},
            ["a1", "a2", "b2", "x1"],
            "2 node(s) serve another ComputeDomain's IMEX channel (the first a3)",
            id="nodes serving others are left out",
        ),
        pytest.param(
            {"b9": frozenset({"cd-a"})},
            ["b1", "b2"],
            "ComputeDomain cd-a runs in NVLink domain rack-b",
            id="its placed pods pin the domain",
        ),
        pytest.param(
            {"b9": frozenset({"cd-a"}), "b1": frozenset({"cd-b"})},
            ["b2"],
            "1 node(s) serve another ComputeDomain's IMEX channel (the first b1); "
            "ComputeDomain cd-a runs in NVLink domain rack-b",
            id="both",
        ),
        pytest.param(
            {"a3": frozenset({"cd-a"})},
            ["a1", "a2", "a3"],
            "ComputeDomain cd-a runs in NVLink domain rack-a",
            id="its own node stays, in its domain",
        ),
    ],
)
def test_a_compute_domain_gang_is_planned_on_free_channels_in_its_domain(
    serving: dict[str, frozenset[str]], kept: list[str], said: str
) -> None:
    served = {n: WHERE.get(n) for n in serving}
    got, why = group_candidates("cd-a", NODES, serving, served)
    assert [s.name for s in got] == kept
    assert why == said


# --------------------------------------------------------------------------------------------------
# numNodes: the first pod's domain has room for them all


@pytest.mark.parametrize(
    ("needs", "serving", "passed"),
    [
        pytest.param(0, {}, ["a1", "a2", "b1", "b2", "x1"], id="numNodes 0: not said"),
        pytest.param(1, {}, ["a1", "a2", "b1", "b2", "x1"], id="one node: any"),
        pytest.param(2, {}, ["a1", "a2", "b1", "b2"], id="two: a domain of two, not a node in none"),
        pytest.param(2, {"a2": frozenset({"cd-b"})}, ["b1", "b2"], id="another's channel takes a2: rack-b"),
        pytest.param(3, {}, [], id="three: no domain has room"),
        pytest.param(3, {"b9": frozenset({"cd-a"})}, ["b1", "b2"], id="placed pods pin it: no room asked"),
    ],
)
def test_the_first_pod_of_a_compute_domain_goes_to_a_domain_with_room_for_its_num_nodes(
    needs: int, serving: dict[str, frozenset[str]], passed: list[str]
) -> None:
    got = run(cd_pod("cd-a"), serving, needs=needs)
    assert [n.name for n, o in zip(NODES, got, strict=True) if o.fits] == passed


def test_a_domain_without_room_is_named_with_its_room() -> None:
    got = dict(zip([n.name for n in NODES], run(cd_pod("cd-a"), {}, needs=3), strict=True))
    assert got["a1"].message == "NVLink domain has room for fewer nodes than ComputeDomain cd-a asks for"
    assert got["a1"].code is Code.UNRESOLVABLE
    assert (
        got["a1"].detail
        == "ComputeDomain cd-a asks for 3 nodes (numNodes) in one NVLink domain; NVLink domain rack-a has room on 2"
    )
    assert got["x1"].detail.endswith("node x1 is in no NVLink domain")
    assert got["a3"].reason is not Reason.COMPUTE_DOMAIN  # it does not fit the pod anyway: its own reason
