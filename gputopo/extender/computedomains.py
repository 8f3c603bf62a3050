"""Which ResourceClaimTemplates are NVIDIA ComputeDomains' IMEX channel templates (the ResourceClaimTemplates
informer), and so which ComputeDomain a pod's claims join.

NVIDIA's DRA driver makes one such template per ComputeDomain (`spec.channel.resourceClaimTemplate.name`, in
the ComputeDomain's namespace): one request of the device class `compute-domain-default-channel.nvidia.com`.
A pod joins the ComputeDomain by naming the template in `spec.resourceClaims`; gputopo names the
ComputeDomain `namespace/template`. The driver labels its templates, and each node whose channel serves a
ComputeDomain, with `resource.nvidia.com/computeDomain` = the ComputeDomain's UID: the templates' label names
the UID on a node (`compute_domain_of`), and the extender joins the nodes' labels to the pods bound
(gputopo.engine.imex.with_driver_labels).

Where the API server serves ComputeDomains (`resource.nvidia.com/v1beta1`) and the chart grants them, each
one's `spec.numNodes` is read by its channel template (`ComputeDomainSizes`): a ComputeDomain none of whose
pods is placed asks its first pod for an NVLink domain with room for that many nodes. Not read: their status,
nor whether a node's IMEX daemon is ready.

Until the templates have been listed once, a pod that names a template other than gputopo's waits with that
reason rather than being placed as a pod of no ComputeDomain. A template not seen after the list is no channel
template; when one arrives or changes, the pods naming it are read again (`on_change`: those keys, or None
after the first list: every pod that names a template).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from gputopo.engine.imex import DRIVER_NODE_LABEL
from gputopo.extender.kindhandlers import Bad, KindHandler, each_readable
from gputopo.kube import COMPUTEDOMAINS, JSON, RESOURCECLAIMTEMPLATES
from gputopo.model.dra import TEMPLATE_PREFIX

log = logging.getLogger("gputopo.extender.computedomains")

CHANNEL_DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"
CHANNEL_DRIVER = "compute-domain.nvidia.com"  # the driver of the `channel-0` devices that class selects
MAX_CHANNEL_TEMPLATES = 65_536  # one per ComputeDomain; past it new ones are not kept (said once)
MAX_REQUESTS = 128  # resource.k8s.io's cap on a claim's requests
MAX_NUM_NODES = 65_536  # far past any NVLink domain (NVL576 is 144 trays)

Key = tuple[str, str]  # (namespace, template)
# (namespace, the templates a pod's claims name) -> (its ComputeDomain or None, why it must wait or "").
ChannelReader = Callable[[str, tuple[str, ...]], tuple[str | None, str]]


def no_channels(_namespace: str, _templates: tuple[str, ...]) -> tuple[str | None, str]:
    """The reader where no templates are watched (snapshot mode, `gputopo explain` offline): no channels."""
    return None, ""


def _map(obj: Any, where: str) -> Mapping[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} is not an object")
    return obj


def _identity(obj: Any) -> Key:
    """A namespaced object's (namespace, name); ValueError naming the field."""
    meta = _map(_map(obj, "the object").get("metadata"), "metadata")
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        raise ValueError("metadata.name or metadata.namespace is missing or not a string")
    return namespace, name


def channel_template(obj: JSON) -> tuple[Key, bool]:
    """A ResourceClaimTemplate's (namespace, name) and whether it asks for a ComputeDomain's IMEX channel
    (a request, exactly or among firstAvailable, of CHANNEL_DEVICE_CLASS); ValueError naming the field."""
    namespace, name = _identity(obj)
    devices = _map(_map(_map(obj.get("spec"), "spec").get("spec"), "spec.spec").get("devices"), "spec.spec.devices")
    requests = devices.get("requests", [])
    if not isinstance(requests, list) or len(requests) > MAX_REQUESTS:
        raise ValueError(f"spec.spec.devices.requests is not a list of at most {MAX_REQUESTS}")
    classes: list[Any] = []
    for i, request in enumerate(requests):
        where = f"spec.spec.devices.requests[{i}]"
        exactly = _map(_map(request, where).get("exactly"), f"{where}.exactly")
        classes.append(exactly.get("deviceClassName"))
        alternatives = request.get("firstAvailable", [])
        if not isinstance(alternatives, list) or len(alternatives) > MAX_REQUESTS:
            raise ValueError(f"{where}.firstAvailable is not a list of at most {MAX_REQUESTS}")
        classes += [_map(a, f"{where}.firstAvailable[]").get("deviceClassName") for a in alternatives]
    return (namespace, name), CHANNEL_DEVICE_CLASS in classes


