"""What NodePrepareResources and NodeUnprepareResources do, apart from gRPC.

Prepare, per claim: answer from the checkpoint when the claim is already prepared; else read the
ResourceClaim (the one Kubernetes client, behind `ClaimReader`), check its uid, take the allocation's
results whose driver is ours (every one of them must be in this node's pool, and there must be one),
map each device name (`gpu-<i>`, or a block `block-<i>-<j>-...` the node publishes: all its GPUs) to
GPUs of the current topology, write the claim's CDI spec,
checkpoint, answer. A device we do not have, a failed GPU, a missing or changed claim, a claim for
another node or driver, a block not published or sharing a GPU with another prepared claim: that claim
gets an error naming it, the others in the call go on.
Unprepare: forget the claim and its CDI spec; a claim we never prepared is already unprepared.
Nothing raises out of `prepare` or `unprepare`: every failure is a claim's error string.

Concurrency: the lock is never held across an API read, so Unprepare (which reads nothing) never waits
behind one; at most `MAX_API_READS` reads run at once, a Prepare past that fails its claim at once
(the kubelet retries) rather than holding a gRPC worker. An Unprepare that arrives while a Prepare of
the same claim reads the API wins: that Prepare then fails instead of writing the claim back.
Every failure path removes what it wrote: a claim's CDI spec goes when its checkpoint write fails,
and at start the specs of claims the checkpoint does not hold (a crash between the two) are removed.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gputopo.agent.dra.cdi import CdiNameError, CdiWriter, claim_device_id, gpu_device_id
from gputopo.agent.dra.checkpoint import CLAIM_UID, Checkpoint, PreparedClaim, PreparedDevice
from gputopo.engine.dra.devices import DRIVER
from gputopo.engine.state.cliques import mask_of
from gputopo.kube import short_error
from gputopo.model import Health, NodeTopology
from gputopo.model.dra import device_gpus

log = logging.getLogger(__name__)

# The API's own limits: a uid is a UUID, a namespace a DNS label, a name a DNS subdomain.
_MAX_UID = 128
_MAX_NAMESPACE = 63
_MAX_NAME = 253
# Always fullmatch: `$` also matches before a trailing newline.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# API reads at once. Below the server's MAX_CONCURRENT_RPCS (16, one worker thread each), so Unprepares
# and checkpoint answers always find a free worker however slow the API server is.
MAX_API_READS = 8


class ClaimReader(Protocol):
    """Reads a resource.k8s.io/v1 ResourceClaim as JSON; raises `gputopo.kube.KubeError` (404: none)."""

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    uid: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimError(Exception):
    """Preparing one claim failed; the message is the claim's error as the kubelet shows it."""


def _check_ref(ref: ClaimRef) -> None:
    missing = [f for f in ("uid", "namespace", "name") if not getattr(ref, f)]
    if missing:
        raise ClaimError(f"claim {ref.namespace!r}/{ref.name!r} (uid {ref.uid!r}): {', '.join(missing)} required")
    for field, limit in (("uid", _MAX_UID), ("namespace", _MAX_NAMESPACE), ("name", _MAX_NAME)):
        if len(getattr(ref, field)) > limit:
            raise ClaimError(f"claim {field} is longer than {limit} characters")
    if "/" in ref.namespace or "/" in ref.name:
        raise ClaimError(f"claim {ref.namespace!r}/{ref.name!r}: a namespace or name has no '/'")
    if not CLAIM_UID.fullmatch(ref.uid):
        raise ClaimError(f"claim uid {ref.uid!r} is not a Kubernetes uid (letters, digits, '-', '_', '.', ':')")
    if not _DNS_LABEL.fullmatch(ref.namespace):
        raise ClaimError(f"claim namespace {ref.namespace!r} is not a DNS label")
    if not _DNS_SUBDOMAIN.fullmatch(ref.name):
        raise ClaimError(f"claim name {ref.name!r} is not a DNS subdomain")


