"""Which ResourceClaimTemplates are NVIDIA ComputeDomains' IMEX channel templates (the ResourceClaimTemplates
informer), and so which ComputeDomain a pod's claims join.

NVIDIA's DRA driver makes one such template per ComputeDomain (`spec.channel.resourceClaimTemplate.name`, in
the ComputeDomain's namespace): one request of the device class `compute-domain-default-channel.nvidia.com`.
A pod joins the ComputeDomain by naming the template in `spec.resourceClaims`; gputopo names the
ComputeDomain `namespace/template`. The driver labels its templates, and each node whose channel serves a
ComputeDomain, with `resource.nvidia.com/computeDomain` = the ComputeDomain's UID; the extender joins the
nodes' labels to the pods bound (gputopo.engine.gang.imex.with_driver_labels), naming each UID from its owner
(`compute_domain_of`):

- where the API server serves ComputeDomains, only the ComputeDomain object of that UID names it: its
  namespace and its `spec.channel.resourceClaimTemplate.name`. A template's label, which anyone who may
  create a template in any namespace can write, names nothing; a UID no ComputeDomain has stays `UID <uid>`.
- where it does not (no NVIDIA driver: nothing labels nodes but people), a UID is named by the channel
  template that carries it only when no template of another namespace carries it too.

Tables are bounded per namespace (`max_per_namespace` templates and ComputeDomains each): one namespace
filling its share leaves every other namespace's facts read.

Where the API server serves ComputeDomains (`resource.nvidia.com/v1beta1`) and the chart grants them, each
one's `spec.numNodes` is read by its channel template (`ComputeDomainSizes`): a ComputeDomain none of whose
pods is placed asks its first pod for an NVLink domain with room for that many nodes. Not read: their status,
nor whether a node's IMEX daemon is ready.

Until the templates have been listed once, a pod that names a template other than gputopo's waits with that
reason rather than being placed as a pod of no ComputeDomain. A template not seen after the list is no channel
template; when one arrives or changes, the pods naming it are read again (`on_change`: those keys, or None
after the first list: every pod that names a template).

Each template is read by the project's one ResourceClaimTemplate reader (`gputopo.model.claimtemplate`): its
channel request and its driver label; one it cannot read is reported as a bad object, naming the field. Each
readable template is also handed to `asks` (gputopo.extender.watch.templateasks: what a hand-written template
asks of gputopo's devices), and a template whose ask changed reads its pods again, as a channel's change does.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gputopo.extender.watch.handlers import Bad, KindHandler, each_readable, object_at
from gputopo.kube import COMPUTEDOMAINS, JSON, RESOURCECLAIMTEMPLATES
from gputopo.model.claimtemplate import CHANNEL_DEVICE_CLASS as CHANNEL_DEVICE_CLASS  # e2e and bench name it here
from gputopo.model.claimtemplate import ClaimTemplateInfo, read_claim_template
from gputopo.model.dra import TEMPLATE_PREFIX

log = logging.getLogger("gputopo.extender.watch.computedomains")

CHANNEL_DRIVER = "compute-domain.nvidia.com"  # the driver of the `channel-0` devices that class selects
# Per namespace, channel templates and ComputeDomains each (one template per ComputeDomain); past it that
# namespace's new ones are not kept (said once per namespace), and no other namespace is affected.
MAX_PER_NAMESPACE = 1024
MAX_NUM_NODES = 65_536  # far past any NVLink domain (NVL576 is 144 trays)

Key = tuple[str, str]  # (namespace, template)


def _identity(obj: Any) -> Key:
    """A namespaced object's (namespace, name); ValueError naming the field."""
    meta = object_at(object_at(obj, "the object").get("metadata"), "metadata")
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        raise ValueError("metadata.name or metadata.namespace is missing or not a string")
    return namespace, name


