"""The DRA allocator emulation: which devices kube-scheduler's allocator gives a claim on one node, per
clique encoding, and the simulator that places job mixes through it."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.dra.devices import ATTR_CLIQUES, DRIVER, Device, device_name, devices, qualified
from gputopo.model import Health, NodeTopology, NvlinkPolicy, PodRequest
from gputopo.sim.dra import (
    Allocation,
    Claim,
    NodeDevices,
    Subrequest,
    allocate,
    claim_for,
    expressiveness,
    list_claim,
    partition_claim,
    simulate_dra,
    unconstrained_claim,
)
from gputopo.systems import build_system
from tests.sim.helpers import job, node

DGX1V = build_system("dgx-1v")


def _view(topo: NodeTopology, encoding: str) -> NodeDevices:
    return NodeDevices(devices(topo, list_attributes=encoding == "list"))


def _claim(encoding: str, n: int, *, fallback: bool = False, mib: int = 0) -> Claim:
    if encoding == "list":
        return list_claim(n, mib, fallback=fallback)
    if encoding == "partitions":
        return partition_claim(n, mib, fallback=fallback)
    return unconstrained_claim(n, mib)


def _names(gpus: Sequence[int]) -> list[str]:
    return [device_name(g) for g in gpus]


def _connected(topo: NodeTopology, gpus: Sequence[int]) -> bool:
    return all(topo.link_count(a, b) > 0 for a, b in combinations(gpus, 2))


# --------------------------------------------------------------------------------------------------
# One claim on one node


ALLOCATOR_CASES = [
    # (system, allocated GPUs, encoding, GPUs asked, fallback, expected GPUs or None, expected subrequest)
    pytest.param("dgx-1v", (0, 5), "list", 4, False, None, None, id="dgx-1v 0,5 taken: TP-4 finds no quad (list)"),
    pytest.param(
        "dgx-1v", (0, 5), "partitions", 4, False, None, None, id="dgx-1v 0,5 taken: TP-4 finds no quad (partitions)"
    ),
    pytest.param(
        "dgx-1v", (0, 5), "none", 4, False, (1, 2, 3, 4), "gpus", id="dgx-1v 0,5 taken: unconstrained takes 1-4"
    ),
    pytest.param("dgx-1v", (0, 5), "list", 2, False, (1, 2), "gpus", id="dgx-1v 0,5 taken: TP-2 gets a pair (list)"),
    pytest.param(
        "dgx-1v", (1, 2, 3, 4), "none", 2, False, (0, 5), "gpus", id="dgx-1v 1-4 taken: unconstrained pairs 0,5 (PCIe)"
    ),
    pytest.param(
        "dgx-1v", (1, 2, 3, 4), "list", 2, False, (5, 6), "gpus", id="dgx-1v 1-4 taken: TP-2 skips 0 for 5,6 (list)"
    ),
    pytest.param(
        "dgx-1v", (1, 2, 3, 4), "partitions", 2, False, (5, 6), "p0", id="dgx-1v 1-4 taken: TP-2 gets 5,6 (partitions)"
    ),
    pytest.param(
        "dgx-1v",
        (1, 2, 3, 5, 6, 7),
        "list",
        2,
        False,
        (0, 4),
        "gpus",
        id="overlap: only the cross-quad pair 0,4 is free (list)",
    ),
    pytest.param(
        "dgx-1v",
        (1, 2, 3, 5, 6, 7),
        "partitions",
        2,
        False,
        (0, 4),
        "p1",
        id="overlap: only the cross-quad pair 0,4 is free (partition 1)",
    ),
    pytest.param(
        "dgx-1v", (1, 2, 3, 6, 7), "list", 2, False, (0, 4), "gpus", id="overlap: 0,4,5 free, the list takes 0,4"
    ),
    pytest.param(
        "dgx-1v",
        (1, 2, 3, 6, 7),
        "partitions",
        2,
        False,
        (4, 5),
        "p0",
        id="overlap: 0,4,5 free, partition 0 (quads) comes first: 4,5",
    ),
    pytest.param(
        "dgx-1v", (1, 2, 3, 4, 6, 7), "list", 2, False, None, None, id="0,5 free: no NVLink pair, required refuses"
    ),
    pytest.param(
        "dgx-1v",
        (1, 2, 3, 4, 6, 7),
        "list",
        2,
        True,
        (0, 5),
        "any",
        id="0,5 free: preferred falls back to any (list)",
    ),
    pytest.param(
        "dgx-1v",
        (1, 2, 3, 4, 6, 7),
        "partitions",
        2,
        True,
        (0, 5),
        "any",
        id="0,5 free: preferred falls back to any (partitions)",
    ),
    pytest.param("hgx-h200", (), "list", 8, False, tuple(range(8)), "gpus", id="NVSwitch: all eight share one clique"),
    pytest.param("hgx-h200", (), "partitions", 8, False, tuple(range(8)), "p0", id="NVSwitch: one partition"),
    pytest.param(
        "a100-pcie-bridged", (0,), "none", 2, False, (1, 2), "gpus", id="bridged pairs: unconstrained splits a bridge"
    ),
    pytest.param("a100-pcie-bridged", (0,), "list", 2, False, (2, 3), "gpus", id="bridged pairs: TP-2 gets bridge 2,3"),
    pytest.param(
        "a100-pcie-bridged", (0,), "partitions", 2, False, (2, 3), "p0", id="bridged pairs: TP-2 gets 2,3 (partitions)"
    ),
    pytest.param("l40s-4", (), "list", 2, False, None, None, id="PCIe only: no clique to ask for"),
    pytest.param("l40s-4", (), "none", 2, False, (0, 1), "gpus", id="PCIe only: unconstrained first fit"),
]


@pytest.mark.parametrize(("system", "taken", "encoding", "n", "fallback", "expected", "subrequest"), ALLOCATOR_CASES)
def test_allocator_first_fit_under_each_encoding(
    system: str,
    taken: tuple[int, ...],
    encoding: str,
    n: int,
    fallback: bool,
    expected: tuple[int, ...] | None,
    subrequest: str | None,
) -> None:
    got = allocate(_view(build_system(system), encoding), _claim(encoding, n, fallback=fallback), _names(taken))
    if expected is None:
        assert got is None
    else:
        assert got == Allocation(subrequest or "", tuple(_names(expected)), expected)


@pytest.mark.parametrize("encoding", ["list", "partitions"])
@pytest.mark.parametrize("taken", [(0, 5), (1, 2, 3, 4), (0, 1, 6), (2, 4), ()])
def test_tp2_never_gets_a_pair_without_nvlink(encoding: str, taken: tuple[int, ...]) -> None:
    got = allocate(_view(DGX1V, encoding), _claim(encoding, 2), _names(taken))
    assert got is not None
    assert _connected(DGX1V, got.gpus)
    assert not set(got.gpus) & set(taken)


def test_failed_gpu_is_never_chosen() -> None:
    gpus = tuple(g.model_copy(update={"health": Health.FAILED}) if g.index == 0 else g for g in DGX1V.gpus)
    topo = DGX1V.model_copy(update={"gpus": gpus})
    got = allocate(_view(topo, "list"), unconstrained_claim(4))
    assert got is not None and got.gpus == (1, 2, 3, 4)
    assert allocate(_view(topo, "list"), list_claim(4)) is not None  # 4-7 is still a quad
    assert allocate(_view(topo, "list"), list_claim(4), _names((5,))) is None


def test_memory_selector_keeps_out_small_gpus() -> None:
    mib = DGX1V.gpus[0].memory_mib
    assert allocate(_view(DGX1V, "list"), list_claim(2, mib)) is not None
    assert allocate(_view(DGX1V, "list"), list_claim(2, mib + 1)) is None


def _device(name: str, **attrs: bool | int | str | tuple[str, ...]) -> Device:
    return Device(name, int(name.rsplit("-", 1)[1]), attrs, 1024, False)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([1, 1], ("gpu-0", "gpu-1"), id="equal ints match"),
        pytest.param([1, True], None, id="an int never matches a bool"),
        pytest.param(["1", 1], None, id="a string never matches an int"),
        pytest.param([("a", "b"), ("b", "c")], ("gpu-0", "gpu-1"), id="lists that intersect match"),
        pytest.param([("a", "b"), ("c",)], None, id="disjoint lists do not"),
        pytest.param([("a", "b"), "b"], ("gpu-0", "gpu-1"), id="a scalar is a one-element list"),
    ],
)
def test_match_attribute_compares_typed_sets(
    values: list[bool | int | str | tuple[str, ...]], expected: tuple[str, ...] | None
) -> None:
    devs = [_device(f"gpu-{i}", key=v) for i, v in enumerate(values)]
    got = allocate(devs, Claim((Subrequest("gpus", 2, 0, qualified("key")),)))
    assert (got.devices if got else None) == expected


def test_match_attribute_needs_the_attribute_on_every_device() -> None:
    devs = [_device("gpu-0", key="a"), _device("gpu-1"), _device("gpu-2", key="a")]
    got = allocate(devs, Claim((Subrequest("gpus", 2, 0, qualified("key")),)))
    assert got is not None and got.devices == ("gpu-0", "gpu-2")


def test_match_attribute_reads_the_bare_name_only_in_the_drivers_domain() -> None:
    devs = [_device("gpu-0", key="a"), _device("gpu-1", key="a")]
    assert allocate(devs, Claim((Subrequest("gpus", 2, 0, f"{DRIVER}/key"),))) is not None
    assert allocate(devs, Claim((Subrequest("gpus", 2, 0, "other.example.com/key"),))) is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Subrequest("", 1), "name must not be empty"),
        (lambda: Subrequest("gpus", 0), "count 0 must be between 1 and 32"),
        (lambda: Subrequest("gpus", 33), "count 33"),
        (lambda: Subrequest("gpus", 1, -1), "min_memory_mib -1"),
        (lambda: Subrequest("gpus", 2, 0, "nvlinkCliques"), "'nvlinkCliques' must be fully qualified"),
        (lambda: Claim(()), "claim has 0 subrequests"),
        (lambda: Claim(tuple(Subrequest(f"s{i}", 1) for i in range(9))), "claim has 9 subrequests"),
        (lambda: Claim((Subrequest("a", 1), Subrequest("a", 2))), "names repeat: a, a"),
        (lambda: allocate(_view(DGX1V, "list"), list_claim(2), ["gpu-9"]), "no such device on the node: gpu-9"),
        (lambda: claim_for(PodRequest(gpus=2), "cliques"), "unknown encoding 'cliques'"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_is_refused_by_name(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build()  # type: ignore[operator]


CLAIM_CASES = [
    pytest.param(PodRequest(gpus=4), "list", True, list_claim(4), id="required, list: one constrained request"),
    pytest.param(PodRequest(gpus=4), "partitions", True, partition_claim(4), id="required, partitions: p0..p3"),
    pytest.param(
        PodRequest(gpus=2, nvlink=NvlinkPolicy.PREFERRED),
        "partitions",
        True,
        partition_claim(2, fallback=True),
        id="preferred: then any",
    ),
    pytest.param(
        PodRequest(gpus=4, min_gpu_memory_mib=80000),
        "list",
        True,
        list_claim(4, 81559),  # rounded up to the memory class of the H100 (81559 MiB), the next GPU
        id="min HBM becomes the selector",
    ),
    pytest.param(
        PodRequest(gpus=4, nvlink=NvlinkPolicy.IGNORE, min_gpu_memory_mib=100),
        "list",
        True,
        unconstrained_claim(4, 24564),  # rounded up to the smallest memory class (the RTX 4090's)
        id="ignore: no constraint, selector kept",
    ),
    pytest.param(PodRequest(gpus=1), "partitions", True, unconstrained_claim(1), id="one GPU: no constraint"),
    pytest.param(
        PodRequest(gpus=4, min_gpu_memory_mib=80000),
        "none",
        True,
        unconstrained_claim(4),
        id="KEP-5004: the count alone",
    ),
    pytest.param(PodRequest(gpus=4), "list", False, unconstrained_claim(4), id="a plain pod keeps KEP-5004's claim"),
]


@pytest.mark.parametrize(("request_", "encoding", "opted_in", "expected"), CLAIM_CASES)
def test_claim_for_a_pod(request_: PodRequest, encoding: str, opted_in: bool, expected: Claim) -> None:
    assert claim_for(request_, encoding, opted_in=opted_in) == expected  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Properties over random topologies


def _upstream_one(view: NodeDevices, sub: Subrequest, taken: set[int], chosen: list[int]) -> bool:
    """One slot of upstream's search: every device in slice order, the constraint over the set so far."""
    if len(chosen) == sub.count:
        return True
    values = view.values(sub.match_attribute) if sub.match_attribute else None
    for i, d in enumerate(view.devices):
        if i in taken or i in chosen or d.failed or d.memory_mib < sub.min_memory_mib:
            continue
        if values is not None:
            vs = [values[j] for j in [*chosen, i]]
            if any(v is None for v in vs) or not frozenset.intersection(*(v for v in vs if v is not None)):
                continue
        chosen.append(i)
        if _upstream_one(view, sub, taken, chosen):
            return True
        chosen.pop()
    return False


