"""The one RFC 3339 reader for API object times (Lease renewTime, creationTimestamp, heartbeats)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.kube import parse_time

EPOCH_2026 = 1767225600.0  # 2026-01-01T00:00:00Z


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("2026-01-01T00:00:00Z", EPOCH_2026, id="seconds-in-utc"),
        pytest.param("2026-01-01T00:00:00.250000Z", EPOCH_2026 + 0.25, id="microtime"),
        pytest.param("2026-01-01T02:00:00+02:00", EPOCH_2026, id="an-offset"),
        pytest.param("2026-01-01t00:00:00z", EPOCH_2026, id="lower-case-separators"),
        pytest.param("2026-01-01T00:00:00", None, id="no-zone-is-not-read-as-local-time"),
        pytest.param("2026-13-01T00:00:00Z", None, id="month-13"),
        pytest.param("", None, id="empty"),
        pytest.param("yesterday", None, id="words"),
        pytest.param(1767225600, None, id="a-number"),
        pytest.param(None, None, id="none"),
    ],
)
def test_parse_time_reads_rfc3339_with_its_zone_and_nothing_else(text: object, expected: float | None) -> None:
    assert parse_time(text) == expected


@given(st.one_of(st.text(max_size=40), st.integers(), st.none(), st.binary(max_size=20)))
def test_parse_time_never_raises(text: object) -> None:
    got = parse_time(text)
    assert got is None or isinstance(got, float)
