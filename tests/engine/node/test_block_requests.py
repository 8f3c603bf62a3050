"""A pod asking one whole block (`gputopo.io/gpu-clique<N>: 1`): which blocks a node publishes, and that
the engine's choice is the block the allocator's first fit gives, or a reason when that block is not
one the pod may have."""

from __future__ import annotations

import json

import pytest

from gputopo.engine.cluster.explain import describe_gpus
from gputopo.engine.node.blocks import first_fit_block, published_blocks
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.cliques import bits, mask_of, maximal_cliques
from gputopo.engine.state.reasons import Code, Reason
from gputopo.engine.state.snapshot import NodeState, Shape, node_state
from gputopo.model import parse_pod_request, parse_topology
from gputopo.model.request import PodRequest
from gputopo.systems import build_system


def node(system: str, in_use: tuple[int, ...] = (), failed: tuple[int, ...] = ()) -> NodeState:
    topo = build_system(system, "n")
    if failed:
        doc = json.loads(topo.to_annotation())
        for g in doc["gpus"]:
            if g["index"] in failed:
                g["health"] = "failed"
        topo = parse_topology(json.dumps(doc))
    return node_state("n", topo, in_use=frozenset(in_use))


def block(size: int, **ann: str) -> PodRequest:
    return parse_pod_request({f"gputopo.io/{k}": v for k, v in ann.items()}, size, block=size)


def sets(masks: tuple[int, ...]) -> list[list[int]]:
    return [bits(m) for m in masks]


@pytest.mark.parametrize(
    ("system", "size", "blocks"),
    [
        pytest.param("dgx-h100", 8, [list(range(8))], id="NVSwitch node of 8: the whole node"),
        pytest.param("dgx-h100", 4, [[0, 1, 2, 3], [4, 5, 6, 7]], id="NVSwitch node: two aligned quads"),
        pytest.param("dgx-h100", 2, [[0, 1], [2, 3], [4, 5], [6, 7]], id="NVSwitch node: four aligned pairs"),
        pytest.param("dgx-1v", 4, [[0, 1, 2, 3], [4, 5, 6, 7]], id="DGX-1V: its two quads"),
        pytest.param("dgx-1v", 8, [], id="DGX-1V: no clique of 8"),
        pytest.param("a100-pcie-bridged", 2, [[0, 1], [2, 3], [4, 5], [6, 7]], id="bridged pairs"),
        pytest.param("a100-pcie-bridged", 4, [], id="bridged pairs: no quad"),
        pytest.param("dgx-h100", 3, [], id="3 is no block size"),
    ],
)
def test_published_blocks_are_aligned_sub_blocks_of_maximal_cliques(
    system: str, size: int, blocks: list[list[int]]
) -> None:
    n = node(system)
    assert n.shape is not None
    found = sets(published_blocks(n.shape, n.all_mask, size))
    assert all(b in found for b in blocks) and (blocks or not found)
    if system != "dgx-1v" or size != 4:
        assert found == blocks


def test_dgx1v_maximal_cliques_include_its_quads() -> None:
    n = node("dgx-1v")
    assert n.shape is not None
    cliques = sets(tuple(maximal_cliques(n.shape.adj, n.all_mask)))
    assert [0, 1, 2, 3] in cliques and [4, 5, 6, 7] in cliques


@pytest.mark.parametrize(
    ("system", "in_use", "size", "gpus"),
    [
        pytest.param("dgx-h100", (), 4, (0, 1, 2, 3), id="all free: the lowest quad"),
        pytest.param("dgx-h100", (1,), 4, (4, 5, 6, 7), id="a GPU of the first quad busy: the other"),
        pytest.param("dgx-h100", (0,), 2, (2, 3), id="a pair inside the broken quad, the whole quad kept"),
        # Behind NVSwitch any free GPUs are one clique, so the engine's rank ties and the lowest pair wins.
        pytest.param("dgx-h100", (4, 5), 2, (0, 1), id="NVSwitch: ranks tie, the lowest free pair"),
        pytest.param("dgx-1v", (4,), 2, (6, 7), id="DGX-1V: the aligned pair inside the broken quad"),
        pytest.param("dgx-1v", (5,), 4, (0, 1, 2, 3), id="DGX-1V: the free quad"),
    ],
)
def test_block_pod_gets_the_allocators_first_free_block(
    system: str, in_use: tuple[int, ...], size: int, gpus: tuple[int, ...]
) -> None:
    n = node(system, in_use)
    assert n.shape is not None
    out = evaluate_node(n, block(size))
    assert out.code is Code.SUCCESS, out.detail
    usable = n.all_mask & ~n.failed_mask
    assert out.gpus == gpus == tuple(bits(first_fit_block(n.shape, usable, usable & ~n.in_use_mask, size) or 0))
    assert out.block == "block-" + "-".join(map(str, gpus))
    assert f"are {out.block}, the first free {size}-GPU block" in describe_gpus("n", out)


@pytest.mark.parametrize(
    ("system", "in_use", "size", "reason", "detail"),
    [
        pytest.param(
            "dgx-h100", (0, 4), 4, Reason.NO_FREE_CLIQUE, "every 4-GPU block holds a GPU in use", id="both quads broken"
        ),
        pytest.param("dgx-1v", (), 8, Reason.NO_NVLINK_DOMAIN, "largest NVLink-connected set", id="no clique of 8"),
        pytest.param("a100-pcie-bridged", (), 4, Reason.NO_NVLINK_DOMAIN, "", id="bridged pairs hold no quad"),
    ],
)
def test_block_pod_fails_where_no_published_block_is_free(
    system: str, in_use: tuple[int, ...], size: int, reason: Reason, detail: str
) -> None:
    out = evaluate_node(node(system, in_use), block(size))
    assert out.reason is reason
    assert detail in out.detail


def test_loose_clique_fits_where_no_block_does_so_blocks_are_stricter() -> None:
    """GPUs 1 and 5 busy on an NVSwitch node: 0,2,3,4 is a free clique of 4, but no aligned quad is free."""
    n = node("dgx-h100", (1, 5))
    assert evaluate_node(n, parse_pod_request({}, 4)).fits
    assert evaluate_node(n, block(4)).reason is Reason.NO_FREE_CLIQUE


def test_a_failed_gpu_takes_its_blocks_with_it() -> None:
    """GPU 0 failed: the clique is 1-7, and its aligned quad by position is 1-4."""
    n = node("dgx-h100", failed=(0,))
    assert not evaluate_node(n, block(8)).fits
    assert evaluate_node(n, block(4)).gpus == (1, 2, 3, 4)


def test_block_and_any_nvlink_but_required_is_refused_naming_the_annotation() -> None:
    with pytest.raises(ValueError, match=r"gputopo.io/nvlink.*4-GPU block"):
        block(4, nvlink="preferred")
    assert block(4, nvlink="required").block


@pytest.mark.parametrize(("n", "published"), [(32, True), (33, False)])
def test_a_node_of_more_than_32_gpus_publishes_no_blocks(n: int, published: bool) -> None:
    """One counter set holds 32 counters."""
    everyone = mask_of(list(range(n)))
    adj = tuple(everyone & ~(1 << i) for i in range(n))
    shape = Shape(n, (), adj, True, 0, 0.0, ())
    assert bool(published_blocks(shape, everyone, 16)) is published
