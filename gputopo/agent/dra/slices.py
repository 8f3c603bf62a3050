"""The node's ResourceSlice (resource.k8s.io/v1): its GPUs as DRA devices, written only on change.

One slice per node and driver, named `<node>-gpu.gputopo.io`: pool = the node's name, `nodeName` the
node, `resourceSliceCount` 1, owned by the Node (deleted with it). The devices are
`gputopo.engine.dra.devices.devices()` in the v1 wire shape: each attribute one of `int`, `bool`, `string`
(`version` unused), a clique list as `strings` (KEP-5491, only with `list_attributes`: the API server
refuses the field without the `DRAListTypeAttributes` gate), HBM as capacity `memory: {value: <n>Mi}`.
A failed GPU carries a NoSchedule device taint when `device_taints` (the cluster serves KEP-5055:
alpha and off in 1.34, GA in 1.37) and is left out of the slice otherwise, so no claim gets it.

With `best_fit_order` the devices are listed so that the allocator's first fit is best fit
(`gputopo.engine.dra.order`, from the GPUs the node's prepared claims hold) and the order is part of
what is compared: a change of the GPUs in use that changes the order costs one write.

Zero writes in steady state (`gputopo.agent.confirmedwrite`'s rules; `SliceTarget` is this object's part):
the desired slice is compared with the API server's, as values (a
quantity the server rewrote as `80Gi` equals our `81920Mi`; a taint's `timeAdded` is the server's).
What the server made of our last write is remembered too, so a field it drops (a gate that is off)
costs one write, not one per cycle. An unchanged slice costs no API call at all until `reverify_s`
passes, or until `reverify()` (the kubelet registered us again: a starting kubelet deletes its node's
slices) asks for a read; a slice deleted under us is then created again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gputopo.agent.confirmedwrite import Confirmed, PublishResult, retry_write
from gputopo.engine.dra.devices import DRIVER, Device, devices
from gputopo.kube import JSON, RESOURCESLICES, Backoff, Kube, node_path, retry
from gputopo.model import NodeTopology, parse_quantity

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
RESOURCESLICES_PATH = RESOURCESLICES.path()
MAX_STRING = 64  # DeviceAttributeMaxValueLength
TAINT_KEY = f"{DRIVER}/health"
TAINT_EFFECT = "NoSchedule"
DEFAULT_BACKOFF = Backoff()


def slice_name(node: str, driver: str = DRIVER) -> str:
    """`<node>-<driver>`, a DNS subdomain like both parts."""
    return f"{node}-{driver}"[:253].rstrip("-.")


def wire_attribute(value: bool | int | str | tuple[str, ...]) -> dict[str, Any]:
    """One attribute in the v1 shape: exactly one of int, bool, string, or (KEP-5491) strings."""
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, str):
        return {"string": value[:MAX_STRING]}
    return {"strings": [v[:MAX_STRING] for v in value]}


def wire_device(device: Device, *, taint: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": device.name,
        "attributes": {k: wire_attribute(v) for k, v in sorted(device.attributes.items())},
        "capacity": {"memory": {"value": f"{device.memory_mib}Mi"}},
    }
    if taint:
        out["taints"] = [{"key": TAINT_KEY, "value": "failed", "effect": TAINT_EFFECT}]
    return out


@dataclass(frozen=True, kw_only=True)
class SliceShape:
    """What this node's slice says and how (module docstring): its `driver`; `list_attributes`, each
    device's cliques as a list attribute; `device_taints`, a failed GPU published with a taint, else left
    out; `best_fit_order`, the devices in best-fit order, else in index order; `blocks`, the NVLink
    cliques also as block devices with counters (`gputopo.agent.dra.pool`)."""

    list_attributes: bool
    device_taints: bool
    driver: str = DRIVER
    best_fit_order: bool = False
    blocks: bool = False


def desired_spec(
    node: str,
    topology: NodeTopology,
    shape: SliceShape,
    *,
    labels: Mapping[str, str] | None = None,
    pcie_roots: Mapping[int, str] | None = None,
    in_use: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The slice's spec without the pool generation (that is the writer's). `in_use`: the GPUs allocated
    now, which order the devices when `shape.best_fit_order` (`gputopo.engine.dra.order`)."""
    wire = []
    order = in_use if shape.best_fit_order else None
    found = devices(topology, list_attributes=shape.list_attributes, labels=labels, pcie_roots=pcie_roots, in_use=order)
    for d in found:
        if d.failed and not shape.device_taints:
            continue
        wire.append(wire_device(d, taint=d.failed))
    return {
        "driver": shape.driver,
        "nodeName": node,
        "pool": {"name": node, "resourceSliceCount": 1},
        "devices": wire,
    }


