"""go-gpuallocator's besteffort policy: upstream's own test cases, its enumeration, and properties.

The cases come from go-gpuallocator `gpuallocator/besteffort_test.go` (fixtures from `common_test.go`).
Every case there is here except `TestBestEffortIterateGPUSets`, which checks upstream's combination
helper (`iterateGPUSets`): this port has no such helper, it uses `itertools.combinations`. Upstream's
partition enumeration (`TestBestEffortIterateGPUPartitions`) is checked on `upstream_partitions` below,
a literal port of it that serves as the oracle the optimised search must agree with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.node.besteffort import (
    PcieMatrix,
    ScoreMatrix,
    best_effort,
    best_effort_scores,
    pair_score,
    pair_scores,
    pcie_distance,
)
from gputopo.model import GpuInfo, LinkLayer, NicInfo, NodeTopology, NvlinkInfo, PcieDistance
from gputopo.systems import build_system

PIX, PXB, PHB, NODE, SYS = (PcieDistance.PIX, PcieDistance.PXB, PcieDistance.PHB, PcieDistance.NODE, PcieDistance.SYS)


def topology(links: Sequence[Sequence[int]], numa: Sequence[int | None] | None = None) -> NodeTopology:
    n = len(links)
    return NodeTopology(
        gpus=tuple(
            GpuInfo(index=i, uuid=f"GPU-{i}", model="test", memory_mib=1024, numa_node=numa[i] if numa else None)
            for i in range(n)
        ),
        nvlink=NvlinkInfo(generation=2, gbps_per_link=25.0, links=tuple(tuple(r) for r in links)),
    )


def nvlinks(n: int, pairs: dict[tuple[int, int], int]) -> list[list[int]]:
    m = [[0] * n for _ in range(n)]
    for (a, b), count in pairs.items():
        m[a][b] = m[b][a] = count
    return m


def socket_pcie(sockets: Sequence[int], pix: Sequence[tuple[int, int]]) -> list[list[PcieDistance | None]]:
    """DGX-1 PCIe: PIX for the GPU pairs behind one switch, PHB elsewhere on a socket, SYS across."""
    n = len(sockets)
    m: list[list[PcieDistance | None]] = [
        [None if a == b else (PHB if sockets[a] == sockets[b] else SYS) for b in range(n)] for a in range(n)
    ]
    for a, b in pix:
        m[a][b] = m[b][a] = PIX
    return m


# Upstream fixtures (common_test.go). DGX-1V's NVLink matrix is the one of gputopo's `dgx-1v`.
DGX1_SOCKETS = [0, 0, 0, 0, 1, 1, 1, 1]
DGX1V = build_system("dgx-1v")
DGX1V_PCIE = socket_pcie(DGX1_SOCKETS, [(0, 1), (2, 3), (4, 5), (6, 7)])
# Pascal: one NVLink on each edge of two fully linked quads, plus GPU i to GPU i+4.
DGX1P = topology(nvlinks(8, {(a, b): 1 for a, b in combinations(range(8), 2) if a // 4 == b // 4 or b == a + 4}))
DGX1P_PCIE = socket_pcie(DGX1_SOCKETS, [(0, 2), (1, 3), (4, 6), (5, 7)])
RTX8000 = topology(nvlinks(4, {(0, 3): 2, (1, 2): 2}))
# Upstream gives the two NVLink-bridged pairs no PCIe link at all (an unknown path scores 0).
RTX8000_PCIE: list[list[PcieDistance | None]] = [
    [None, NODE, SYS, None],
    [NODE, None, None, SYS],
    [SYS, None, None, NODE],
    [None, SYS, NODE, None],
]
FIXTURES: dict[str, tuple[NodeTopology, PcieMatrix]] = {
    "dgx1-volta": (DGX1V, DGX1V_PCIE),
    "dgx1-pascal": (DGX1P, DGX1P_PCIE),
    "4x-rtx8000": (RTX8000, RTX8000_PCIE),
}

ALL8 = [0, 1, 2, 3, 4, 5, 6, 7]


# TestBestEffortAllocate: (id, available, must_include, size, expected or None when upstream returns nothing)
POLICY_CASES = [
    ("single-nvlink-prefer-same-switch", [0, 2, 4, 5], [], 2, [4, 5]),
    ("single-nvlink-prefer-same-socket", [0, 4, 5, 6], [], 2, [5, 6]),
    ("prefer-dual-nvlink-same-socket", [0, 3, 1], [], 2, [0, 3]),
    ("prefer-dual-nvlink-cross-socket", [0, 1, 4], [], 2, [0, 4]),
    ("must-include-size-1", ALL8, [4], 1, [4]),
    ("must-include-size-2", ALL8, [4], 2, [4, 7]),
    ("must-include-size-4", ALL8, [4], 4, [4, 5, 6, 7]),
    ("must-include-unavailable-device", [1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], 4, None),
    ("must-include-full-set", ALL8, [0, 2, 4, 6], 4, [0, 2, 4, 6]),
    ("must-include-too-many-devices", ALL8, [1, 2, 3, 4, 5, 6], 4, None),
    ("must-include-more-than-available", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], 1, None),
]


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"), [c[1:] for c in POLICY_CASES], ids=[c[0] for c in POLICY_CASES]
)
def test_upstream_policy_cases_on_dgx1_volta(
    available: list[int], must: list[int], size: int, expected: list[int] | None
) -> None:
    if expected is None:
        with pytest.raises(ValueError):
            best_effort(DGX1V, available, must, size, pcie=DGX1V_PCIE)
    else:
        assert best_effort(DGX1V, available, must, size, pcie=DGX1V_PCIE) == tuple(expected)


# TestBestEffort<node>GPUAlloc<n>: one allocator handing out GPUs in turn (available = what is left,
# in index order); the last request of each finds nothing left (upstream: an empty result).
ALLOCATOR_CASES = [
    ("4x-rtx8000-one", "4x-rtx8000", [(1, [0]), (1, [1]), (1, [2]), (1, [3]), (1, None)]),
    ("4x-rtx8000-two", "4x-rtx8000", [(2, [0, 3]), (2, [1, 2]), (1, None)]),
    ("4x-rtx8000-four", "4x-rtx8000", [(4, [0, 1, 2, 3]), (1, None)]),
    ("dgx1-pascal-one", "dgx1-pascal", [*((1, [i]) for i in range(8)), (1, None)]),
    ("dgx1-pascal-two", "dgx1-pascal", [(2, [0, 2]), (2, [1, 3]), (2, [4, 6]), (2, [5, 7]), (1, None)]),
    ("dgx1-pascal-four", "dgx1-pascal", [(4, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (1, None)]),
    ("dgx1-pascal-eight", "dgx1-pascal", [(8, ALL8), (1, None)]),
    ("dgx1-volta-one", "dgx1-volta", [*((1, [i]) for i in range(8)), (1, None)]),
    ("dgx1-volta-two", "dgx1-volta", [(2, [0, 3]), (2, [1, 2]), (2, [4, 7]), (2, [5, 6]), (1, None)]),
    ("dgx1-volta-four", "dgx1-volta", [(4, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (1, None)]),
    ("dgx1-volta-eight", "dgx1-volta", [(8, ALL8), (1, None)]),
]


@pytest.mark.parametrize(("fixture", "steps"), [c[1:] for c in ALLOCATOR_CASES], ids=[c[0] for c in ALLOCATOR_CASES])
def test_upstream_allocator_sequences(fixture: str, steps: list[tuple[int, list[int] | None]]) -> None:
    topo, pcie = FIXTURES[fixture]
    remaining = list(range(len(topo.gpus)))
    for size, expected in steps:
        if expected is None:
            with pytest.raises(ValueError):
                best_effort(topo, remaining, [], size, pcie=pcie)
            continue
        got = best_effort(topo, remaining, [], size, pcie=pcie)
        assert got == tuple(expected)
        remaining = [g for g in remaining if g not in got]


# --------------------------------------------------------------------------------------------------
# The oracle: upstream's exhaustive walk over partitions, ported literally (padding as positions >= n).


def upstream_partitions(n: int, size: int) -> Iterator[list[tuple[int, ...]]]:
    """Partitions of positions 0..n-1 (plus padding n..) in upstream's order (iterateGPUPartitions)."""
    if size <= 0 or size > n:
        return
    if size == 1:
        for i in range(n):
            yield [(i,)]
        return
    pad = -n % size

    def walk(devices: list[int], acc: list[tuple[int, ...]]) -> Iterator[list[tuple[int, ...]]]:
        if len(devices) == size:
            yield [*acc, tuple(devices)]
            return
        for combo in combinations(devices[1:], size - 1):
            chosen = (devices[0], *combo)
            padding = sum(1 for d in chosen if d >= n)
            if padding not in (0, pad):
                continue
            yield from walk([d for d in devices if d not in chosen], [*acc, chosen])

    yield from walk(list(range(n + pad)), [])


