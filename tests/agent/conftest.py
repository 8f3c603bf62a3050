"""Fixtures for the tests that run the agent's main(), which touches process-wide state."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest


@pytest.fixture
def restore_logging_and_signals() -> Iterator[None]:
    """main() configures the root logger and signal handlers; put them back for other tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    signal.signal(signal.SIGTERM, sigterm)
    signal.signal(signal.SIGINT, sigint)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPUTOPO_* or NODE_NAME from the caller's environment leaks into the settings under test."""
    for key in list(os.environ):
        if key.startswith("GPUTOPO_") or key == "NODE_NAME":
            monkeypatch.delenv(key)