def _quantity(v: Any) -> Any:
    try:
        return parse_quantity(str(v))
    except Exception:
        return v


def comparable(spec: Mapping[str, Any], *, ordered: bool = False) -> Any:
    """A spec as a value: no pool generation, quantities parsed, the server's taint times dropped,
    and devices by name; their order counts only when `ordered` (best-fit order is meaning: the
    allocator takes the first fit in slice order)."""
    pool = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    devs: dict[str, Any] = {}
    for d in spec.get("devices") or []:
        if not isinstance(d, Mapping):
            continue
        dd = dict(d)
        capacity = dd.get("capacity")
        if isinstance(capacity, Mapping):
            dd["capacity"] = {
                k: {**c, "value": _quantity(c.get("value"))} if isinstance(c, Mapping) else c
                for k, c in capacity.items()
            }
        taints = dd.get("taints")
        if isinstance(taints, list):
            dd["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"} for t in taints if isinstance(t, Mapping)]
        devs[str(dd.get("name"))] = dd
    rest = {k: v for k, v in spec.items() if k not in ("pool", "devices")}
    out = {**rest, "pool": pool, "devices": devs}
    if ordered:
        out["order"] = tuple(devs)
    return out


def _owner(node: str, node_uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}


def _generation(doc: Mapping[str, Any]) -> int:
    g = ((doc.get("spec") or {}).get("pool") or {}).get("generation")
    return g if isinstance(g, int) and not isinstance(g, bool) else 0


class SliceApi(Protocol):
    """The API calls the slice publisher makes; raise `gputopo.kube.KubeError` on failure."""

    def node_uid(self, node: str) -> str: ...

    def get_slice(self, name: str) -> JSON | None:
        """The slice, or None when there is none."""
        ...

    def list_slice_names(self, node: str, driver: str) -> list[str]: ...

    def create_slice(self, body: JSON) -> JSON: ...

    def replace_slice(self, name: str, body: JSON) -> JSON:
        """PUT; body carries metadata.resourceVersion (409 when someone wrote since)."""
        ...

    def delete_slice(self, name: str) -> None: ...