def upstream_best_effort(
    scores: ScoreMatrix, available: Sequence[int], must: Sequence[int], size: int
) -> tuple[int, ...]:
    n = len(available)

    def set_score(s: tuple[int, ...]) -> int:
        return sum(scores[available[a]][available[b]] for a, b in combinations([p for p in s if p < n], 2))

    def holds_must(s: tuple[int, ...]) -> bool:
        return set(must) <= {available[p] for p in s if p < n}

    best: list[tuple[int, ...]] | None = None
    best_total = 0
    for partition in upstream_partitions(n, size):
        if not any(holds_must(s) and all(p < n for p in s) for s in partition):
            continue
        total = sum(set_score(s) for s in partition)
        if best is None or total > best_total:
            best, best_total = partition, total
    assert best is not None
    # Final pick: the first best set holding must_include, never the padded one (upstream PR #80).
    sets = [s for s in best if holds_must(s) and all(p < n for p in s)]
    pick = max(sets, key=set_score)  # max() keeps the first of equal scores, as upstream's strict >
    return tuple(sorted(available[p] for p in pick))


P = 99  # a padding slot in upstream's notation


# TestBestEffortIterateGPUPartitions over GPUs 0-3; padding is written P.
PARTITION_CASES = [
    ("iterate-0", 0, []),
    ("iterate-1", 1, [[[0]], [[1]], [[2]], [[3]]]),
    ("iterate-2", 2, [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]]]),
    (
        "iterate-3",
        3,
        [[[0, 1, 2], [3, P, P]], [[0, 1, 3], [2, P, P]], [[0, 2, 3], [1, P, P]], [[1, 2, 3], [0, P, P]]],
    ),
    ("iterate-4", 4, [[[0, 1, 2, 3]]]),
    ("iterate-too-many", 5, []),
]