class PerNamespace:
    """Which keys a table holds, at most `limit` per namespace; `full` is said once per namespace (bounded)."""

    def __init__(self, what: str, limit: int) -> None:
        self.what, self.limit = what, limit
        self.counts: Counter[str] = Counter()
        self._said: set[str] = set()

    def admit(self, key: Key, held: bool) -> bool:
        """Whether `key` may be held (it is already, or its namespace has room); counts it when newly held."""
        if held:
            return True
        namespace = key[0]
        if self.counts[namespace] >= self.limit:
            if namespace not in self._said and len(self._said) < self.limit:
                self._said.add(namespace)
                log.warning(
                    f"namespace holds the most {self.what} read; its later ones are not",
                    extra={"namespace": namespace, "max": self.limit},
                )
            return False
        self.counts[namespace] += 1
        return True

    def release(self, key: Key) -> None:
        self.counts[key[0]] -= 1
        if self.counts[key[0]] <= 0:
            del self.counts[key[0]]

    def clear(self) -> None:
        self.counts.clear()


class AskTable(Protocol):
    """Told of every readable template, as this informer reads it (gputopo.extender.watch.templateasks)."""

    def replace(self, templates: list[ClaimTemplateInfo]) -> set[Key]: ...

    def apply(self, template: ClaimTemplateInfo, *, deleted: bool = False) -> bool: ...


class ChannelTemplates:
    """The channel templates by (namespace, name): a `ChannelReader` over the templates informer (module doc).
    `owners`: the ComputeDomains read from their objects, which alone name a UID where they are served."""

    def __init__(
        self,
        bad: Bad,
        on_change: Callable[[set[Key] | None], None] = lambda keys: None,
        *,
        owners: ComputeDomainSizes | None = None,
        asks: AskTable | None = None,
        max_per_namespace: int = MAX_PER_NAMESPACE,
    ) -> None:
        self._bad = bad
        self.on_change = on_change
        self.owners = owners
        self.asks = asks  # what hand-written templates ask of gputopo's devices (watch/templateasks), fed here
        self.channels: set[Key] = set()
        self._claims: dict[str, set[Key]] = {}  # a ComputeDomain UID (a template's driver label) -> the templates
        self._uid_of: dict[Key, str] = {}
        self._room = PerNamespace("ComputeDomain channel templates", max_per_namespace)
        self.listed = False

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
        """The ComputeDomain (`namespace/template`) of `uid`, from its owner (module doc); None if none is known."""
        if self.owners is not None and self.owners.served:
            return self.owners.named(uid)
        claims = self._claims.get(uid)
        if not claims or len({namespace for namespace, _ in claims}) > 1:
            return None  # claimed from two namespaces: neither is believed
        namespace, name = min(claims)
        return f"{namespace}/{name}"

    def _forget(self, key: Key) -> None:
        uid = self._uid_of.pop(key, None)
        if uid is not None:
            claims = self._claims.get(uid)
            if claims is not None:
                claims.discard(key)
                if not claims:
                    del self._claims[uid]
        if key in self.channels:
            self.channels.discard(key)
            self._room.release(key)

    def _keep(self, key: Key, uid: str | None) -> bool:
        if not self._room.admit(key, key in self.channels):
            return False
        uid_was = self._uid_of.get(key)
        if uid_was != uid:
            if uid_was is not None:
                self._claims[uid_was].discard(key)
                if not self._claims[uid_was]:
                    del self._claims[uid_was]
                del self._uid_of[key]
            if uid is not None:
                self._claims.setdefault(uid, set()).add(key)
                self._uid_of[key] = uid
        self.channels.add(key)
        return True

    def replace(self, items: list[JSON]) -> None:
        before = self.channels
        self.channels, self._claims, self._uid_of = set(), {}, {}
        self._room.clear()
        templates = [t for _, t in each_readable(RESOURCECLAIMTEMPLATES.name, items, read_claim_template, self._bad)]
        for template in templates:
            if template.channel:
                self._keep(template.meta.key, template.meta.compute_domain_uid)
        asked = self.asks.replace(templates) if self.asks is not None else set()
        first, self.listed = not self.listed, True
        if first:
            self.on_change(None)  # every pod that names a template: those waiting for this list among them
        elif before != self.channels or asked:
            self.on_change((before ^ self.channels) | asked)

    def apply(self, event_type: str, obj: JSON) -> None:
        template = read_claim_template(obj)
        key = template.meta.key
        was = key in self.channels
        deleted = event_type == "DELETED"
        if deleted or not template.channel:
            self._forget(key)
        else:
            self._keep(key, template.meta.compute_domain_uid)
        asked = self.asks.apply(template, deleted=deleted) if self.asks is not None else False
        if was != (key in self.channels) or asked:
            self.on_change({key})

    def namespaces_held(self) -> dict[str, int]:
        """How many channel templates each namespace holds here (the per-namespace bound's count)."""
        return dict(self._room.counts)