class SliceTarget:
    """The node's ResourceSlice as a publish target: created, or replaced at its resourceVersion (409 when
    someone wrote since the read), with the next pool generation. Its first read looks up the Node's uid
    (the owner) and deletes stray slices of this node and driver once."""

    what = "the ResourceSlice"

    def __init__(
        self,
        api: SliceApi,
        node: str,
        driver: str,
        sleep: Callable[[float], bool],
        backoff: Backoff,
        describe: Mapping[str, Any],
        ordered: bool = False,
    ) -> None:
        self._api = api
        self.ordered = ordered  # device order is part of the slice (best-fit order)
        self.node = node
        self.driver = driver
        self.name = slice_name(node, driver)
        self._sleep = sleep
        self._backoff = backoff
        self._describe = dict(describe)  # the settings a dropped field points at, for the log
        self._node_uid: str | None = None
        self._cleaned = False

    def comparable(self, desired: dict[str, Any]) -> Any:
        return comparable(desired, ordered=self.ordered)

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        return retry(fn, self._backoff, self._sleep, what)

    def read(self) -> JSON | None:
        if self._node_uid is None:
            self._node_uid = str(self._call(lambda: self._api.node_uid(self.node), "get node"))
        if not self._cleaned:
            self._remove_strays()
        current: JSON | None = self._call(lambda: self._api.get_slice(self.name), "get resourceslice")
        return current

    def holds(self, current: JSON | None, want: Any) -> Any:
        if current is None:
            return None
        owners = (current.get("metadata") or {}).get("ownerReferences") or []
        if not any(isinstance(o, Mapping) and o.get("uid") == self._node_uid for o in owners):
            return None  # another owner's (or none): replaced by ours
        return comparable(current.get("spec") or {}, ordered=self.ordered)

    def write(self, current: JSON | None, desired: dict[str, Any]) -> Any:
        body = self._body(desired, _generation(current) + 1 if current else 1)
        if current is None:
            answer = retry_write(
                lambda: self._api.create_slice(body), self._backoff, self._sleep, "create resourceslice"
            )
        else:
            body["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
            replace = lambda: self._api.replace_slice(self.name, body)  # noqa: E731
            answer = retry_write(replace, self._backoff, self._sleep, "replace resourceslice")
        kept = comparable((answer or {}).get("spec") or {}, ordered=self.ordered)
        if kept != comparable(desired, ordered=self.ordered):
            log.info("the ResourceSlice as the API server kept it", extra={"slice": self.name, **self._describe})
        log.info("published the ResourceSlice", extra={"slice": self.name, "devices": len(desired["devices"])})
        return kept

    def _body(self, spec: dict[str, Any], generation: int) -> JSON:
        assert self._node_uid is not None
        full = {**spec, "pool": {**spec["pool"], "generation": generation}}
        return {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": self.name, "ownerReferences": [_owner(self.node, self._node_uid)]},
            "spec": full,
        }

    def _delete(self, name: str) -> None:
        self._call(lambda: self._api.delete_slice(name), "delete resourceslice")

    def _remove_strays(self) -> None:
        """Once: other slices of this driver on this node (an earlier naming) would double its devices."""
        names: list[str] = self._call(lambda: self._api.list_slice_names(self.node, self.driver), "list resourceslices")
        for stray in (n for n in names if n != self.name):
            self._delete(stray)
            log.info("deleted a stray ResourceSlice of this node", extra={"slice": stray})
        self._cleaned = True


class SlicePublisher:
    """This node's ResourceSlice, published through `gputopo.agent.confirmedwrite.Confirmed`."""

    def __init__(
        self,
        api: SliceApi,
        node: str,
        shape: SliceShape,
        *,
        sleep: Callable[[float], bool],
        backoff: Backoff = DEFAULT_BACKOFF,
        reverify_s: float = 60.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.shape = shape
        self.driver = shape.driver
        self.name = slice_name(node, shape.driver)
        self._slice = Confirmed(self._target(api, sleep, backoff), reverify_s, monotonic)

    def _target(self, api: SliceApi, sleep: Callable[[float], bool], backoff: Backoff) -> Any:
        """What `Confirmed` writes through: here the one slice."""
        describe = {"list_attributes": self.shape.list_attributes, "taints": self.shape.device_taints}
        describe["best_fit_order"] = self.shape.best_fit_order
        return SliceTarget(api, self.node, self.driver, sleep, backoff, describe, ordered=self.shape.best_fit_order)

    @property
    def writes(self) -> int:
        return self._slice.writes

    def reverify(self, window_s: float = 30.0) -> None:
        """Read the slice back on every publish for `window_s`: the kubelet just registered us, and a
        starting kubelet deletes its node's slices in the background, maybe after our next read."""
        self._slice.reverify(window_s)

    def publish(
        self,
        topology: NodeTopology,
        labels: Mapping[str, str] | None = None,
        pcie_roots: Mapping[int, str] | None = None,
        in_use: frozenset[int] = frozenset(),
    ) -> PublishResult:
        """Publish the slice; `in_use` (the GPUs allocated now) orders it when `best_fit_order`."""
        spec = desired_spec(self.node, topology, self.shape, labels=labels, pcie_roots=pcie_roots, in_use=in_use)
        return self._slice.publish(spec)


# --------------------------------------------------------------------------------------------------
# The real API


def resourceslice_path(name: str = "") -> str:
    return RESOURCESLICES.path(name=name)


class KubeSliceApi:
    """SliceApi on the project's Kubernetes layer."""

    def __init__(self, kube: Kube) -> None:
        self._api = kube

    def node_uid(self, node: str) -> str:
        uid = (self._api.get(node_path(node)).get("metadata") or {}).get("uid")
        if not uid:
            raise ValueError(f"Node {node} has no uid")
        return str(uid)

    def get_slice(self, name: str) -> JSON | None:
        try:
            return self._api.get(resourceslice_path(name))
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return None
            raise

    def list_slice_names(self, node: str, driver: str) -> list[str]:
        items, _ = self._api.list_items(
            RESOURCESLICES_PATH, field_selector=f"spec.nodeName={node},spec.driver={driver}"
        )
        return [str((i.get("metadata") or {}).get("name")) for i in items]

    def create_slice(self, body: JSON) -> JSON:
        return self._api.create(RESOURCESLICES_PATH, body)

    def replace_slice(self, name: str, body: JSON) -> JSON:
        return self._api.request("PUT", resourceslice_path(name), body)

    def delete_slice(self, name: str) -> None:
        try:
            self._api.delete(resourceslice_path(name))
        except Exception as e:
            if getattr(e, "status", None) != 404:
                raise