@pytest.mark.parametrize(("size", "expected"), [c[1:] for c in PARTITION_CASES], ids=[c[0] for c in PARTITION_CASES])
def test_oracle_enumerates_partitions_as_upstream(size: int, expected: list[list[list[int]]]) -> None:
    def canonical(partition: Sequence[Sequence[int]]) -> frozenset[tuple[int, ...]]:
        return frozenset(tuple(sorted(P if p >= 4 else p for p in s)) for s in partition)

    got = [canonical(p) for p in upstream_partitions(4, size)]
    assert sorted(got, key=sorted) == sorted((canonical(p) for p in expected), key=sorted)


@st.composite
def requests(draw: st.DrawFn) -> tuple[ScoreMatrix, list[int], list[int], int]:
    """Small nodes with coarse pair scores (ties are common), a shuffled available list, a must set."""
    n = draw(st.integers(1, 8))
    m = [[0] * n for _ in range(n)]
    values = draw(st.sampled_from([[0], [20], [10, 20], [0, 10, 20, 30, 100, 120, 200]]))  # all tied .. varied
    for a, b in combinations(range(n), 2):
        m[a][b] = m[b][a] = draw(st.sampled_from(values))
    available = draw(st.permutations(range(n)).flatmap(lambda p: st.integers(1, n).map(lambda k: list(p[:k]))))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=min(3, len(available))))
    size = draw(st.integers(max(1, len(must)), len(available)))
    return tuple(tuple(r) for r in m), available, must, size


@settings(max_examples=400, deadline=None)
@given(requests())
def test_search_agrees_with_upstreams_exhaustive_walk_including_ties(
    request: tuple[ScoreMatrix, list[int], list[int], int],
) -> None:
    scores, available, must, size = request
    assert best_effort_scores(scores, available, must, size) == upstream_best_effort(scores, available, must, size)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["dgx-1v", "dgx-a100", "dgx-h100", "a100-pcie-bridged", "l40s-4", "gb200-tray"]),
    st.data(),
)
def test_result_is_size_distinct_available_gpus_holding_must_include(system: str, data: st.DataObject) -> None:
    topo = build_system(system)
    n = len(topo.gpus)
    available = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1))
    must = data.draw(st.lists(st.sampled_from(available), unique=True))
    size = data.draw(st.integers(len(must), len(available)))
    got = best_effort(topo, available, must, size)
    assert len(got) == len(set(got)) == size
    assert set(must) <= set(got) <= set(available)


