"""Clique blocks as the readers of allocations take them (gputopo/model/dra.py parse_slice and parse_claim,
the extender's DRA merge, the agent's driver): a block is its GPUs. Forged names (non-canonical, GPUs not
on the node, the largest hex mask a name can hold, overlapping blocks in one claim, a block and one of its
GPUs), a slice with a huge counter set; a clique of GPUs with unequal HBM under the webhook's per-GPU
minimum. Bounds: a GPU counts once; a name that is not canonical is refused naming the object; what one
object costs is bounded by the name's length (<= 63 characters: <= 224 GPUs); a block's `memory` admits
it under a per-GPU minimum only when every GPU of it has that much; nothing crashes."""

from __future__ import annotations

import re
import tracemalloc
from typing import Any

import pytest

from gputopo.engine.dra.blocks import block_devices
from gputopo.engine.dra.claims import BLOCK_SUBREQUEST, ClaimShape, device_claim
from gputopo.model import GpusInUse, NodeTopology, NvlinkPolicy
from gputopo.model.dra import DRIVER, MAX_ALLOCATION_RESULTS, DraObjectError, block_name, parse_claim, parse_slice
from tests.engine.dra.blocks_fixtures import nvswitch
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


# --------------------------------------------------------------------------------------------------
# a block's HBM against the webhook's per-GPU minimum


def _with_memory(memory: list[int]) -> NodeTopology:
    topo = nvswitch(len(memory))
    gpus = tuple(g.model_copy(update={"memory_mib": m}) for g, m in zip(topo.gpus, memory, strict=True))
    return topo.model_copy(update={"gpus": gpus})


def _block_threshold_mib(size: int, min_mib: int) -> int:
    """The HBM the webhook's `block` subrequest asks of a block's `memory` capacity, in MiB."""
    claim = device_claim(ClaimShape(size, NvlinkPolicy.REQUIRED, min_mib, False, blocks=True))
    [block] = [s for s in claim["requests"][0]["firstAvailable"] if s["name"] == BLOCK_SUBREQUEST]
    [selector] = block["selectors"]
    amount, unit = re.fullmatch(r'.*quantity\("(\d+)(Mi|Gi)"\).*', selector["cel"]["expression"]).groups()  # type: ignore[union-attr]
    return int(amount) * (1024 if unit == "Gi" else 1)


@pytest.mark.parametrize(
    ("memory", "min_mib"),
    [
        pytest.param([81920, 81920, 40960, 122880], 81920, id="one-small-gpu-made-up-by-a-large-one"),
        pytest.param([81559, 81920, 81920, 81920], 81920, id="one-gpu-a-little-short"),
        pytest.param([40960, 163840], 81920, id="a-pair-of-half-and-double"),
        pytest.param([81920] * 4, 81920, id="equal-gpus-at-the-minimum"),
        pytest.param([81920] * 8, 40960, id="equal-gpus-over-the-minimum"),
    ],
)
def test_a_blocks_memory_meets_a_per_gpu_minimum_only_when_each_gpu_does(memory: list[int], min_mib: int) -> None:
    """The webhook asks a block for N times the pod's per-GPU minimum on its `memory`: a GPU under the
    minimum, made up for by a larger one beside it, must not let the allocator hand the pod that block."""
    topo = _with_memory(memory)
    for device in block_devices(topo):
        size = len(device.gpus)
        admitted = device.memory_mib >= _block_threshold_mib(size, min_mib)
        assert admitted == all(memory[g] >= min_mib for g in device.gpus), device.name


# --------------------------------------------------------------------------------------------------
# a slice whose pool is named for another node


def _pool_slice(node: str, pool: str, name: str) -> JSON:
    body = {"driver": DRIVER, "nodeName": node, "pool": {"name": pool, "generation": 9, "resourceSliceCount": 1}}
    return {"metadata": {"name": name}, "spec": {**body, "devices": [{"name": f"gpu-{i}"} for i in range(8)]}}


@pytest.mark.parametrize(
    ("forged_node", "forged_pool"),
    [
        pytest.param("b", NODE, id="node-b-publishes-node-a's-pool"),
        pytest.param(NODE, "b", id="node-a's-name-on-node-b's-pool"),
    ],
)
def test_a_slice_naming_another_nodes_pool_moves_no_claim(env: Env, forged_node: str, forged_pool: str) -> None:
    """A compromised node's token (where the chart's admission policy is off) publishes a slice whose pool
    is named for another node: the claims of that pool must stay on the node the pool is named for, so a
    tenant's allocated GPUs are never shown free to another tenant's pod, nor another node's shown taken."""
    env.add_nodes(node_obj(NODE, "dgx-1v"), node_obj("b", "dgx-1v"))
    for node in (NODE, "b"):
        env.source.put("resourceslices", _pool_slice(node, node, f"{node}-{DRIVER}"))
    claim = _claim([f"gpu-{i}" for i in range(8)])
    env.source.put("resourceclaims", claim)
    env.resync()
    assert env.ledger.nodes[NODE].report == GpusInUse(other=frozenset(range(8)))
    env.source.put("resourceslices", _pool_slice(forged_node, forged_pool, "zz-forged"))
    env.resync()
    assert env.ledger.nodes[NODE].report == GpusInUse(other=frozenset(range(8)))
    assert env.ledger.nodes["b"].report == GpusInUse()
    assert env.passed(pod_obj("q", 1, {"gputopo.io/nvlink": "ignore"}), [NODE, "b"]) == ["b"]
