"""Every command the README shows, run verbatim (arguments included), as a new user would type it.

The commands are read from the README itself (its ``sh`` blocks and the inline ``./scripts/...``
spans), so a command added there is tried here or this module fails naming it. ``./scripts/test.sh``
is the command that runs this very test; CI runs it through ``.ci/run``, which must call it verbatim.
The demo commands use the README's default Kubernetes release, so they run in that release's e2e
session only (the other session skips them, saying so).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gputopo.localcluster.binaries import BUILD_SCRIPT

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = "./scripts/test.sh"
# The release a command gets when nothing pins one: the build script is the one place it is written.
_pin = re.search(r"GPUTOPO_K8S_VERSION:-([0-9.]+)", BUILD_SCRIPT.read_text())
assert _pin is not None, f"{BUILD_SCRIPT} pins no default Kubernetes release"
DEFAULT_K8S_VERSION = _pin.group(1)


def readme_commands(text: str) -> list[str]:
    """The shell commands the README shows: each non-comment line of its ``sh`` blocks, and each inline
    code span that starts with ``./scripts/``, in order, without repeats."""
    found: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        found.extend(ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))
    found.extend(re.findall(r"`(\./scripts/[^`]+)`", text))
    return list(dict.fromkeys(found))


# What each command must print besides exiting 0; a README command missing here fails the test below.
EXPECTED: dict[str, tuple[str, ...]] = {
    "./scripts/demo.sh": (
        "pods placed.",
        "TopologyPlacement",
        "5/5 pods of JobSet llama-pretrain placed.",
        "from the NVML mock library built here",
        "TP group 0/1 (16 GPUs, ranks 0-3) in NVLink domain",
        "4/4 pods of TP group tp16 placed in one NVLink domain.",
        "tearing down",
    ),
    "./scripts/demo.sh --installed": ("pods placed.", "helm install", "helm uninstall"),
    ".venv/bin/gputopo simulate --cluster examples/cluster.yaml --jobs examples/jobs.yaml --output text": (
        "pods placed against their requests",
    ),
    ".venv/bin/gputopo simulate --cluster examples/cluster.yaml --jobs examples/jobs.yaml --policy default": (
        "default",
    ),
}

COMMANDS = readme_commands(README.read_text())


def test_readme_names_only_commands_this_module_runs() -> None:
    unknown = [c for c in COMMANDS if c != TEST_COMMAND and c not in EXPECTED]
    assert not unknown, f"README commands with no check here: {unknown}"
    assert TEST_COMMAND in COMMANDS


def test_readme_test_command_is_what_ci_runs_verbatim() -> None:
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in lines


def _needs_default_release() -> None:
    running = os.environ.get("GPUTOPO_K8S_VERSION", DEFAULT_K8S_VERSION)
    if running != DEFAULT_K8S_VERSION:
        pytest.skip(f"the README's demo uses the default release {DEFAULT_K8S_VERSION}; it runs in that session")


RUN = [c for c in COMMANDS if c in EXPECTED]


@pytest.mark.parametrize("command", RUN, ids=[re.sub(r"[^A-Za-z0-9.=-]+", "_", c) for c in RUN])
def test_readme_command_runs_verbatim(command: str) -> None:
    if "demo.sh" in command:
        _needs_default_release()
        if "--installed" in command and os.geteuid() != 0:
            pytest.skip("the installed demo needs root (containerd, a private mount namespace)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOPO_") or k == "GPUTOPO_CACHE"}
    # As a user types it: a shell in the repository root, nothing of the test session's settings.
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{out[-4000:]}"
    for text in EXPECTED[command]:
        assert text in out, f"{command!r} did not print {text!r}:\n{out[-4000:]}"