def _upstream(view: NodeDevices, claim: Claim, taken: set[int]) -> Allocation | None:
    """The allocator as upstream walks it: every device for every slot, in slice order, backtracking
    (orderings included), subrequests in order; the first full solution wins."""
    for sub in claim.subrequests:
        chosen: list[int] = []
        if _upstream_one(view, sub, taken, chosen):
            devs = tuple(view.devices[i].name for i in chosen)
            return Allocation(sub.name, devs, tuple(sorted(view.devices[i].index for i in chosen)))
    return None


@st.composite
def _nodes(draw: st.DrawFn) -> tuple[NodeTopology, set[int], int]:
    n = draw(st.integers(2, 8))
    base = build_system("rtx4090-8")
    # Links as a union of a few overlapping cliques (as on DGX-1V), plus a few stray pairs.
    groups = draw(st.lists(st.sets(st.integers(0, n - 1), min_size=2), max_size=4))
    edges = {p for g in groups for p in combinations(sorted(g), 2)}
    edges |= draw(st.sets(st.sampled_from(list(combinations(range(n), 2))), max_size=3))
    links = [[0] * n for _ in range(n)]
    for a, b in edges:
        links[a][b] = links[b][a] = draw(st.integers(1, 12))
    failed = draw(st.sets(st.integers(0, n - 1), max_size=2))
    gpus = tuple(g.model_copy(update={"health": Health.FAILED}) if g.index in failed else g for g in base.gpus[:n])
    nvlink = base.nvlink.model_copy(update={"links": tuple(tuple(r) for r in links), "generation": 3})
    topo = base.model_copy(update={"gpus": gpus, "nvlink": nvlink, "nics": ()})
    taken = draw(st.sets(st.integers(0, n - 1), max_size=n // 2))
    k = draw(st.integers(1, max(1, n - len(taken))))
    return topo, taken, k


@settings(max_examples=300, deadline=None)
@given(_nodes(), st.sampled_from(["list", "partitions"]))
def test_clique_claims_get_connected_free_gpus_and_match_upstreams_search(
    case: tuple[NodeTopology, set[int], int], encoding: str
) -> None:
    topo, taken, k = case
    view = _view(topo, encoding)
    claim = _claim(encoding, k)
    got = allocate(view, claim, _names(sorted(taken)))
    assert got == _upstream(view, claim, taken)
    if got is not None:
        assert len(got.gpus) == k
        assert _connected(topo, got.gpus)
        assert not set(got.gpus) & taken
        assert all(topo.gpus[g].health is not Health.FAILED for g in got.gpus)


@settings(max_examples=300, deadline=None)
@given(_nodes())
def test_the_list_finds_a_clique_whenever_one_is_free(case: tuple[NodeTopology, set[int], int]) -> None:
    topo, taken, k = case
    free = [g.index for g in topo.gpus if g.health is not Health.FAILED and g.index not in taken]
    exists = any(_connected(topo, s) for s in combinations(free, k))
    assert (allocate(_view(topo, "list"), list_claim(k), _names(sorted(taken))) is not None) == exists


# --------------------------------------------------------------------------------------------------
# What each encoding expresses


def test_dgx1v_partitions_express_every_clique() -> None:
    e = expressiveness(DGX1V)
    assert e.clique_ids() == ["0-3", "4-7", "0,4", "1,5", "2,6", "3,7"]
    assert (e.partitions_needed, e.left_out) == (2, ())
    by_k = {s.k: (s.all, s.connected, s.by_partitions, s.by_list) for s in e.ksets}
    assert by_k == {2: (28, 16, 16, 16), 4: (70, 2, 2, 2), 8: (1, 0, 0, 0)}


def test_partitions_lose_cliques_beyond_four() -> None:
    # Every pair linked but i and i+4: sixteen overlapping quads, eight partitions to hold them.
    h = build_system("dgx-h100")
    links = tuple(tuple(0 if i == j or abs(i - j) == 4 else 18 for j in range(8)) for i in range(8))
    e = expressiveness(h.model_copy(update={"nvlink": h.nvlink.model_copy(update={"links": links})}))
    assert (len(e.cliques), e.partitions_needed, len(e.left_out)) == (16, 8, 8)
    quads = next(s for s in e.ksets if s.k == 4)
    assert (quads.connected, quads.by_list) == (16, 16)
    assert quads.by_partitions == 8


def test_list_attribute_published_only_with_list_attributes() -> None:
    assert qualified(ATTR_CLIQUES) not in {
        qualified(a) for d in devices(DGX1V, list_attributes=False) for a in d.attributes
    }
    assert allocate(_view(DGX1V, "partitions"), list_claim(2)) is None  # the attribute is missing


# --------------------------------------------------------------------------------------------------
# The simulator over DRA


def test_engine_picks_the_node_the_allocator_can_serve() -> None:
    nodes = [node("a", "dgx-1v", in_use=(0, 5)), node("b", "dgx-1v", in_use=(0, 1, 2))]
    for encoding in ("list", "partitions"):
        r = simulate_dra(nodes, [job("tp4", 4)], encoding)
        assert [(p.node, p.gpus) for p in r.placements] == [("b", (4, 5, 6, 7))]


def test_first_node_by_name_under_no_constraint_splits_the_quads() -> None:
    nodes = [node("a", "dgx-1v", in_use=(0, 5)), node("b", "dgx-1v", in_use=(0, 1, 2))]
    r = simulate_dra(nodes, [job("tp4", 4)], "none", "first")
    assert [(p.node, p.gpus) for p in r.placements] == [("a", (1, 2, 3, 4))]
    assert r.summary.on_full_clique == 0
    assert r.summary.broken == {"nvlink": 1}


def test_first_node_by_name_skips_nodes_the_clique_claim_cannot_use() -> None:
    nodes = [node("a", "dgx-1v", in_use=(0, 5)), node("b", "dgx-1v", in_use=(0, 1, 2))]
    r = simulate_dra(nodes, [job("tp4", 4)], "list", "first")
    assert [(p.node, p.gpus) for p in r.placements] == [("b", (4, 5, 6, 7))]


def test_a_required_pod_with_no_free_clique_stays_pending() -> None:
    r = simulate_dra([node("a", "dgx-1v", in_use=(0, 5))], [job("tp4", 4)], "partitions", "first")
    assert r.placements == ()
    assert r.unplaced[0].reasons == "0/1 nodes are available: 1 cannot allocate all claims."


@pytest.mark.parametrize("choice", ["gputopo", "first"])
def test_clique_encodings_put_every_multi_gpu_pod_on_a_clique(choice: str) -> None:
    nodes = [node(f"n{i}", s) for i, s in enumerate(["dgx-1v", "dgx-1v", "a100-pcie-bridged", "hgx-h200"])]
    jobs = [job(f"j{i}", g) for i, g in enumerate([2, 1, 4, 2, 1, 2, 4, 8, 2, 1, 2, 3])]
    for encoding in ("list", "partitions"):
        s = simulate_dra(nodes, jobs, encoding, choice).summary  # type: ignore[arg-type]
        assert s.on_full_clique == s.multi_gpu_placed > 0
        assert s.broken == {}


def test_groups_are_placed_whole_on_the_engines_plan() -> None:
    nodes = [node(f"n{i}", "dgx-h100", leaf="l1" if i < 2 else "l2") for i in range(4)]
    r = simulate_dra(nodes, [job("pp", 8, pods=3, network="infiniband"), job("pp2", 8, pods=2)], "list")
    assert r.summary.groups_placed == 1
    assert {u.job for u in r.unplaced} == {"pp2"}  # one node left: the gang holds nothing
    assert all(len(p.gpus) == 8 for p in r.placements)


def test_simulation_is_deterministic_and_refuses_unknown_choices() -> None:
    nodes = [node(f"n{i}", "dgx-1v", in_use=(i,)) for i in range(3)]
    jobs = [job("a", 2), job("b", 3, nvlink="preferred"), job("c", 1)]
    assert simulate_dra(nodes, jobs, "partitions").placements == simulate_dra(nodes, jobs, "partitions").placements
    with pytest.raises(ValueError, match="unknown node choice 'best'"):
        simulate_dra(nodes, jobs, "list", "best")  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["list", "partitions"])
def test_preferred_pod_takes_the_first_node_in_134_and_the_best_subrequest_from_135(encoding: str) -> None:
    # a: only 0 and 5 free (no NVLink between them); b: the pair 4,5 free.
    nodes = [node("a", "dgx-1v", in_use=(1, 2, 3, 4, 6, 7)), node("b", "dgx-1v", in_use=(0, 1, 2, 3, 6, 7))]
    jobs = [job("tp2", 2, nvlink="preferred")]
    first = simulate_dra(nodes, jobs, encoding, "first").placements  # type: ignore[arg-type]
    scored = simulate_dra(nodes, jobs, encoding, "scored").placements  # type: ignore[arg-type]
    assert [(p.node, p.gpus) for p in first] == [("a", (0, 5))]
    assert "subrequest any" in first[0].reason
    assert [(p.node, p.gpus) for p in scored] == [("b", (4, 5))]
