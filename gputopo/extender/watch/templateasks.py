"""What each hand-written ResourceClaimTemplate, and each pre-made ResourceClaim, asks of gputopo's devices
(gputopo.model.claimask), kept as their informers hand them over: the templates informer
(gputopo.extender.watch.computedomains.ChannelTemplates, the one handler of the kind) feeds `TemplateAsks`,
the ResourceClaims informer (gputopo.extender.watch.dramerge) feeds `ClaimAsks`. A pod's claims are read by
the names they give (`TemplateAsks.__call__`, the cache's `AskReader`; dramerge's `read_claims`).

Only objects that ask for gputopo's devices are kept, at most `max_per_namespace` of a kind per namespace:
past it that namespace's later ones are not read (said once), and a pod there naming one not kept is told
so, never placed as if it asked nothing. The names left out are kept too, as many per namespace, so a pod
naming one that asks nothing of gputopo (an IMEX channel's template, another driver's) is read as ever; past
that second bound every object of the namespace not kept is said to be left out. Every other namespace is
unaffected, and one left out and written again unchanged reads no pod again. gputopo's own templates
(`gputopo-gpus-...`, gputopo.engine.dra.claims) are never read here: their pods keep the webhook's path.
Nor are the claims Kubernetes makes from a template or for an extended resource (their annotations say
so): a pod names only a pre-made claim directly, and those are read through their template.
Waiting until the templates are listed once is the channel reader's (one list serves both).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gputopo.extender.watch.computedomains import MAX_PER_NAMESPACE, Key, PerNamespace
from gputopo.model.claimask import NO_ASK, ClaimAsk, pod_ask, read_claim_ask
from gputopo.model.claimtemplate import ClaimTemplateInfo
from gputopo.model.dra import TEMPLATE_PREFIX
from gputopo.model.podspec import short_repr

# Set by Kubernetes on the claims it makes: from a pod's template, or for an extended resource.
MADE_FOR_POD = ("resource.kubernetes.io/pod-claim-name", "resource.kubernetes.io/extended-resource-claim")


def template_ask(template: ClaimTemplateInfo) -> ClaimAsk:
    """What `template` asks of gputopo's devices; nothing for gputopo's own templates."""
    meta = template.meta
    if meta.name.startswith(TEMPLATE_PREFIX + "-"):
        return NO_ASK
    return read_claim_ask(template.devices, f"ResourceClaimTemplate {meta.namespace[:80]}/{meta.name[:80]}")


def claim_ask(obj: Any) -> tuple[Key, ClaimAsk] | None:
    """A ResourceClaim's (namespace, name) and what its `spec.devices` asks of gputopo's devices; nothing for
    a claim Kubernetes made for a pod; None when its name cannot be read."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        return None
    namespace, name = meta.get("namespace") or "default", meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str) or not name:
        return None
    key = (namespace, name)
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping) and any(a in annotations for a in MADE_FOR_POD):
        return key, NO_ASK
    spec = obj.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    if not isinstance(devices, Mapping):
        return key, NO_ASK
    return key, read_claim_ask(devices, f"ResourceClaim {namespace[:80]}/{name[:80]}")


class AskTable:
    """The asks of the objects of one kind that ask for gputopo's devices, by (namespace, name), bounded per
    namespace."""

    kind = "ResourceClaimTemplate"

    def __init__(self, *, max_per_namespace: int = MAX_PER_NAMESPACE) -> None:
        self.asks: dict[Key, ClaimAsk] = {}
        self._room = PerNamespace(f"{self.kind}s asking for gputopo's devices", max_per_namespace)
        # Names of the objects left out since the last list, per namespace (at most `limit` each: a
        # namespace holding them holds `limit` asks too), and the namespaces past that (bounded).
        self._left_out: dict[str, set[str]] = {}
        self._full: set[str] = set()
        self.limit = max_per_namespace

    def put(self, key: Key, ask: ClaimAsk) -> bool:
        """Keep or drop `key`'s ask; whether what a pod naming it reads changed."""
        was = self.asks.get(key)
        if not ask.asks:
            if was is None:
                return self._kept_after_all(key)
            del self.asks[key]
            self._room.release(key)
            return True
        if not self._room.admit(key, was is not None):
            return self._leave_out(key)
        self._kept_after_all(key)
        self.asks[key] = ask
        return was != ask

    def _leave_out(self, key: Key) -> bool:
        """Mark `key` left out; whether a pod naming it reads something new (it did not read "left out")."""
        namespace, name = key
        names = self._left_out.get(namespace, ())
        if name in names or namespace in self._full:
            return False
        if len(names) < self.limit:
            self._left_out.setdefault(namespace, set()).add(name)
        elif len(self._full) < self.limit:
            self._full.add(namespace)
        return True

    def _kept_after_all(self, key: Key) -> bool:
        """Unmark `key` left out (kept now, gone, or asking nothing); whether it was marked."""
        names = self._left_out.get(key[0])
        if names is None or key[1] not in names:
            return False
        names.discard(key[1])
        if not names:
            del self._left_out[key[0]]
        return True

    def replace_all(self, asks: Iterable[tuple[Key, ClaimAsk]]) -> set[Key]:
        """A full list: the keys whose ask changed, and those left out before or now (what their pods
        read may have changed)."""
        before = self.asks
        was_left_out = {(namespace, name) for namespace, names in self._left_out.items() for name in names}
        self.asks, self._left_out, self._full = {}, {}, set()
        self._room.clear()
        left_out: set[Key] = set()
        for key, ask in asks:
            self.put(key, ask)
            if ask.asks and key not in self.asks:
                left_out.add(key)
        changed = {k for k in before.keys() | self.asks.keys() if before.get(k) != self.asks.get(k)}
        return left_out | was_left_out | changed

    def named(self, namespace: str, names: Iterable[str]) -> list[tuple[str, ClaimAsk]]:
        """Each name's ask in `namespace` (one left out by the bound reads as a problem saying so)."""
        named: list[tuple[str, ClaimAsk]] = []
        for name in names:
            ask = self.asks.get((namespace, name))
            if ask is None and (name in self._left_out.get(namespace, ()) or namespace in self._full):
                left_out = f"{self.kind} {short_repr(name, 60)} not read: namespace {short_repr(namespace, 60)}"
                ask = ClaimAsk(
                    problem=f"{left_out} holds more than {self.limit} {self.kind}s asking for gputopo's devices"
                )
            named.append((name, ask or NO_ASK))
        return named

    def namespaces_held(self) -> dict[str, int]:
        """How many objects each namespace holds here (the per-namespace bound's count)."""
        return dict(self._room.counts)


class TemplateAsks(AskTable):
    """The templates' asks, as the templates informer hands the templates over."""

    def replace(self, templates: list[ClaimTemplateInfo]) -> set[Key]:
        return self.replace_all((t.meta.key, template_ask(t)) for t in templates)

    def apply(self, template: ClaimTemplateInfo, *, deleted: bool = False) -> bool:
        """One template's event; whether its ask changed."""
        return self.put(template.meta.key, NO_ASK if deleted else template_ask(template))

    def __call__(self, namespace: str, templates: tuple[str, ...]) -> tuple[str, ClaimAsk]:
        """The one ask of a pod's claims from `templates` in `namespace`, with the template that asks it."""
        return pod_ask(self.named(namespace, (n for n in templates if not n.startswith(TEMPLATE_PREFIX + "-"))))


class ClaimAsks(AskTable):
    """The pre-made ResourceClaims' asks (the ResourceClaims informer's, gputopo.extender.watch.dramerge)."""

    kind = "ResourceClaim"