def compute_domain_size(obj: JSON) -> tuple[Key, Key, int]:
    """A ComputeDomain's (namespace, name), its channel template's (namespace, name) and its numNodes
    (0: not said); ValueError naming the field."""
    namespace, name = _identity(obj)
    spec = object_at(obj.get("spec"), "spec")
    where = "spec.channel.resourceClaimTemplate"
    template = object_at(object_at(spec.get("channel"), "spec.channel").get("resourceClaimTemplate"), where).get("name")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}.name is missing or not a string")
    n = spec.get("numNodes", 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NUM_NODES:
        raise ValueError(f"spec.numNodes is not a whole number from 0 to {MAX_NUM_NODES}")
    return (namespace, name), (namespace, template), n


def object_uid(obj: JSON) -> str | None:
    """An object's metadata.uid (the API server sets it; None in objects made by hand)."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


class ComputeDomainSizes:
    """The ComputeDomains (the ComputeDomains informer, where served): each one's numNodes by its channel
    template, and which ComputeDomain each UID is (`named`). `served`: False while the API server does not
    serve the kind (then no UID is named here: the templates' labels are read instead)."""

    def __init__(self, bad: Bad, *, max_per_namespace: int = MAX_PER_NAMESPACE) -> None:
        self._bad = bad
        self._objects: dict[Key, tuple[Key, int, str | None]] = {}  # ComputeDomain -> (template, numNodes, uid)
        self._sizes: dict[Key, int] = {}  # template -> numNodes (a second ComputeDomain naming it: the latest)
        self._by_uid: dict[str, Key] = {}  # UID -> its channel template (namespace, name)
        self._room = PerNamespace("ComputeDomains", max_per_namespace)
        self.served = True

    def handlers(self) -> dict[str, KindHandler]:
        return {COMPUTEDOMAINS.name: KindHandler(self.replace, self.apply, self.not_served)}

    def num_nodes(self, cd: str) -> int:
        """The numNodes of ComputeDomain `cd` (`namespace/template`); 0 when unknown or not said."""
        namespace, _, template = cd.partition("/")
        return self._sizes.get((namespace, template), 0)

    def named(self, uid: str) -> str | None:
        """The ComputeDomain (`namespace/template`) whose object has `uid`; None when none has."""
        key = self._by_uid.get(uid)
        return f"{key[0]}/{key[1]}" if key is not None else None

    def _put(self, obj: Key, template: Key, n: int, uid: str | None) -> None:
        if not self._room.admit(obj, obj in self._objects):
            return
        self._drop(obj, release=False)
        self._objects[obj] = (template, n, uid)
        self._sizes[template] = n
        if uid is not None:
            self._by_uid[uid] = template

    def _drop(self, obj: Key, *, release: bool = True) -> None:
        old = self._objects.pop(obj, None)
        if old is None:
            return
        if release:
            self._room.release(obj)
        template, _, uid = old
        if uid is not None and self._by_uid.get(uid) == template:
            del self._by_uid[uid]
        # Another ComputeDomain naming the same template (NVIDIA's controller would refuse it) keeps its size.
        others = [n for t, n, _ in self._objects.values() if t == template]
        if others:
            self._sizes[template] = others[-1]
        else:
            self._sizes.pop(template, None)

    def replace(self, items: list[JSON]) -> None:
        self._objects, self._sizes, self._by_uid = {}, {}, {}
        self._room.clear()
        self.served = True
        for obj, (key, template, n) in each_readable(COMPUTEDOMAINS.name, items, compute_domain_size, self._bad):
            self._put(key, template, n, object_uid(obj))

    def apply(self, event_type: str, obj: JSON) -> None:
        key, template, n = compute_domain_size(obj)
        if event_type == "DELETED":
            self._drop(key)
        else:
            self._put(key, template, n, object_uid(obj))

    def not_served(self) -> None:
        """The API server does not serve ComputeDomains (no NVIDIA driver): none exist."""
        self.replace([])
        self.served = False

    def namespaces_held(self) -> dict[str, int]:
        """How many ComputeDomains each namespace holds here (the per-namespace bound's count)."""
        return dict(self._room.counts)
