"""Fixtures for the tests that run the agent's main(), which touches process-wide state."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputopo.localcluster.nvmlmock import PROFILE_ENV
from tests.agent.libnvml_harness import Node, load_real_binding


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


@pytest.fixture(scope="session")
def real_pynvml() -> Any:
    """nvidia-ml-py bound to the NVML mock library (built on first use)."""
    return load_real_binding()[0]


@pytest.fixture
def libnvml_node(real_pynvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """A node whose profile file is this test's own, read by an adapter through the real binding."""
    path = tmp_path / "nvml-profile"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    node = Node(real_pynvml, path, tmp_path / "sys")
    yield node
    node.adapter.close()
