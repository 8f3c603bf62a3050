"""Xid judgement (gputopo.agent.nvml_xid) without NVML: the catalogue's kinds, how long each verdict
holds, and the memory's bounds under hostile floods (the library-level tests are test_agent_libnvml.py)."""

from __future__ import annotations

import pytest

from gputopo.agent.nvml_xid import MAX_GPUS, RECENT_PER_GPU, XidKind, XidMemory, classify
from gputopo.model import Health


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        pytest.param(48, XidKind.FATAL, id="48 double-bit ECC is fatal"),
        pytest.param(79, XidKind.FATAL, id="79 fallen off the bus is fatal"),
        pytest.param(95, XidKind.FATAL, id="95 uncontained ECC is fatal"),
        pytest.param(64, XidKind.FATAL, id="64 row remapping failure is fatal"),
        pytest.param(63, XidKind.DEGRADING, id="63 row remapping recorded degrades"),
        pytest.param(74, XidKind.DEGRADING, id="74 NVLink error degrades"),
        pytest.param(92, XidKind.DEGRADING, id="92 high single-bit ECC rate degrades"),
        pytest.param(94, XidKind.DEGRADING, id="94 contained ECC degrades"),
        pytest.param(13, XidKind.APPLICATION, id="13 engine exception is the application's"),
        pytest.param(31, XidKind.APPLICATION, id="31 page fault is the application's"),
        pytest.param(43, XidKind.APPLICATION, id="43 stopped channel is the application's"),
        pytest.param(45, XidKind.APPLICATION, id="45 preemptive cleanup is the application's"),
        pytest.param(0, XidKind.UNKNOWN, id="0 is unknown"),
        pytest.param(2**64 - 1, XidKind.UNKNOWN, id="a 64-bit code from a forged event is unknown"),
    ],
)
def test_xid_catalogue_kind(code: int, kind: XidKind) -> None:
    assert classify(code)[0] is kind


def test_xid_fatal_outranks_later_degrading_and_never_clears_by_time() -> None:
    m = XidMemory(quiet_s=10)
    m.observe("GPU-a", 79, 0)
    m.observe("GPU-a", 74, 1)
    assert m.verdict("GPU-a", 10_000) == (
        Health.FAILED,
        "Xid 79: GPU has fallen off the bus (2 Xids seen; reset the GPU, then restart the agent)",
    )


def test_xid_application_faults_give_no_verdict() -> None:
    m = XidMemory()
    for _ in range(1000):
        m.observe("GPU-a", 31, 0)
    assert m.verdict("GPU-a", 0) is None
    assert len(m.gpus["GPU-a"].recent) == RECENT_PER_GPU


def test_xid_events_for_more_gpus_than_a_node_has_are_dropped_not_stored() -> None:
    m = XidMemory()
    kept = [m.observe(f"GPU-forged-{i}", 79, 0) for i in range(MAX_GPUS + 100)]
    assert kept == [True] * MAX_GPUS + [False] * 100
    assert len(m.gpus) == MAX_GPUS
    assert m.verdict(f"GPU-forged-{MAX_GPUS}", 0) is None
    assert m.observe("GPU-forged-0", 48, 1)  # a GPU already known is still followed
