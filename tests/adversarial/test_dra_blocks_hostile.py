"""Clique blocks as the readers of allocations take them (gputopo/model/dra.py parse_slice and parse_claim,
the extender's DRA merge, the agent's driver): a block is its GPUs. Forged names (non-canonical, GPUs not
on the node, the largest hex mask a name can hold, overlapping blocks in one claim, a block and one of its
GPUs), a slice with a huge counter set. Bounds: a GPU counts once; a name that is not canonical is refused
naming the object; what one object costs is bounded by the name's length (<= 63 characters: <= 224 GPUs);
nothing crashes."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from gputopo.model import GpusInUse
from gputopo.model.dra import DRIVER, MAX_ALLOCATION_RESULTS, DraObjectError, block_name, parse_claim, parse_slice
from tests.extender.harness import JSON, Env, node_obj, pod_obj

NODE = "a"  # a DGX-1V


def _claim(devices: list[str], uid: str = "c1") -> JSON:
    results = [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
    return {
        "metadata": {"uid": uid, "namespace": "t", "name": uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def _slice(devices: list[dict[str, Any]], name: str = f"{NODE}-{DRIVER}", **spec: Any) -> JSON:
    body = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 2}}
    return {"metadata": {"name": name}, "spec": {**body, "devices": devices, **spec}}


@pytest.mark.parametrize(
    ("devices", "gpus"),
    [
        pytest.param(["block-0-1-2-3", "gpu-2"], {0, 1, 2, 3}, id="a-block-and-one-of-its-gpus-count-once"),
        pytest.param(["block-0-1", "block-1-2"], {0, 1, 2}, id="overlapping-blocks-in-one-claim-count-once"),
        pytest.param([block_name(range(0, 224, 2))], set(range(0, 224, 2)), id="hex-name-112-gpus"),
    ],
)
def test_a_claims_block_is_its_gpus_each_once(devices: list[str], gpus: set[int]) -> None:
    assert parse_claim(_claim(devices)).gpus == frozenset(gpus)


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("block-1-0", id="not-ascending"),
        pytest.param("block-0-0", id="one-gpu-twice"),
        pytest.param("block-0", id="one-gpu"),
        pytest.param("block-00-1", id="leading-zero"),
        pytest.param("block-x3", id="hex-for-a-name-that-fits-in-decimal"),
        pytest.param("block-0-4096", id="index-past-4095"),
        pytest.param("block-" + "-".join(map(str, range(30))), id="past-63-characters"),
        pytest.param("block-0-١", id="arabic-indic-digit"),
        pytest.param("Block-0-1", id="upper-case"),
    ],
)
def test_a_forged_block_name_is_refused_naming_the_object(device: str) -> None:
    with pytest.raises(DraObjectError, match="t/c1"):
        parse_claim(_claim([device]))
    with pytest.raises(DraObjectError, match=f"{NODE}-{DRIVER}"):
        parse_slice(_slice([{"name": device}]))


def test_a_counters_only_slice_is_read_and_a_huge_counter_set_is_not_walked() -> None:
    counters = {f"gpu-{i}": {"value": "1"} for i in range(100_000)}
    tracemalloc.start()
    got = parse_slice(_slice([], sharedCounters=[{"name": "gpus", "counters": counters}] * 1000))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got is not None and got.gpus == frozenset() and got.node == NODE
    assert peak < 1 << 20  # the counters are never copied or walked


def test_a_slice_of_128_largest_blocks_stays_bounded() -> None:
    name = block_name(range(224))
    tracemalloc.start()
    got = parse_slice(_slice([{"name": name}] * 128))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got is not None and got.gpus == frozenset(range(224))
    assert peak < 4 << 20


def test_a_claim_of_32_largest_blocks_stays_bounded() -> None:
    got = parse_claim(_claim([block_name(range(224))] * MAX_ALLOCATION_RESULTS))
    assert got.gpus == frozenset(range(224))


def test_the_merge_counts_a_block_as_its_gpus_and_a_forged_one_holds_only_gpus(env: Env) -> None:
    """A block's GPUs are in use, each once; a forged block over GPUs the node lacks holds its GPUs as a
    forged single GPU would (a claim's GPUs stay in use, test_dra_claims.py), and the filter still runs."""
    env.add_nodes(node_obj(NODE, "dgx-1v"))
    env.source.put("resourceslices", _slice([{"name": f"gpu-{i}"} for i in range(8)] + [{"name": "block-4-5-6-7"}]))
    env.source.put(
        "resourceslices",
        _slice([], name=f"{NODE}-{DRIVER}-counters", sharedCounters=[{"name": "gpus", "counters": {}}]),
    )
    env.source.put("resourceclaims", _claim(["block-4-5-6-7", "gpu-5"]))
    env.resync()
    assert env.ledger.nodes[NODE].report == GpusInUse(other=frozenset({4, 5, 6, 7}))
    assert NODE in env.passed(pod_obj("p", 4, {"gputopo.io/nvlink": "required"}), [NODE])
    env.source.put("resourceclaims", _claim(["block-0-1-2-3-4-5-6-7-8-9"], uid="c2"))
    env.resync()
    assert env.ledger.nodes[NODE].report == GpusInUse(other=frozenset(range(10)))
    assert NODE not in env.passed(pod_obj("q", 1, {"gputopo.io/nvlink": "ignore"}), [NODE])