# --------------------------------------------------------------------------------------------------
# Pair scores and where the PCIe path comes from.


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (0, 1, 150),  # NV1 + single switch
        (0, 2, 130),  # NV1 + host bridge
        (0, 3, 230),  # NV2 + host bridge
        (0, 4, 210),  # NV2 + cross CPU
        (0, 5, 10),  # cross CPU only
        (3, 3, 0),  # a GPU with itself
    ],
    ids=["nv1-pix", "nv1-phb", "nv2-phb", "nv2-sys", "sys-only", "self"],
)
def test_pair_score_is_100_per_nvlink_plus_the_pcie_path(a: int, b: int, expected: int) -> None:
    assert pair_score(DGX1V, a, b, DGX1V_PCIE) == expected


@pytest.mark.parametrize(
    ("distance", "points"),
    [(PIX, 50), (PXB, 40), (PHB, 30), (NODE, 20), (SYS, 10), (None, 0)],
    ids=["pix", "pxb", "phb", "node", "sys", "unknown"],
)
def test_pcie_path_scores_follow_upstreams_table(distance: PcieDistance | None, points: int) -> None:
    topo = topology(nvlinks(2, {}))
    assert pair_score(topo, 0, 1, [[None, distance], [distance, None]]) == points


def _nic(affinity: Sequence[PcieDistance]) -> NicInfo:
    return NicInfo(
        name="mlx5_x", link_layer=LinkLayer.INFINIBAND, state="ACTIVE", rate_gbps=100, gpu_affinity=tuple(affinity)
    )


@pytest.mark.parametrize(
    ("system", "a", "b", "expected"),
    [
        ("dgx-1v", 0, 1, PIX),  # both PIX to mlx5_1
        ("dgx-1v", 0, 2, NODE),  # same socket, no NIC closer than NODE to both
        ("dgx-1v", 0, 4, SYS),
        ("dgx-a100", 0, 1, PXB),  # both PXB to the pair's NICs
        ("dgx-a100", 0, 2, SYS),  # NPS4: different NUMA nodes
        ("dgx-h100", 0, 1, NODE),  # each NIC is PIX to one GPU only
        ("dgx-h100", 3, 4, SYS),
        ("a100-pcie-bridged", 0, 1, PXB),
        ("l40s-4", 0, 1, NODE),
    ],
    ids=[
        "dgx1v-pix",
        "dgx1v-node",
        "dgx1v-sys",
        "a100-pxb",
        "a100-sys",
        "h100-node",
        "h100-sys",
        "bridged-pxb",
        "l40s",
    ],
)
def test_pcie_distance_is_derived_from_nic_affinity_then_numa(
    system: str, a: int, b: int, expected: PcieDistance
) -> None:
    assert pcie_distance(build_system(system), a, b) == expected


def test_pcie_distance_is_unknown_without_numa_or_a_shared_nic() -> None:
    assert pcie_distance(topology(nvlinks(2, {(0, 1): 2}), numa=[None, 0]), 0, 1) is None


def test_a_dgx1v_document_with_its_captured_nic_paths_derives_upstreams_pcie_matrix() -> None:
    # The public DGX-1V capture: each NIC is PIX to its GPU pair and PHB to the socket's other pair.
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7)]
    nics = tuple(
        _nic([PIX if g in pair else (PHB if DGX1_SOCKETS[g] == DGX1_SOCKETS[pair[0]] else SYS) for g in range(8)])
        for pair in pairs
    )
    topo = DGX1V.model_copy(update={"nics": nics})
    assert pair_scores(topo) == pair_scores(DGX1V, DGX1V_PCIE)


# --------------------------------------------------------------------------------------------------
# Requests that cannot be met.


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        ([0, 1, 2], [], 4, "exceeds the 3 available"),
        ([0, 1, 2], [0, 1], 1, "smaller than must_include"),
        ([1, 2, 3], [0], 2, r"\[0\] are not available"),
        ([0, 1, 9], [], 2, "names GPU 9"),
        ([0, 1, 1], [], 2, "repeats a GPU"),
        ([0, 1], [], -1, "exceeds|smaller"),
    ],
    ids=["size-over-available", "size-under-must", "must-not-available", "unknown-gpu", "repeated-gpu", "negative"],
)
def test_impossible_requests_raise_with_the_reason(
    available: list[int], must: list[int], size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        best_effort(DGX1V, available, must, size)


def test_size_zero_takes_nothing() -> None:
    assert best_effort(DGX1V, ALL8, [], 0) == ()


def test_a_pcie_matrix_of_the_wrong_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="8x8"):
        best_effort(DGX1V, ALL8, [], 2, pcie=RTX8000_PCIE)
