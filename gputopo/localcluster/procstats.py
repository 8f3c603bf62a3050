"""CPU seconds used by the local control plane's processes (and this one), read from Linux /proc.

On a small machine every component competes for the same cores, so a measurement reports what each
process spent during it: the difference of two snapshots.
"""

from __future__ import annotations

import os
from pathlib import Path

from gputopo.localcluster.controlplane import ControlPlane

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (Linux /proc); 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # After the command name, fields[11] and fields[12] are utime and stime (stat fields 14 and 15).
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_snapshot(cp: ControlPlane, own_label: str) -> dict[str, float]:
    """CPU seconds so far of every component of `cp`, and of this process under `own_label`."""
    out = {name: cpu_seconds(cp.pid(name)) for name in cp.components()}
    t = os.times()
    out[own_label] = t.user + t.system
    return out
