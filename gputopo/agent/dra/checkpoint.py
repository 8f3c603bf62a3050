"""The DRA driver's checkpoint: every prepared claim and the devices its Prepare answered.

The kubelet may call NodePrepareResources again for a claim it already prepared (after its own restart
or ours), and NodeUnprepareResources for one we no longer remember. Keeping the answers in a file under
the plugin's directory makes a restart lose nothing: a prepared claim is answered from here without
reading the API server again. The file is written atomically (temporary file, fsync, rename, fsync of
the directory), so a crash leaves the old or the new version, never half of one. It is versioned and
bounded in size; a file that cannot be read is moved aside (logged) rather than blocking the driver.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.json"
# Thousands of claims fit in well under this; a larger file is not one we wrote.
MAX_CHECKPOINT_BYTES = 8 * 1024 * 1024
# A claim uid as Prepare accepts it: it names a CDI device and a file, so CDI's device-name rule, and
# at most 128 characters (a Kubernetes uid is a 36-character UUID). Always fullmatch.
CLAIM_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class CheckpointError(ValueError):
    """The checkpoint file is not one this agent can read; the message says why."""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources answered it."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "requestNames": list(self.request_names),
            "poolName": self.pool_name,
            "deviceName": self.device_name,
            "cdiDeviceIDs": list(self.cdi_device_ids),
        }

    @staticmethod
    def from_json(doc: Any) -> PreparedDevice:
        if not isinstance(doc, dict):
            raise CheckpointError("a device is not an object")
        return PreparedDevice(
            request_names=_strings(doc.get("requestNames"), "requestNames"),
            pool_name=_string(doc.get("poolName"), "poolName"),
            device_name=_string(doc.get("deviceName"), "deviceName"),
            cdi_device_ids=_strings(doc.get("cdiDeviceIDs"), "cdiDeviceIDs"),
        )


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "devices": [d.to_json() for d in self.devices]}


def _string(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise CheckpointError(f"{what} is not a string")
    return v


def _strings(v: Any, what: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise CheckpointError(f"{what} is not a list of strings")
    return tuple(v)


def encode(claims: Iterable[PreparedClaim]) -> bytes:
    doc = {"version": CHECKPOINT_VERSION, "claims": {c.uid: c.to_json() for c in sorted(claims, key=lambda c: c.uid)}}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def decode(data: bytes) -> dict[str, PreparedClaim]:
    """The claims of a checkpoint file's content; raises CheckpointError naming what is wrong."""
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(f"{len(data)} bytes is over the {MAX_CHECKPOINT_BYTES}-byte limit")
    try:
        doc = json.loads(data)
    except RecursionError:  # nesting thousands deep: not a file we wrote
        raise CheckpointError("not JSON we wrote: nested too deeply") from None
    except ValueError as e:
        raise CheckpointError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CheckpointError("not a JSON object")
    if doc.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"version {doc.get('version')!r}, this agent reads version {CHECKPOINT_VERSION}")
    raw = doc.get("claims")
    if not isinstance(raw, dict):
        raise CheckpointError("claims is not an object")
    out: dict[str, PreparedClaim] = {}
    for uid, c in raw.items():
        if not CLAIM_UID.fullmatch(uid):
            raise CheckpointError(f"claim uid {uid[:140]!r} is not one a Prepare accepts")
        if not isinstance(c, dict):
            raise CheckpointError(f"claim {uid!r} is not an object")
        devices = c.get("devices")
        if not isinstance(devices, list):
            raise CheckpointError(f"claim {uid!r}: devices is not a list")
        out[uid] = PreparedClaim(
            uid=uid,
            namespace=_string(c.get("namespace"), f"claim {uid!r}: namespace"),
            name=_string(c.get("name"), f"claim {uid!r}: name"),
            devices=tuple(PreparedDevice.from_json(d) for d in devices),
        )
    return out


def read_regular(path: Path, limit: int) -> bytes:
    """Up to `limit` bytes of the regular file `path`. Opened without following a symlink and without
    blocking (a FIFO would hang a plain open); anything but a regular file raises CheckpointError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(1 << 20, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _replace_aside(path: Path, aside: Path) -> None:
    """Move `path` (whatever it is) to `aside`. An earlier `aside` that `os.replace` cannot replace (a
    directory, or a file where a directory goes) is removed first: only the latest is kept."""
    try:
        os.replace(path, aside)
        return
    except OSError:
        if not os.path.lexists(aside):
            raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside)
    else:
        aside.unlink()
    os.replace(path, aside)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that a crash at any point leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory entry is.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Checkpoint:
    """The prepared claims, in memory and in `path`; not thread-safe (the driver holds its lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._claims: dict[str, PreparedClaim] = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        """The checkpoint's claims; anything at the path that is not a checkpoint we can read (a
        directory, a FIFO, a symlink, bad JSON) is moved aside, so the driver starts either way."""
        try:
            data = read_regular(self.path, MAX_CHECKPOINT_BYTES + 1)
        except FileNotFoundError:
            return {}
        except (OSError, CheckpointError) as e:
            self._move_aside(str(e))
            return {}
        try:
            claims = decode(data)
        except CheckpointError as e:
            self._move_aside(str(e))
            return {}
        log.info("DRA checkpoint loaded", extra={"path": str(self.path), "claims": len(claims)})
        return claims

    def _move_aside(self, error: str) -> None:
        aside = self.path.with_name(self.path.name + ".unreadable")
        try:
            _replace_aside(self.path, aside)
        except OSError as e:
            # Then writes fail too (each Prepare says so) but the driver still serves Unprepare.
            log.error(
                "the DRA checkpoint is unreadable and cannot be moved aside",
                extra={"path": str(self.path), "error": error, "move_error": str(e)},
            )
            return
        log.error(
            "the DRA checkpoint is unreadable; moved aside, prepared claims will be read again from the API",
            extra={"path": str(self.path), "moved_to": str(aside), "error": error},
        )

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def claims(self) -> Mapping[str, PreparedClaim]:
        return dict(self._claims)

    def add(self, claim: PreparedClaim) -> None:
        """Record a prepared claim; raises CheckpointError (nothing changed) when the file would be too large."""
        claims = {**self._claims, claim.uid: claim}
        self._write(claims)

    def remove(self, uid: str) -> None:
        if uid not in self._claims:
            return
        claims = dict(self._claims)
        del claims[uid]
        self._write(claims)

    def _write(self, claims: dict[str, PreparedClaim]) -> None:
        data = encode(claims.values())
        if len(data) > MAX_CHECKPOINT_BYTES:
            raise CheckpointError(f"the checkpoint would hold {len(data)} bytes, over {MAX_CHECKPOINT_BYTES}")
        atomic_write(self.path, data, mode=0o600)
        self._claims = claims
