"""The wheel users install carries the three packages and their data, and no test code."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.paths import REPO

ROOT = REPO


def test_wheel_holds_the_packages_and_their_data_but_no_test_code(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=50,
    )
    (wheel,) = tmp_path.glob("gputopo-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        sources = {n: z.read(n).decode() for n in names if n.endswith(".py")}
    tops = {n.split("/", 1)[0] for n in names if "/" in n and not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"gputopo"}  # one package root: no generic top-level names another distribution may install
    for needed in (
        "gputopo/agent/deviceplugin/api.proto",
        "gputopo/agent/podresources/api.proto",
        "gputopo/agent/dra/api/dra_v1.proto",
        "gputopo/py.typed",
        "gputopo/localcluster/build_binaries.sh",  # `gputopo demo` builds the control plane with it
        "gputopo/localcluster/nvmlmock/nvmlmock.c",  # the NVML mock library is built from it where it runs
    ):
        assert needed in names, needed
    assert not [n for n in names if n.startswith("tests/") or n.rsplit("/", 1)[-1].startswith("test_")]
    assert not [n for n, text in sources.items() if "import pytest" in text or "from pytest" in text]
    assert not [n for n, text in sources.items() if "hypothesis" in text]
