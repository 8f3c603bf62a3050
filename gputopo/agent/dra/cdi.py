"""CDI specs for the DRA driver: the node's GPUs, and one small spec per prepared claim.

NodePrepareResources answers CDI device names; the container runtime resolves them through the spec
files in the CDI directory (default /var/run/cdi). Two kinds:

- `gputopo.io/gpu=<uuid>`: one device per GPU, its device node (`/dev/nvidia<minor>`) when it exists,
  and the control nodes (`/dev/nvidiactl`, `/dev/nvidia-uvm`, …) that exist, for every container;
- `gputopo.io/claim=<claim uid>`: the claim's `NVIDIA_VISIBLE_DEVICES=<uuid>,<uuid>` for the NVIDIA
  Container Toolkit's envvar mode. One environment variable cannot be split across per-GPU devices
  (the last one would win), so it lives on a per-claim device, written at Prepare and removed at
  Unprepare.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from gputopo.agent.dra.checkpoint import atomic_write
from gputopo.model import NodeTopology

log = logging.getLogger(__name__)

CDI_VERSION = "0.5.0"  # env and deviceNodes need no newer one; containerd 1.7 and CRI-O read it
VENDOR = "gputopo.io"
GPU_CLASS = "gpu"
CLAIM_CLASS = "claim"
GPU_KIND = f"{VENDOR}/{GPU_CLASS}"
CLAIM_KIND = f"{VENDOR}/{CLAIM_CLASS}"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
# CDI's device-name rule: a letter or digit, then letters, digits, '_', '-', '.' or ':'. Always
# fullmatch: `$` also matches before a trailing newline, and a claim uid names a file.
_CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
_MINOR = re.compile(r"^Device Minor:[ \t]*([0-9]{1,9})[ \t]*$", re.MULTILINE)
_CLAIM_PREFIX = f"{VENDOR}-{CLAIM_CLASS}_"


class CdiNameError(ValueError):
    """A name that CDI does not accept as a device name."""


def cdi_name(name: str) -> str:
    if len(name) > 253 or not _CDI_NAME.fullmatch(name):
        raise CdiNameError(f"{name!r} is not a valid CDI device name")
    return name


def gpu_device_id(uuid: str) -> str:
    """`gputopo.io/gpu=<uuid>`, the qualified CDI name NodePrepareResources answers for a GPU."""
    return f"{GPU_KIND}={cdi_name(uuid)}"


def claim_device_id(claim_uid: str) -> str:
    return f"{CLAIM_KIND}={cdi_name(claim_uid)}"


def node_spec_path(cdi_dir: Path) -> Path:
    return cdi_dir / f"{VENDOR}-{GPU_CLASS}.json"


def claim_spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{_CLAIM_PREFIX}{cdi_name(claim_uid)}.json"


def _sysfs_bus_id(bus_id: str) -> str:
    """NVML writes an 8-digit PCI domain (00000000:18:00.0), the kernel a 4-digit one."""
    domain, sep, rest = bus_id.lower().partition(":")
    return f"{domain[-4:]}{sep}{rest}" if sep and len(domain) > 4 else bus_id.lower()


def gpu_minor(root: Path, bus_id: str, index: int) -> int:
    """The GPU's /dev/nvidia<minor>, from the driver's /proc information; the NVML index when unknown."""
    if bus_id:
        info = root / "proc" / "driver" / "nvidia" / "gpus" / _sysfs_bus_id(bus_id) / "information"
        try:
            m = _MINOR.search(info.read_text(errors="replace"))
        except OSError:
            m = None
        if m:
            return int(m.group(1))
    return index


def _device_nodes(root: Path, paths: Sequence[str]) -> list[dict[str, str]]:
    return [{"path": p} for p in paths if (root / p.lstrip("/")).exists()]


def node_spec(topology: NodeTopology, root: Path = Path("/")) -> dict[str, Any]:
    """The `gputopo.io/gpu` spec: every GPU by UUID with its device node where `root` has it."""
    devices = []
    for g in topology.gpus:
        minor = gpu_minor(root, g.pci_bus_id, g.index)
        edits: dict[str, Any] = {}
        nodes = _device_nodes(root, [f"/dev/nvidia{minor}"])
        if nodes:
            edits["deviceNodes"] = nodes
        devices.append({"name": cdi_name(g.uuid), "containerEdits": edits})
    spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": GPU_KIND, "devices": devices}
    control = _device_nodes(root, CONTROL_DEVICES)
    if control:
        spec["containerEdits"] = {"deviceNodes": control}
    return spec


def claim_spec(claim_uid: str, uuids: Sequence[str]) -> dict[str, Any]:
    env = f"{VISIBLE_DEVICES_ENV}={','.join(uuids) if uuids else 'void'}"
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CLAIM_KIND,
        "devices": [{"name": cdi_name(claim_uid), "containerEdits": {"env": [env]}}],
    }


def _encode(spec: dict[str, Any]) -> bytes:
    return json.dumps(spec, indent=1, sort_keys=True).encode()


class CdiWriter:
    """Writes the specs into `cdi_dir`; `root` is where /dev and /proc are looked up (tests use a tmp dir)."""

    def __init__(self, cdi_dir: Path = DEFAULT_CDI_DIR, root: Path = Path("/")) -> None:
        self.cdi_dir = cdi_dir
        self.root = root
        self._node_written: bytes | None = None

    def write_node(self, topology: NodeTopology) -> bool:
        """Write the GPUs' spec when its content changed; True when it was written."""
        data = _encode(node_spec(topology, self.root))
        path = node_spec_path(self.cdi_dir)
        if data == self._node_written and path.exists():
            return False
        atomic_write(path, data)
        self._node_written = data
        return True

    def write_claim(self, claim_uid: str, uuids: Sequence[str]) -> None:
        atomic_write(claim_spec_path(self.cdi_dir, claim_uid), _encode(claim_spec(claim_uid, uuids)))

    def remove_claim(self, claim_uid: str) -> None:
        try:
            path = claim_spec_path(self.cdi_dir, claim_uid)
        except CdiNameError:
            return  # never written: Prepare refuses such a uid
        path.unlink(missing_ok=True)

    def remove_orphans(self, keep: Collection[str]) -> list[str]:
        """Remove the claim specs (and our temporary files) of claims not in `keep`: what a crash
        between writing a claim's spec and checkpointing it left. Returns the claim uids removed."""
        removed: list[str] = []
        try:
            entries = list(os.scandir(self.cdi_dir))
        except FileNotFoundError:
            return removed
        for e in entries:
            name = e.name
            if name.startswith(f".{_CLAIM_PREFIX}") and name.endswith(".tmp"):
                uid = ""  # atomic_write's temporary file, left by a crash mid-write
            elif name.startswith(_CLAIM_PREFIX) and name.endswith(".json"):
                uid = name[len(_CLAIM_PREFIX) : -len(".json")]
                if uid in keep:
                    continue
            else:
                continue
            try:
                Path(e.path).unlink(missing_ok=True)
            except OSError as err:  # a directory by that name is not ours to remove: leave it, go on
                log.warning("cannot remove a stale CDI claim spec", extra={"path": e.path, "error": str(err)})
                continue
            if uid:
                removed.append(uid)
        return removed
