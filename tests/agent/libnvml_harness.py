"""The NVML mock library (gputopo.localcluster.nvmlmock) loaded into this process through nvidia-ml-py.

The library is built once per source version into the user's cache with the system compiler, loaded
by its full path, and then found by nvidia-ml-py's own `CDLL("libnvidia-ml.so.1")`: the dynamic
loader matches the name against the soname of a library already loaded. Each test points
$GPUTOPO_NVML_PROFILE at its own profile; the library reads it again whenever it changes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.nvml_backend import NvmlAdapter
from gputopo.agent.nvml_lib import NvmlLib
from gputopo.localcluster.nvmlmock import Profile, build_library, write_profile
from gputopo.localcluster.nvmlmock.build import LIBRARY_NAME


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load_real_binding() -> tuple[Any, ctypes.CDLL]:
    """(the pynvml module, the mock library) with pynvml bound to the mock; skips where a real
    libnvidia-ml was loaded into this process first (a GPU machine), which cannot be swapped."""
    lib = ctypes.CDLL(str(build_library() / LIBRARY_NAME))
    import pynvml

    pynvml._LoadNvmlLibrary()
    ours = ctypes.cast(lib.nvmlInit_v2, ctypes.c_void_p).value
    bound = getattr(pynvml.nvmlLib, "nvmlInit_v2", None)
    if bound is None or ctypes.cast(bound, ctypes.c_void_p).value != ours:
        pytest.skip("another libnvidia-ml.so.1 is already loaded in this process")
    return pynvml, lib


class Node:
    """One node's NVML: a profile file and the unmodified adapter reading it through the real binding."""

    def __init__(self, pynvml: Any, path: Path, sysfs: Path) -> None:
        self.pynvml = pynvml
        self.path = path
        self.clock = Clock()
        self.adapter = NvmlAdapter(pynvml, sysfs_root=sysfs, clock=self.clock)

    @property
    def lib(self) -> NvmlLib:
        lib: NvmlLib = self.pynvml
        return lib

    def write(self, profile: Profile) -> None:
        write_profile(self.path, profile)