def template_uid(obj: JSON) -> str | None:
    """The ComputeDomain UID a channel template's `DRIVER_NODE_LABEL` carries; None without one."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    uid = labels.get(DRIVER_NODE_LABEL) if isinstance(labels, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


class ChannelTemplates:
    """The channel templates by (namespace, name): a `ChannelReader` over the templates informer (module doc)."""

    def __init__(self, bad: Bad, on_change: Callable[[set[Key] | None], None] = lambda keys: None) -> None:
        self._bad = bad
        self.on_change = on_change
        self.channels: set[Key] = set()
        self._by_uid: dict[str, Key] = {}  # a channel template's ComputeDomain UID (its driver label) -> it
        self._uid_of: dict[Key, str] = {}
        self.listed = False
        self._full_said = False

    def handlers(self) -> dict[str, KindHandler]:
        return {RESOURCECLAIMTEMPLATES.name: KindHandler(self.replace, self.apply)}

    def __call__(self, namespace: str, templates: tuple[str, ...]) -> tuple[str | None, str]:
        for name in templates:
            if name.startswith(TEMPLATE_PREFIX + "-"):
                continue  # gputopo's own GPU templates
            if (namespace, name) in self.channels:
                return f"{namespace}/{name}", ""
            if not self.listed:
                return None, (
                    f"waiting: ResourceClaimTemplates not read yet (the pod names {namespace}/{name}, which may be "
                    "a ComputeDomain's IMEX channel)"
                )
        return None, ""

    def compute_domain_of(self, uid: str) -> str | None:
        """The ComputeDomain (`namespace/template`) whose channel template carries `uid`; None if none does."""
        key = self._by_uid.get(uid)
        return f"{key[0]}/{key[1]}" if key is not None else None

    def _forget_uid(self, key: Key) -> None:
        uid = self._uid_of.pop(key, None)
        if uid is not None and self._by_uid.get(uid) == key:
            del self._by_uid[uid]

    def _keep(self, key: Key, uid: str | None) -> bool:
        if len(self.channels) < MAX_CHANNEL_TEMPLATES or key in self.channels:
            self.channels.add(key)
            self._forget_uid(key)
            if uid is not None:
                self._by_uid[uid], self._uid_of[key] = key, uid
            return True
        if not self._full_said:
            self._full_said = True
            log.warning("too many ComputeDomain channel templates; later ones are not read", extra={"template": key})
        return False

    def replace(self, items: list[JSON]) -> None:
        before, self.channels, self._by_uid, self._uid_of = self.channels, set(), {}, {}
        for obj, (key, channel) in each_readable(RESOURCECLAIMTEMPLATES.name, items, channel_template, self._bad):
            if channel:
                self._keep(key, template_uid(obj))
        first, self.listed = not self.listed, True
        if first:
            self.on_change(None)  # every pod that names a template: those waiting for this list among them
        elif before != self.channels:
            self.on_change(before ^ self.channels)

    def apply(self, event_type: str, obj: JSON) -> None:
        key, channel = channel_template(obj)
        was = key in self.channels
        if event_type == "DELETED" or not channel:
            self.channels.discard(key)
            self._forget_uid(key)
        elif not self._keep(key, template_uid(obj)):
            return
        if was != (key in self.channels):
            self.on_change({key})


def compute_domain_size(obj: JSON) -> tuple[Key, Key, int]:
    """A ComputeDomain's (namespace, name), its channel template's (namespace, name) and its numNodes
    (0: not said); ValueError naming the field."""
    namespace, name = _identity(obj)
    spec = _map(obj.get("spec"), "spec")
    where = "spec.channel.resourceClaimTemplate"
    template = _map(_map(spec.get("channel"), "spec.channel").get("resourceClaimTemplate"), where).get("name")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}.name is missing or not a string")
    n = spec.get("numNodes", 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NUM_NODES:
        raise ValueError(f"spec.numNodes is not a whole number from 0 to {MAX_NUM_NODES}")
    return (namespace, name), (namespace, template), n


class ComputeDomainSizes:
    """Each ComputeDomain's numNodes by its channel template (the ComputeDomains informer, where served)."""

    def __init__(self, bad: Bad) -> None:
        self._bad = bad
        self._objects: dict[Key, tuple[Key, int]] = {}  # ComputeDomain -> (its template, numNodes)
        self._sizes: dict[Key, int] = {}  # template -> numNodes (a second ComputeDomain naming it: the latest)
        self._full_said = False

    def handlers(self) -> dict[str, KindHandler]:
        return {COMPUTEDOMAINS.name: KindHandler(self.replace, self.apply)}

    def num_nodes(self, cd: str) -> int:
        """The numNodes of ComputeDomain `cd` (`namespace/template`); 0 when unknown or not said."""
        namespace, _, template = cd.partition("/")
        return self._sizes.get((namespace, template), 0)

    def _put(self, obj: Key, template: Key, n: int) -> None:
        if len(self._objects) >= MAX_CHANNEL_TEMPLATES and obj not in self._objects:
            if not self._full_said:
                self._full_said = True
                log.warning("too many ComputeDomains; later ones are not read", extra={"computedomain": obj})
            return
        self._drop(obj)
        self._objects[obj] = (template, n)
        self._sizes[template] = n

    def _drop(self, obj: Key) -> None:
        old = self._objects.pop(obj, None)
        if old is None:
            return
        # Another ComputeDomain naming the same template (NVIDIA's controller would refuse it) keeps its size.
        others = [n for template, n in self._objects.values() if template == old[0]]
        if others:
            self._sizes[old[0]] = others[-1]
        else:
            self._sizes.pop(old[0], None)

    def replace(self, items: list[JSON]) -> None:
        self._objects, self._sizes = {}, {}
        for _, (obj, template, n) in each_readable(COMPUTEDOMAINS.name, items, compute_domain_size, self._bad):
            self._put(obj, template, n)

    def apply(self, event_type: str, obj: JSON) -> None:
        key, template, n = compute_domain_size(obj)
        if event_type == "DELETED":
            self._drop(key)
        else:
            self._put(key, template, n)
