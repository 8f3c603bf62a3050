"""Suite-wide switches: e2e runs only when asked for, and each layer has its own time limit.

Plain ``pytest`` runs the unit suite (tests/) with a short per-test timeout. The end-to-end suite
(e2e/, marked ``e2e``) starts real upstream binaries and runs only with ``--e2e``; the README's
test command (scripts/test.sh) passes it, so CI runs everything.
"""

from __future__ import annotations

import pytest

UNIT_TIMEOUT_S = 60  # generous for a busy 2-core machine; a unit test that needs more is not a unit test
E2E_TIMEOUT_S = 300


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--e2e", action="store_true", help="also run the end-to-end suite (e2e/, real binaries)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_e2e = bool(config.getoption("--e2e"))
    skip = pytest.mark.skip(reason="end-to-end test: run with --e2e (scripts/test.sh does)")
    for item in items:
        is_e2e = item.get_closest_marker("e2e") is not None
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S if is_e2e else UNIT_TIMEOUT_S))
        if is_e2e and not run_e2e:
            item.add_marker(skip)
