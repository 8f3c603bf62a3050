"""The DRA driver in best-fit order (gputopo/agent/dra/plugin.py, slices.py): the slice lists the devices
so that first fit is best fit for the GPUs its prepared claims hold, re-published after each Prepare or
Unprepare that changes them, at most one slice write per change; off, the order stays the index order
and claims cost no write."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from gputopo.agent.dra.driver import ClaimRef
from gputopo.agent.dra.slices import slice_name
from gputopo.model import NodeTopology
from tests.agent.dp_harness import NODE, topology
from tests.agent.dra_harness import Running, claim_object, running_dra
from tests.engine.dra.order_fixtures import mesh_minus_matching


def _order(r: Running) -> list[int]:
    with r.slices.lock:
        spec = r.slices.slices[slice_name(NODE)]["spec"]
    return [int(d["name"].removeprefix("gpu-")) for d in spec["devices"]]


def _until(r: Running, order: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _order(r) != order:
        assert time.monotonic() < deadline, f"the slice's order stayed {_order(r)}, not {order}"
        time.sleep(0.01)


def _prepare(r: Running, uid: str, gpus: list[int]) -> None:
    r.claims.add(claim_object(uid, [f"gpu-{g}" for g in gpus]))
    assert r.plugin.driver is not None
    (result,) = r.plugin.driver.prepare([ClaimRef(uid, "default", f"claim-{uid}")]).values()
    assert not result.error


def _unprepare(r: Running, uid: str) -> None:
    assert r.plugin.driver is not None
    assert r.plugin.driver.unprepare([ClaimRef(uid, "default", f"claim-{uid}")]) == {uid: ""}


def test_each_prepare_and_unprepare_reorders_the_slice_with_one_write(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology("dgx-1v"), best_fit_order=True) as r:
        assert _order(r) == [0, 3, 2, 1, 4, 7, 6, 5]  # nothing in use: an NV2 pair of the first quad first
        writes = r.slices.writes
        _prepare(r, "a", [4, 5])
        _until(r, [6, 7, 4, 5, 0, 1, 2, 3])  # the broken quad's free pair first: a pair claim keeps 0-3 whole
        assert r.slices.writes == writes + 1
        _prepare(r, "b", [0, 1])
        _until(r, [2, 3, 0, 1, 6, 7, 4, 5])  # two half quads: the first fills
        assert r.slices.writes == writes + 2
        _unprepare(r, "a")
        _until(r, [2, 3, 0, 1, 4, 5, 6, 7])
        assert r.slices.writes == writes + 3
        assert r.plugin.republish() is not None and r.slices.writes == writes + 3  # the same order: no write


def test_a_prepare_answered_from_the_checkpoint_changes_nothing_and_writes_nothing(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology("dgx-1v"), best_fit_order=True) as r:
        _prepare(r, "a", [4, 5])
        _until(r, [6, 7, 4, 5, 0, 1, 2, 3])
        writes = r.slices.writes
        _prepare(r, "a", [4, 5])  # the kubelet asks again: answered from the checkpoint
        r.plugin.republish()  # wait for the re-publisher's turn: it holds the same lock
        assert r.slices.writes == writes


@pytest.mark.parametrize(
    ("best_fit", "expected"),
    [
        pytest.param(False, list(range(8)), id="off: index order, and a prepare writes no slice"),
        pytest.param(True, [6, 7, 4, 5, 0, 1, 2, 3], id="on: best-fit order for the GPUs in use"),
    ],
)
def test_the_order_follows_the_setting(tmp_path: Path, best_fit: bool, expected: list[int]) -> None:
    with running_dra(tmp_path, topology("dgx-1v"), best_fit_order=best_fit) as r:
        writes = r.slices.writes
        _prepare(r, "a", [4, 5])
        r.plugin.update(topology("dgx-1v"))  # a discovery cycle publishes what the setting says
        _until(r, expected)
        assert r.slices.writes == writes + (1 if best_fit else 0)


@pytest.mark.parametrize(
    ("topo", "warnings"),
    [
        pytest.param(topology("dgx-1v"), 0, id="a named system: no word"),
        pytest.param(mesh_minus_matching(32), 1, id="wired against the clique search: said once"),
    ],
)
def test_an_order_past_its_work_budget_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, topo: NodeTopology, warnings: int
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="gputopo.agent.dra.plugin"),
        running_dra(tmp_path, topo, best_fit_order=True) as r,
    ):
        for uid, gpus in (("a", [0, 2]), ("b", [4, 6])):  # each a new order: three in all
            _prepare(r, uid, gpus)
            r.plugin.republish()  # waits for the re-publisher's turn: it holds the same lock
    said = [rec for rec in caplog.records if "work budget" in rec.getMessage()]
    assert len(said) == warnings