def _results(claim: Mapping[str, Any]) -> list[Any]:
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(allocation, Mapping):
        raise ClaimError("it is not allocated")
    return list(results) if isinstance(results, list) else []


class DraDriver:
    """The prepared claims of one node; thread-safe (the kubelet may call concurrently)."""

    def __init__(
        self,
        node: str,
        reader: ClaimReader,
        checkpoint: Checkpoint,
        cdi: CdiWriter,
        topology: NodeTopology,
        driver: str = DRIVER,
    ) -> None:
        self.node = node
        self.driver = driver
        self._reader = reader
        self._checkpoint = checkpoint
        self._cdi = cdi
        self._lock = threading.Lock()
        self._topology = topology
        self.api_reads = 0
        self._reads = threading.BoundedSemaphore(MAX_API_READS)
        # Per claim uid with a Prepare reading the API: [Prepares in flight, Unprepares seen meanwhile].
        self._inflight: dict[str, list[int]] = {}
        self.node_spec_error = ""  # why the node's CDI spec is not written ('' when it is)
        # Called, outside the lock, after a claim is newly prepared or unprepared: the GPUs in use changed.
        self.on_change: Callable[[], None] | None = None
        # Whether the block over a GPU mask is published now (the plugin's, with --dra-blocks): none by default.
        self.blocks_published: Callable[[int], bool] = lambda _mask: False
        try:
            removed = cdi.remove_orphans(checkpoint.claims().keys())
        except OSError as e:
            log.error("cannot list the CDI directory for stale claim specs", extra={"error": str(e)})
        else:
            if removed:
                log.warning("removed CDI specs of claims not checkpointed", extra={"claims": removed})
        with self._lock:
            self._write_node()

    def _write_node(self) -> None:
        """Under the lock. A failure (a full or read-only CDI directory) is logged and kept: the next
        discovery cycle and every Prepare try again, so the agent starts and serves Unprepare meanwhile."""
        try:
            written = self._cdi.write_node(self._topology)
        except (OSError, ValueError) as e:
            if not self.node_spec_error:
                log.error("cannot write the CDI spec of the node's GPUs; retrying", extra={"error": str(e)})
            self.node_spec_error = f"{type(e).__name__}: {e}"
            return
        if self.node_spec_error:
            log.info("CDI spec of the node's GPUs written after all", extra={"dir": str(self._cdi.cdi_dir)})
        elif written:
            log.info("CDI spec for the node's GPUs written", extra={"dir": str(self._cdi.cdi_dir)})
        self.node_spec_error = ""

    def update(self, topology: NodeTopology) -> None:
        """A discovery cycle's topology: new GPUs and health for later Prepares, the CDI spec rewritten on change."""
        with self._lock:
            self._topology = topology
            self._write_node()

    def prepared(self) -> Mapping[str, PreparedClaim]:
        with self._lock:
            return self._checkpoint.claims()

    def in_use(self) -> frozenset[int]:
        """The GPUs (indices) the prepared claims hold on this node."""
        out: set[int] = set()
        for claim in self.prepared().values():
            for d in claim.devices:
                if d.pool_name == self.node:
                    out.update(device_gpus(d.device_name) or ())  # a block is its GPUs
        return frozenset(out)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # the slice's order is an optimisation: never fail a claim over it
                log.exception("re-publishing after a claim's change failed")

    # ------------------------------------------------------------------ Prepare

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        out: dict[str, PrepareResult] = {}
        before = self._prepared_uids()
        for ref in refs:
            try:
                out[ref.uid] = PrepareResult(devices=self._prepare_one(ref))
            except ClaimError as e:
                out[ref.uid] = PrepareResult(error=f"{ref}: {e}")
            except Exception as e:  # a bug or an I/O failure must fail this claim only
                log.exception("preparing a claim failed", extra={"claim": str(ref)})
                out[ref.uid] = PrepareResult(error=f"{ref}: {type(e).__name__}: {e}")
            if out[ref.uid].error:
                log.warning("claim not prepared", extra={"claim": str(ref), "error": out[ref.uid].error})
        if self._prepared_uids() != before:
            self._changed()
        return out

    def _prepared_uids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._checkpoint.claims())

    def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        _check_ref(ref)
        with self._lock:
            done = self._checkpoint.get(ref.uid)
            if done is not None:
                return done.devices
            entry = self._inflight.setdefault(ref.uid, [0, 0])
            entry[0] += 1
            unprepares = entry[1]
        try:
            results = self._read(ref)
            with self._lock:
                if entry[1] != unprepares:
                    raise ClaimError("unprepared while this Prepare read it from the API server; not prepared")
                done = self._checkpoint.get(ref.uid)  # a concurrent call for the same claim won
                if done is not None:
                    return done.devices
                devices = self._write(ref, results)
        finally:
            with self._lock:
                entry[0] -= 1
                if entry[0] == 0 and self._inflight.get(ref.uid) is entry:
                    del self._inflight[ref.uid]
        log.info("claim prepared", extra={"claim": str(ref), "devices": [d.device_name for d in devices]})
        return devices

    def _read(self, ref: ClaimRef) -> list[Any]:
        """The claim's allocation results, read from the API server outside the lock."""
        if not self._reads.acquire(blocking=False):
            raise ClaimError(f"{MAX_API_READS} claims are being read from the API server already; retry")
        try:
            self.api_reads += 1
            claim = self._reader.get_resource_claim(ref.namespace, ref.name)
        except Exception as e:
            if getattr(e, "status", None) == 404:
                raise ClaimError("not found on the API server") from None
            raise ClaimError(f"cannot read it: {short_error(e)}") from None
        finally:
            self._reads.release()
        if not isinstance(claim, Mapping):
            raise ClaimError("the API server's answer is not an object")
        meta = claim.get("metadata")
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        if uid != ref.uid:
            raise ClaimError(f"the API server's claim has uid {uid!r} (deleted and created again?)")
        return _results(claim)

    def _write(self, ref: ClaimRef, results: Sequence[Any]) -> tuple[PreparedDevice, ...]:
        """Under the lock: the claim's CDI spec, then its checkpoint entry; on any failure neither stays."""
        if self.node_spec_error:
            self._write_node()  # the claim's devices name the node's spec: it must be there
            if self.node_spec_error:
                raise ClaimError(f"the CDI spec of the node's GPUs cannot be written: {self.node_spec_error}")
        devices, uuids = self._devices(ref.uid, results)
        try:
            self._cdi.write_claim(ref.uid, uuids)
            self._checkpoint.add(PreparedClaim(ref.uid, ref.namespace, ref.name, devices))
        except Exception as e:  # CdiNameError, CheckpointError, OSError (a full disk) alike
            try:
                self._cdi.remove_claim(ref.uid)
            except OSError:
                log.exception("cannot remove the CDI spec of a claim not prepared", extra={"claim": str(ref)})
            raise ClaimError(f"cannot record it: {type(e).__name__}: {e}") from None
        return devices

    def _devices(self, claim_uid: str, results: Sequence[Any]) -> tuple[tuple[PreparedDevice, ...], list[str]]:
        """Under the lock: our results as prepared devices, in allocation order, and their GPUs' UUIDs."""
        gpus = {g.index: g for g in self._topology.gpus}
        if not all(isinstance(r, Mapping) for r in results):
            raise ClaimError("an allocation result is not an object")
        ours = [r for r in results if r.get("driver") == self.driver]
        if not ours:
            raise ClaimError(f"no device of driver {self.driver} is allocated to it")
        # Our devices are node-local: a claim with one elsewhere is not this node's to prepare, not even half.
        elsewhere = sorted({repr(r.get("pool"))[:80] for r in ours if r.get("pool") != self.node})
        if elsewhere:
            pools = ", ".join(elsewhere[:3]) + (f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else "")
            raise ClaimError(f"it is allocated {self.driver} devices of pool {pools}, not this node's ({self.node})")
        by_device: dict[str, tuple[list[str], tuple[str, ...]]] = {}  # device -> (requests, its GPUs' uuids)
        for r in ours:
            name, request = r.get("device"), r.get("request")
            if not isinstance(name, str) or not isinstance(request, str):
                raise ClaimError(f"an allocation result of driver {self.driver} has no device or request name")
            requests, _ = by_device.setdefault(name, ([], self._uuids(name, gpus)))
            if request not in requests:
                requests.append(request)
        self._check_overlap(claim_uid, list(by_device))
        devices: list[PreparedDevice] = []
        # A GPU named twice (a block and one of its own GPUs) is injected once.
        uuids = list(dict.fromkeys(u for _, found in by_device.values() for u in found))
        injected: set[str] = set()
        for i, (name, (requests, found)) in enumerate(by_device.items()):
            try:
                ids = [gpu_device_id(uuid) for uuid in found if uuid not in injected]
                injected.update(found)
                if i == 0:
                    # The claim's NVIDIA_VISIBLE_DEVICES rides on its first device only: the runtime
                    # would apply the same edit once per device otherwise.
                    ids.append(claim_device_id(claim_uid))
            except CdiNameError as e:
                raise ClaimError(f"device {name}: {e}") from None
            devices.append(PreparedDevice(tuple(requests), self.node, name, tuple(ids)))
        return tuple(devices), uuids

    def _uuids(self, name: str, gpus: Mapping[int, Any]) -> tuple[str, ...]:
        """Under the lock: the UUIDs of the GPUs device `name` stands for. A block must be one this node
        publishes now: the allocator never hands out another, a compromised scheduler might."""
        covers = device_gpus(name)
        if covers is None or any(i not in gpus for i in covers):
            raise ClaimError(f"device {name[:80]!r} of pool {self.node} is not a GPU or block of this node")
        if len(covers) > 1 and not self.blocks_published(mask_of(covers)):
            raise ClaimError(f"device {name} is not a block this node publishes (--dra-blocks, its clique's blocks)")
        for i in covers:
            if gpus[i].health is Health.FAILED:
                raise ClaimError(f"device {name} (GPU {i}, {gpus[i].uuid}) has failed")
        return tuple(str(gpus[i].uuid) for i in covers)

    def _check_overlap(self, claim_uid: str, names: Sequence[str]) -> None:
        """Under the lock: a claim with a block shares no GPU with another prepared claim, nor does a
        claim share one with another's block (counters make the allocator never do either)."""
        mine = {g for n in names for g in device_gpus(n) or ()}
        has_block = any(len(device_gpus(n) or ()) > 1 for n in names)
        for uid, other in self._checkpoint.claims().items():
            if uid == claim_uid:
                continue
            theirs = [device_gpus(d.device_name) or () for d in other.devices if d.pool_name == self.node]
            shared = mine & {g for covers in theirs for g in covers}
            if shared and (has_block or any(len(c) > 1 for c in theirs)):
                raise ClaimError(
                    f"its GPUs {sorted(shared)[:8]} are prepared for claim {other.namespace}/{other.name} already, "
                    "and a block shares no GPU"
                )

    # ------------------------------------------------------------------ Unprepare

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Per claim uid, the error ('' when unprepared, or never prepared)."""
        out: dict[str, str] = {}
        before = self._prepared_uids()
        for ref in refs:
            try:
                with self._lock:
                    entry = self._inflight.get(ref.uid)
                    if entry is not None:
                        entry[1] += 1  # a Prepare reading this claim now must not write it back
                    known = self._checkpoint.get(ref.uid) is not None
                    # The checkpoint first: when its write fails the claim stays prepared, spec and all.
                    self._checkpoint.remove(ref.uid)
                    self._cdi.remove_claim(ref.uid)
                out[ref.uid] = ""
                if known:
                    log.info("claim unprepared", extra={"claim": str(ref)})
            except Exception as e:
                log.exception("unpreparing a claim failed", extra={"claim": str(ref)})
                out[ref.uid] = f"{ref}: {type(e).__name__}: {e}"
        if self._prepared_uids() != before:
            self._changed()
        return out
