"""The DRA driver with clique blocks (gputopo/agent/dra/pool.py, driver.py): the pool's counters slice
and device slices in the v1 shape, one write per reorder, the fallback to single GPUs when the API server
drops the counters, and a block prepared as all its GPUs, refused when not published or overlapping."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.dra.cdi import claim_spec_path
from gputopo.agent.dra.driver import ClaimRef
from gputopo.agent.dra.pool import PoolPublisher, desired_pool, part_name
from gputopo.agent.dra.slices import SliceShape, slice_name
from gputopo.engine.dra.devices import DRIVER
from gputopo.model.dra import COUNTER_SET
from tests.agent.dp_harness import NODE, topology
from tests.agent.dra_harness import FakeSlices, Running, claim_object, running_dra
from tests.engine.dra.test_clique_cap import mesh_minus_matching

SHAPE = SliceShape(list_attributes=False, device_taints=False, best_fit_order=True, blocks=True)
COUNTERS = part_name(NODE, DRIVER, "counters")


def _names(spec: dict[str, Any]) -> list[str]:
    return [d["name"] for d in spec.get("devices", [])]


def test_the_pool_is_a_counters_slice_and_devices_that_consume_their_gpus() -> None:
    topo = topology("dgx-h100")
    pool = desired_pool(NODE, topo, SHAPE)
    assert sorted(pool) == [slice_name(NODE), COUNTERS]
    (counters,) = pool[COUNTERS]["sharedCounters"]
    assert counters == {"name": COUNTER_SET, "counters": {f"gpu-{i}": {"value": "1"} for i in range(8)}}
    assert "devices" not in pool[COUNTERS] and pool[COUNTERS]["pool"]["resourceSliceCount"] == 2
    devices = {d["name"]: d for d in pool[slice_name(NODE)]["devices"]}
    assert _names(pool[slice_name(NODE)])[:8] == [f"gpu-{i}" for i in range(8)]
    assert devices["gpu-3"]["consumesCounters"] == [{"counterSet": "gpus", "counters": {"gpu-3": {"value": "1"}}}]
    quad = devices["block-4-5-6-7"]
    assert quad["consumesCounters"][0]["counters"] == {f"gpu-{i}": {"value": "1"} for i in (4, 5, 6, 7)}
    assert quad["attributes"]["blockSize"] == {"int": 4} and quad["attributes"]["gpus"] == {"string": "4-7"}
    assert devices["gpu-0"]["attributes"]["blockSize"] == {"int": 1}
    assert quad["capacity"]["memory"]["value"] == f"{4 * topo.gpus[0].memory_mib}Mi"


@pytest.mark.parametrize(
    ("topo", "slices"),
    [
        pytest.param(topology("l40s-4"), 1, id="no-clique-one-singles-slice"),
        pytest.param(mesh_minus_matching(32), 3, id="past-64-devices-two-device-slices"),
    ],
)
def test_the_pool_splits_at_64_devices_and_is_one_slice_without_blocks(topo: Any, slices: int) -> None:
    # Index order: ranking the singles of this adversarial wiring (2^16 cliques) is the order's own cost.
    pool = desired_pool(NODE, topo, SliceShape(list_attributes=False, device_taints=False, blocks=True))
    assert len(pool) == slices
    assert all(len(s.get("devices", [])) <= 64 for s in pool.values())
    if slices > 1:
        assert sorted(pool)[:2] == [slice_name(NODE), f"{slice_name(NODE)}-1"]  # the allocator's order
        assert {s["pool"]["resourceSliceCount"] for s in pool.values()} == {slices}


def _publisher(api: FakeSlices) -> PoolPublisher:
    return PoolPublisher(api, NODE, SHAPE, sleep=lambda _s: True)


def test_a_reorder_is_one_write_and_no_change_is_none() -> None:
    api = FakeSlices()
    pub = _publisher(api)
    topo = topology("dgx-h100")
    assert pub.publish(topo) is PublishResult.CHANGED
    assert api.writes == 2 and {s["spec"]["pool"]["generation"] for s in api.slices.values()} == {1}
    assert pub.publish(topo, in_use=frozenset({0})) is PublishResult.CHANGED
    assert api.writes == 3  # only the devices slice, same generation
    assert pub.publish(topo, in_use=frozenset({0})) is PublishResult.UNCHANGED and api.writes == 3
    blocks = [n for n in _names(api.slices[slice_name(NODE)]["spec"]) if n.startswith("block-") and n.count("-") == 2]
    assert blocks[-1] == "block-0-1"  # the pair over the busy GPU last


def test_dropped_counters_fall_back_to_singles_before_any_block_is_written() -> None:
    api = FakeSlices(strip_counters=True)
    pub = _publisher(api)
    topo = topology("dgx-h100")
    pub.publish(topo)
    assert pub.counters_dropped
    assert list(api.slices) == [slice_name(NODE)]
    spec = api.slices[slice_name(NODE)]["spec"]
    assert _names(spec) == [f"gpu-{i}" for i in range(8)] and spec["pool"]["resourceSliceCount"] == 1
    writes = api.writes
    for _ in range(3):
        assert pub.publish(topo) is PublishResult.UNCHANGED
    assert api.writes == writes


def _prepare(r: Running, uid: str, devices: list[str]) -> str:
    r.claims.add(claim_object(uid, devices))
    assert r.plugin.driver is not None
    (result,) = r.plugin.driver.prepare([ClaimRef(uid, "default", f"claim-{uid}")]).values()
    return result.error


def test_a_block_is_prepared_as_all_its_gpus_and_counts_as_them(tmp_path: Path) -> None:
    topo = topology("dgx-h100")
    with running_dra(tmp_path, topo, best_fit_order=True, blocks=True) as r:
        assert _prepare(r, "a", ["block-4-5-6-7"]) == ""
        assert r.plugin.driver is not None and r.plugin.driver.in_use() == frozenset({4, 5, 6, 7})
        spec = json.loads(claim_spec_path(tmp_path / "cdi", "a").read_text())
        assert topo.gpus[6].uuid in json.dumps(spec)
        (device,) = r.plugin.driver.prepared()["a"].devices
        assert [i for i in device.cdi_device_ids if "gpu=" in i] == [
            f"gputopo.io/gpu={topo.gpus[i].uuid}" for i in (4, 5, 6, 7)
        ]
        deadline = time.monotonic() + 10
        while _names(r.slices.slices[slice_name(NODE)]["spec"])[-2] != "block-4-5-6-7":
            assert time.monotonic() < deadline, "the busy quad never moved behind the free one"
            time.sleep(0.01)
        assert r.plugin.driver.unprepare([ClaimRef("a", "default", "claim-a")]) == {"a": ""}
        assert r.plugin.driver.in_use() == frozenset()


@pytest.mark.parametrize(
    ("first", "second", "error"),
    [
        pytest.param(["gpu-5"], ["block-4-5-6-7"], "prepared for claim", id="block-over-a-prepared-gpu"),
        pytest.param(["block-0-1"], ["block-0-1-2-3"], "prepared for claim", id="two-overlapping-blocks"),
        pytest.param(["block-0-1"], ["gpu-1"], "prepared for claim", id="gpu-of-a-prepared-block"),
        pytest.param([], ["block-1-2"], "not a block this node publishes", id="unaligned-block-not-published"),
        pytest.param([], ["block-0-1-2-3-4-5-6-7-8"], "not a GPU or block", id="gpus-not-on-the-node"),
    ],
)
def test_a_block_the_allocator_would_never_give_is_refused(
    tmp_path: Path, first: list[str], second: list[str], error: str
) -> None:
    with running_dra(tmp_path, topology("dgx-h100"), blocks=True) as r:
        if first:
            assert _prepare(r, "first", first) == ""
        assert error in _prepare(r, "second", second)
        assert not claim_spec_path(tmp_path / "cdi", "second").exists()


def test_without_blocks_on_a_block_is_refused(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology("dgx-h100")) as r:
        assert "not a block this node publishes" in _prepare(r, "a", ["block-0-1"])


def test_a_claim_with_a_block_and_one_of_its_gpus_injects_each_gpu_once(tmp_path: Path) -> None:
    topo = topology("dgx-h100")
    with running_dra(tmp_path, topo, blocks=True) as r:
        assert _prepare(r, "a", ["block-0-1", "gpu-1"]) == ""
        assert r.plugin.driver is not None
        ids = [i for d in r.plugin.driver.prepared()["a"].devices for i in d.cdi_device_ids if "gpu=" in i]
        assert ids == [f"gputopo.io/gpu={topo.gpus[0].uuid}", f"gputopo.io/gpu={topo.gpus[1].uuid}"]


@pytest.mark.parametrize(("strip", "dropped", "blocks"), [(False, False, 7), (True, True, 0)])
def test_the_plugin_says_when_the_counters_were_dropped(
    tmp_path: Path, strip: bool, dropped: bool, blocks: int
) -> None:
    slices = FakeSlices(strip_counters=strip)
    with running_dra(tmp_path, topology("dgx-h100"), slices=slices, blocks=True) as r:
        assert r.plugin.counters_dropped is dropped
        names = _names(r.slices.slices[slice_name(NODE)]["spec"])
        assert sum(n.startswith("block-") for n in names) == blocks
        assert r.plugin.driver is not None
        error = _prepare(r, "a", ["block-0-1"])
        assert (error == "") is not dropped  # a block is refused once none is published
