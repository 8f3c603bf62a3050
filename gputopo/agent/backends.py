"""Where a node's topology and its GPUs in use come from, behind one protocol each.

Topology backends (`--backend`): `nvml` (NVML plus sysfs NICs), `fixture:NAME` (a named real system
from gputopo.systems) and `file:PATH` (a gputopo.io/topology document, re-read every cycle so tests
can change it mid-run). GPUs in use, per pod: the kubelet PodResources API on real nodes, or `--in-use-file` (a
gputopo.io/gpus-in-use value, either version, re-read every cycle) for simulated ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gputopo.agent.nvml_backend import NvmlAdapter, NvmlDiscoveryError, load_pynvml
from gputopo.agent.nvml_lib import NvmlLib
from gputopo.agent.sysfs import read_nics
from gputopo.model import (
    GPU_RESOURCE,
    AnnotationError,
    GpusInUse,
    NodeTopology,
    parse_gpus_in_use_report,
    parse_topology,
)
from gputopo.systems import SYSTEMS, VARIANTS, UnknownSystemError, build_system

log = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """Discovery failed this cycle (unreadable file, NVML error); the loop keeps running."""


class BackendSpecError(ValueError):
    """A `--backend` value that names no backend."""


class TopologyBackend(Protocol):
    @property
    def description(self) -> str: ...

    def discover(self) -> NodeTopology: ...

    def close(self) -> None: ...


class FixtureBackend:
    """A named real system; GPU UUIDs derive from the node name, so simulated nodes differ."""

    def __init__(self, system: str, node_name: str) -> None:
        if system not in SYSTEMS and system not in VARIANTS:
            raise BackendSpecError(str(UnknownSystemError(system)))
        self._system = system
        self._node = node_name

    @property
    def description(self) -> str:
        return f"fixture:{self._system}"

    def discover(self) -> NodeTopology:
        return build_system(self._system, self._node)

    def close(self) -> None:
        pass


class FileBackend:
    """A gputopo.io/topology JSON document on disk, re-read on every call."""

    def __init__(self, path: Path) -> None:
        self._path = path

    @property
    def description(self) -> str:
        return f"file:{self._path}"

    def discover(self) -> NodeTopology:
        try:
            text = self._path.read_text()
        except OSError as e:
            raise BackendError(f"cannot read topology file {self._path}: {e.strerror or e}") from None
        try:
            return parse_topology(text)
        except AnnotationError as e:
            raise BackendError(f"topology file {self._path}: {e.why}") from None

    def close(self) -> None:
        pass


class NvmlBackend:
    """NVML for GPUs, links and health; sysfs for the RDMA NICs and their PCIe distances."""

    def __init__(self, sysfs_root: Path, lib: NvmlLib | None = None) -> None:
        self._sysfs = sysfs_root
        self._adapter = NvmlAdapter(lib if lib is not None else load_pynvml(), sysfs_root)
        self._adapter.open()  # fail at start, with one clear message, when there is no driver
        self._logged_notes: set[str] = set()

    @property
    def description(self) -> str:
        return "nvml"

    def discover(self) -> NodeTopology:
        try:
            result = self._adapter.discover()
        except NvmlDiscoveryError as e:
            raise BackendError(str(e)) from None
        for note in result.notes:
            if note not in self._logged_notes:  # once per process: these do not change
                self._logged_notes.add(note)
                log.info("NVML call not supported on this GPU; treated as absent", extra={"call": note})
        topo = result.topology
        nics = read_nics(self._sysfs, [g.pci_bus_id for g in topo.gpus], [g.numa_node for g in topo.gpus])
        return topo.model_copy(update={"nics": nics})

    def close(self) -> None:
        self._adapter.close()


def make_backend(
    spec: str, node_name: str, sysfs_root: Path, nvml_lib: Callable[[], NvmlLib] | None = None
) -> TopologyBackend:
    """Build the backend named by `--backend`; raise BackendSpecError for an unknown name."""
    kind, _, arg = spec.partition(":")
    if kind == "nvml" and not arg:
        return NvmlBackend(sysfs_root, nvml_lib() if nvml_lib else None)
    if kind == "fixture" and arg:
        return FixtureBackend(arg, node_name)
    if kind == "file" and arg:
        return FileBackend(Path(arg))
    raise BackendSpecError(f"unknown backend {spec!r}; use nvml, fixture:NAME or file:PATH")


# --------------------------------------------------------------------------------------------------
# GPUs in use


class InUseError(RuntimeError):
    """The GPUs in use could not be read this cycle; the published value is left as it is."""


class InUseSource(Protocol):
    def gpus_in_use(self, topology: NodeTopology) -> GpusInUse: ...

    def close(self) -> None: ...


class _HasUid(Protocol):
    @property
    def uid(self) -> str: ...


class PodLookup(Protocol):
    """What attribution needs of the node-local pod view (gputopo.agent.pods.LocalPods satisfies it)."""

    def get(self, namespace: str, name: str) -> _HasUid | None: ...

    def refresh(self) -> None: ...


class NoneInUse:
    """Simulated nodes without an in-use file: nothing is in use."""

    def gpus_in_use(self, topology: NodeTopology) -> GpusInUse:
        return GpusInUse()

    def close(self) -> None:
        pass


class InUseFile:
    """A gputopo.io/gpus-in-use value on disk (a list of indices, or the per-pod version 2 object),
    re-read every cycle; a missing file means none in use."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def gpus_in_use(self, topology: NodeTopology) -> GpusInUse:
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return GpusInUse()
        except OSError as e:
            raise InUseError(f"cannot read in-use file {self._path}: {e.strerror or e}") from None
        try:
            return parse_gpus_in_use_report(text.strip() or "[]", len(topology.gpus))
        except AnnotationError as e:
            raise InUseError(f"in-use file {self._path}: {e.why}") from None

    def close(self) -> None:
        pass


