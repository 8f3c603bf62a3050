"""Benchmark the agent's NVML discovery through nvidia-ml-py and the NVML mock library.

CPU per `NvmlAdapter.discover()` (process time, so other load on the machine does not count) for a
few named systems, with the peer-to-peer over NVLink check and without it (the profile marks
nvmlDeviceGetP2PStatus absent, as an older driver would), over a bounded number of cycles each.
Through the mock every NVML call also stats the profile file, so the figures bound the binding's
and the adapter's cost from above; a real driver's calls cost what the driver costs on top.

    .venv/bin/python bench/nvml_discovery.py [--cycles 200]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gputopo.agent.nvml_backend import NvmlAdapter
from gputopo.localcluster.nvmlmock import PROFILE_ENV, build_library, profile_for_system, write_profile
from gputopo.localcluster.nvmlmock.build import LIBRARY_NAME

SYSTEMS = ("dgx-1v", "dgx-h100", "gb200-tray", "l40s-4")


def cpu_per_cycle(pynvml: object, system: str, cycles: int, p2p: bool, tmp: Path) -> float:
    profile = profile_for_system(system)
    if not p2p:
        profile.absent.add("nvmlDeviceGetP2PStatus")
    path = tmp / f"{system}-{p2p}"
    write_profile(path, profile)
    os.environ[PROFILE_ENV] = str(path)
    adapter = NvmlAdapter(pynvml, sysfs_root=tmp / "sys")  # type: ignore[arg-type]
    try:
        adapter.discover()  # open, first baselines
        start = time.process_time()
        for _ in range(cycles):
            adapter.discover()
        return (time.process_time() - start) / cycles
    finally:
        adapter.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=200)
    args = ap.parse_args()
    ctypes.CDLL(str(build_library() / LIBRARY_NAME))  # pynvml's CDLL("libnvidia-ml.so.1") finds it by soname
    import pynvml

    print(f"NVML discovery through nvidia-ml-py and the mock library, {args.cycles} cycles each (CPU per cycle)")
    print(f"{'system':<12} {'with P2P check':>15} {'without':>10} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "sys").mkdir()
        for system in SYSTEMS:
            with_p2p = cpu_per_cycle(pynvml, system, args.cycles, True, tmp)
            without = cpu_per_cycle(pynvml, system, args.cycles, False, tmp)
            print(f"{system:<12} {with_p2p * 1e3:>12.2f} ms {without * 1e3:>7.2f} ms {with_p2p / without:>6.2f}x")


if __name__ == "__main__":
    main()
