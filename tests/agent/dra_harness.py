"""Stand-ins for the API server's ResourceClaims and ResourceSlices (unit level: the KubeClient-shaped
protocols the DRA driver uses), and a DRA driver served on real unix sockets in a tmp directory."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gputopo.agent.dra.api import dra_v1_pb2_grpc, dra_v1beta1_pb2_grpc, pluginregistration_pb2_grpc
from gputopo.agent.dra.plugin import DraConfig, DraPlugin
from gputopo.engine.dra.devices import DRIVER
from gputopo.kube import KubeError
from gputopo.model import NodeTopology
from tests.agent.dp_harness import NODE


def claim_object(
    uid: str,
    devices: Sequence[str | tuple[str, str]] = ("gpu-0",),
    *,
    namespace: str = "default",
    name: str | None = None,
    driver: str = DRIVER,
    pool: str = NODE,
    allocated: bool = True,
) -> dict[str, Any]:
    """A ResourceClaim allocated `devices` (names, or (request, name)) of `driver` in `pool`."""
    results = []
    for d in devices:
        request, dev = d if isinstance(d, tuple) else ("gpus", d)
        results.append({"request": request, "driver": driver, "pool": pool, "device": dev})
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name or f"claim-{uid}", "namespace": namespace, "uid": uid},
        "spec": {},
    }
    if allocated:
        claim["status"] = {"allocation": {"devices": {"results": results}}}
    return claim


@dataclass
class FakeClaims:
    """ClaimReader: claims by (namespace, name); counts reads."""

    claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    reads: int = 0
    error: Exception | None = None

    def add(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim
        return claim

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        found = self.claims.get((namespace, name))
        if found is None:
            raise KubeError(404, f"resourceclaims {name!r} not found", "NotFound")
        return copy.deepcopy(found)


@dataclass
class FakeSlices:
    """SliceApi over a dict, counting writes; `rewrite` changes what is stored as the server would."""

    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_uids: dict[str, str] = field(default_factory=lambda: {NODE: "node-uid-1"})
    writes: int = 0
    reads: int = 0
    strip_taints: bool = False  # a cluster without DRADeviceTaints drops the field
    canonical_quantities: bool = True  # the server writes 81920Mi back as 80Gi
    strip_counters: bool = False  # a cluster without DRAPartitionableDevices drops the counter fields
    _rv: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def node_uid(self, node: str) -> str:
        return self.node_uids[node]

    def get_slice(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            self.reads += 1
            found = self.slices.get(name)
            return copy.deepcopy(found) if found is not None else None

    def list_slice_names(self, node: str, driver: str) -> list[str]:
        with self.lock:
            return [
                n for n, s in self.slices.items() if s["spec"]["nodeName"] == node and s["spec"]["driver"] == driver
            ]

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(body)
        self._rv += 1
        doc["metadata"]["resourceVersion"] = str(self._rv)
        if self.strip_counters:
            doc["spec"].pop("sharedCounters", None)
        for d in doc["spec"].get("devices", []):
            if self.strip_counters:
                d.pop("consumesCounters", None)
            if self.strip_taints:
                d.pop("taints", None)
            for t in d.get("taints", []):
                t.setdefault("timeAdded", "2026-01-01T00:00:00Z")
            mem = d.get("capacity", {}).get("memory")
            if mem and self.canonical_quantities and mem["value"].endswith("Mi"):
                mib = int(mem["value"][:-2])
                mem["value"] = f"{mib // 1024}Gi" if mib % 1024 == 0 else mem["value"]
        self.slices[doc["metadata"]["name"]] = doc
        self.writes += 1
        return copy.deepcopy(doc)

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if body["metadata"]["name"] in self.slices:
                raise KubeError(409, "already exists", "AlreadyExists")
            return self._store(body)

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            cur = self.slices.get(name)
            if cur is None:
                raise KubeError(404, "not found", "NotFound")
            if body["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
                raise KubeError(409, "the object has been modified", "Conflict")
            return self._store(body)

    def delete_slice(self, name: str) -> None:
        with self.lock:
            self.slices.pop(name, None)


@dataclass
class Running:
    plugin: DraPlugin
    claims: FakeClaims
    slices: FakeSlices
    config: DraConfig
    channel_dra: grpc.Channel
    channel_reg: grpc.Channel

    @property
    def v1(self) -> dra_v1_pb2_grpc.DRAPluginStub:
        return dra_v1_pb2_grpc.DRAPluginStub(self.channel_dra)

    @property
    def v1beta1(self) -> dra_v1beta1_pb2_grpc.DRAPluginStub:
        return dra_v1beta1_pb2_grpc.DRAPluginStub(self.channel_dra)

    @property
    def registration(self) -> pluginregistration_pb2_grpc.RegistrationStub:
        return pluginregistration_pb2_grpc.RegistrationStub(self.channel_reg)


def dra_config(tmp: Path, **changes: Any) -> DraConfig:
    root = tmp / "root"
    (root / "dev").mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "node": NODE,
        "plugins_dir": tmp / "plugins",
        "registry_dir": tmp / "registry",
        "cdi_dir": tmp / "cdi",
        "sysfs_root": None,
        "dev_root": root,
        "poll_s": 0.05,
    }
    values.update(changes)
    return DraConfig(**values)


@contextmanager
def running_dra(
    tmp: Path,
    topo: NodeTopology,
    claims: FakeClaims | None = None,
    slices: FakeSlices | None = None,
    **config: Any,
) -> Iterator[Running]:
    claims = claims if claims is not None else FakeClaims()
    slices = slices if slices is not None else FakeSlices()
    cfg = dra_config(tmp, **config)
    plugin = DraPlugin(cfg, claims, slices, sleep=lambda _s: True)
    plugin.start(topo)
    assert plugin.server is not None
    dra = grpc.insecure_channel(f"unix://{plugin.server.dra_socket.absolute()}")
    reg = grpc.insecure_channel(f"unix://{plugin.server.registration_socket.absolute()}")
    try:
        yield Running(plugin, claims, slices, cfg, dra, reg)
    finally:
        dra.close()
        reg.close()
        plugin.stop()