class PodResourcesInUse:
    """GPUs allocated to containers per the kubelet, mapped from UUIDs to this node's indices and from
    (namespace, name) to pod UIDs through `pods`; without `pods` (or for pods it does not know yet)
    the GPUs are reported as `other`."""

    def __init__(
        self, socket_path: Path, timeout_s: float = 5.0, pods: PodLookup | None = None, resource: str = GPU_RESOURCE
    ) -> None:
        from gputopo.agent.podresources.client import PodResourcesClient  # grpc loads only where it is used

        self._client = PodResourcesClient(socket_path, timeout_s, resource)
        self._pods = pods
        self._reported_unknown: set[str] = set()
        self._unattributed: frozenset[tuple[str, str]] = frozenset()

    def _uid(self, namespace: str, name: str) -> str | None:
        if self._pods is None:
            return None
        pod = self._pods.get(namespace, name)
        return None if pod is None else pod.uid

    def gpus_in_use(self, topology: NodeTopology) -> GpusInUse:
        from gputopo.agent.podresources.client import PodResourcesError, per_pod_in_use

        try:
            allocation = self._client.gpu_allocation()
        except PodResourcesError as e:
            raise InUseError(str(e)) from None
        index = {g.uuid: g.index for g in topology.gpus}
        report, unknown, unattributed = per_pod_in_use(allocation, index, self._uid)
        if self._pods is not None and set(unattributed) - self._unattributed:
            # A pod the local view has not seen yet (just admitted): look again now rather than
            # publish it as `other` for a cycle. Pods that stay unknown do not trigger this again.
            self._pods.refresh()
            report, unknown, unattributed = per_pod_in_use(allocation, index, self._uid)
        self._unattributed = frozenset(unattributed)
        new_unknown = set(unknown) - self._reported_unknown
        if new_unknown:
            self._reported_unknown |= new_unknown
            log.warning("device ids in use that name no GPU of this node", extra={"ids": sorted(new_unknown)})
        return report

    def close(self) -> None:
        self._client.close()
