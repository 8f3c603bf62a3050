"""The node's pool with clique blocks (`--dra-blocks`): a counters slice and one or two device slices.

A block (`gputopo.engine.dra.blocks`) is a partitionable device (KEP-4815, beta and on by default
since Kubernetes 1.36): the pool's counters slice `<node>-gpu.gputopo.io-counters` carries one counter
set, `gpus`, with one counter per GPU of value 1 (since 1.35 a slice with `sharedCounters` carries no
devices); in the device slices every single GPU consumes its own counter and every block its GPUs'
counters, so the allocator never hands out two devices that share a GPU. The devices are the singles,
then the blocks by size, in chunks of 64 (the per-slice limit when devices consume counters): the
first slice keeps the name of the singles-only slice, `<node>-gpu.gputopo.io`, the second appends
`-1`, so the allocator's first fit (slices by name, devices in slice order) walks them in that order.

**Counters dropped.** Where the gate is off (alpha, off, before 1.36) the API server drops
`sharedCounters` and `consumesCounters` on write: a block published there would be allocatable
together with its own GPUs. Every write is checked against what the server stored (the write's
answer); the counters slice is written first, so a cluster that drops the fields is found before any
block is written. Then, and when a device slice comes back without its counters, the pool is written
again at once with the singles only, `counters_dropped` is set (the agent's metric
`gputopo_agent_dra_counters_dropped` shows it), and no block is published until the agent restarts.

**Generations.** Every slice of the pool carries the pool's generation; the allocator reads only the
slices of the highest one, and a pool with fewer of them than `resourceSliceCount` as incomplete. A
change of one device slice alone (best-fit order after a Prepare) keeps the generation and costs one
write; any other change (the counters, the slice count, several slices) writes every slice with the
next generation, the counters slice first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from gputopo.agent.confirmedwrite import PublishResult, retry_write
from gputopo.agent.dra.slices import (
    API_VERSION,
    SliceApi,
    SlicePublisher,
    SliceShape,
    _owner,
    comparable,
    desired_spec,
    slice_name,
    wire_device,
)
from gputopo.engine.dra.blocks import block_devices
from gputopo.kube import JSON, Backoff, retry
from gputopo.model import NodeTopology
from gputopo.model.dra import COUNTER_SET, counter_name, device_gpus

log = logging.getLogger(__name__)

MAX_DEVICES_WITH_COUNTERS = 64  # resource.k8s.io/v1: devices per slice when any consumes counters
COUNTERS_PART = "counters"

Pool = dict[str, dict[str, Any]]  # slice name -> spec (without the pool's generation)


def part_name(node: str, driver: str, part: str) -> str:
    """The pool's slice `part` ('' for the first device slice, '1', 'counters'): a DNS subdomain."""
    base = slice_name(node, driver)
    if not part:
        return base
    return f"{base[: 252 - len(part)].rstrip('-.')}-{part}"


def _consumes(gpus: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"counterSet": COUNTER_SET, "counters": {counter_name(g): {"value": "1"} for g in gpus}}]


def desired_pool(
    node: str,
    topology: NodeTopology,
    shape: SliceShape,
    *,
    labels: Mapping[str, str] | None = None,
    pcie_roots: Mapping[int, str] | None = None,
    in_use: frozenset[int] = frozenset(),
    blocks: bool = True,
) -> Pool:
    """The pool's slices by name. Without `blocks`, or on a node with no block (no clique of two, more
    than 32 GPUs), the one singles-only slice `desired_spec` gives, as without `--dra-blocks`."""
    singles = desired_spec(node, topology, shape, labels=labels, pcie_roots=pcie_roots, in_use=in_use)
    base = slice_name(node, shape.driver)
    found = block_devices(topology, in_use if shape.best_fit_order else None) if blocks else []
    if not found:
        return {base: singles}
    wire = []
    for d in singles["devices"]:
        gpus = device_gpus(d["name"]) or ()
        wire.append({**d, "consumesCounters": _consumes(gpus)})
    wire += [{**wire_device(b, taint=False), "consumesCounters": _consumes(b.gpus)} for b in found]
    chunks = [wire[i : i + MAX_DEVICES_WITH_COUNTERS] for i in range(0, len(wire), MAX_DEVICES_WITH_COUNTERS)]
    pool = {"name": node, "resourceSliceCount": len(chunks) + 1}
    head = {"driver": shape.driver, "nodeName": node, "pool": pool}
    counters = {counter_name(g.index): {"value": "1"} for g in topology.gpus}
    out: Pool = {
        part_name(node, shape.driver, COUNTERS_PART): {
            **head,
            "sharedCounters": [{"name": COUNTER_SET, "counters": counters}],
        }
    }
    for i, chunk in enumerate(chunks):
        out[part_name(node, shape.driver, str(i) if i else "")] = {**head, "devices": chunk}
    return out


def singles_only(pool: Pool, base: str) -> Pool:
    """`pool` as the singles-only slice: no counters slice, no blocks, nothing consumed."""
    spec = {k: v for k, v in pool[base].items() if k != "devices"}
    devices = [{k: v for k, v in d.items() if k != "consumesCounters"} for d in pool[base].get("devices", [])]
    singles = [d for d in devices if str(d.get("name", "")).startswith("gpu-")]
    return {base: {**spec, "pool": {**spec["pool"], "resourceSliceCount": 1}, "devices": singles}}


def _generation(doc: Mapping[str, Any] | None) -> int:
    g = (((doc or {}).get("spec") or {}).get("pool") or {}).get("generation")
    return g if isinstance(g, int) and not isinstance(g, bool) else 0


def _dropped(sent: Mapping[str, Any], kept: Mapping[str, Any]) -> bool:
    """Whether the server dropped counter fields we sent (a gate that is off)."""
    if sent.get("sharedCounters") and not kept.get("sharedCounters"):
        return True
    kept_devices = {d.get("name"): d for d in kept.get("devices") or [] if isinstance(d, Mapping)}
    return any(
        d.get("consumesCounters") and not (kept_devices.get(d["name"]) or {}).get("consumesCounters")
        for d in sent.get("devices") or []
    )


class PoolTarget:
    """The node's pool of slices as a `gputopo.agent.confirmedwrite.Target`: read (the node's slices of
    this driver), compared slice by slice, written as the module says; slices of the node that the
    desired pool does not name (strays, a counters slice after a fallback) are deleted."""

    what = "the ResourceSlices"

    def __init__(self, api: SliceApi, node: str, driver: str, sleep: Callable[[float], bool], backoff: Backoff) -> None:
        self._api = api
        self.node = node
        self.driver = driver
        self.base = slice_name(node, driver)
        self._sleep = sleep
        self._backoff = backoff
        self._node_uid: str | None = None
        self.counters_dropped = False

    def comparable(self, desired: Pool) -> Any:
        return {name: comparable(spec, ordered=True) for name, spec in desired.items()}

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        return retry(fn, self._backoff, self._sleep, what)

    def read(self) -> dict[str, JSON]:
        if self._node_uid is None:
            self._node_uid = str(self._call(lambda: self._api.node_uid(self.node), "get node"))
        names: list[str] = self._call(lambda: self._api.list_slice_names(self.node, self.driver), "list resourceslices")
        out: dict[str, JSON] = {}
        for name in sorted(names):
            found = self._call(lambda n=name: self._api.get_slice(n), "get resourceslice")  # type: ignore[misc]
            if found is not None:
                out[name] = found
        return out

    def _owned(self, doc: Mapping[str, Any]) -> bool:
        owners = (doc.get("metadata") or {}).get("ownerReferences") or []
        return any(isinstance(o, Mapping) and o.get("uid") == self._node_uid for o in owners)

    def holds(self, current: dict[str, JSON], want: Any) -> Any:
        if not current or not all(self._owned(doc) for doc in current.values()):
            return None
        return {name: comparable(doc.get("spec") or {}, ordered=True) for name, doc in current.items()}

    def write(self, current: dict[str, JSON], desired: Pool) -> Any:
        have = {n: comparable(d.get("spec") or {}, ordered=True) for n, d in current.items() if self._owned(d)}
        want = self.comparable(desired)
        changed = [n for n in desired if have.get(n) != want[n]]
        extra = [n for n in current if n not in desired]
        counters = part_name(self.node, self.driver, COUNTERS_PART)
        generation = max((_generation(d) for d in current.values()), default=0)
        if extra or len(changed) > 1 or counters in changed or any(n not in current for n in desired):
            generation += 1
            changed = sorted(desired, key=lambda n: (n != counters, n))  # every slice, the counters first
        kept = {n: have[n] for n in desired if n not in changed}
        for name in changed:
            answer = self._put(current.get(name), name, desired[name], generation)
            spec = (answer or {}).get("spec") or {}
            if _dropped(desired[name], spec):
                return self._fall_back(desired)
            kept[name] = comparable(spec, ordered=True)
        for name in extra:
            self._call(lambda n=name: self._api.delete_slice(n), "delete resourceslice")  # type: ignore[misc]
        log.info("published the ResourceSlices", extra={"slices": sorted(desired), "generation": generation})
        return kept

    def _fall_back(self, desired: Pool) -> Any:
        self.counters_dropped = True
        log.error(
            "the API server dropped the counters of the clique blocks (DRAPartitionableDevices off?): "
            "publishing single GPUs only, no blocks, until the agent restarts",
            extra={"node": self.node},
        )
        return self.write(self.read(), singles_only(desired, self.base))

    def _put(self, current: JSON | None, name: str, spec: dict[str, Any], generation: int) -> JSON:
        assert self._node_uid is not None
        body: JSON = {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": name, "ownerReferences": [_owner(self.node, self._node_uid)]},
            "spec": {**spec, "pool": {**spec["pool"], "generation": generation}},
        }
        if current is None:
            answer: JSON = retry_write(
                lambda: self._api.create_slice(body), self._backoff, self._sleep, "create resourceslice"
            )
            return answer
        body["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
        replace = lambda: self._api.replace_slice(name, body)  # noqa: E731
        answer = retry_write(replace, self._backoff, self._sleep, "replace resourceslice")
        return answer


class PoolPublisher(SlicePublisher):
    """This node's pool with clique blocks: `SlicePublisher`'s face, written through `PoolTarget`."""

    target: PoolTarget

    def _target(self, api: SliceApi, sleep: Callable[[float], bool], backoff: Backoff) -> PoolTarget:
        self.target = PoolTarget(api, self.node, self.driver, sleep, backoff)
        return self.target

    @property
    def counters_dropped(self) -> bool:
        return self.target.counters_dropped

    def publish(
        self,
        topology: NodeTopology,
        labels: Mapping[str, str] | None = None,
        pcie_roots: Mapping[int, str] | None = None,
        in_use: frozenset[int] = frozenset(),
    ) -> PublishResult:
        """Publish the pool: blocks unless the server dropped their counters (module docstring)."""
        pool = desired_pool(
            self.node,
            topology,
            self.shape,
            labels=labels,
            pcie_roots=pcie_roots,
            in_use=in_use,
            blocks=not self.target.counters_dropped,
        )
        return self._slice.publish(pool)
