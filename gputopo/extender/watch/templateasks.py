"""What each hand-written ResourceClaimTemplate asks of gputopo's devices (gputopo.model.claimask), kept as
the templates informer (gputopo.extender.watch.computedomains.ChannelTemplates, the one handler of the kind)
hands them over, and read for a pod by the names its claims give (`TemplateAsks.__call__`, the cache's
`AskReader`).

Only templates that ask for gputopo's devices are kept, at most `max_per_namespace` per namespace: past
it that namespace's later ones are not read (said once), and a pod there naming one of them is told so,
never placed as if it asked nothing. The names left out are kept too, as many per namespace, so a pod
naming a template that asks nothing of gputopo (an IMEX channel's, another driver's) is read as ever;
past that second bound every template of the namespace not kept is said to be left out. Every other
namespace is unaffected, and a left-out template written again unchanged reads no pod again. gputopo's
own templates (`gputopo-gpus-...`, gputopo.engine.dra.claims) are never read here: their pods keep the
webhook's path.
Waiting until the templates are listed once is the channel reader's (one list serves both).
"""

from __future__ import annotations

from gputopo.extender.watch.computedomains import MAX_PER_NAMESPACE, Key, PerNamespace
from gputopo.model.claimask import NO_ASK, ClaimAsk, pod_ask, read_claim_ask
from gputopo.model.claimtemplate import ClaimTemplateInfo
from gputopo.model.dra import TEMPLATE_PREFIX
from gputopo.model.podspec import short_repr


def template_ask(template: ClaimTemplateInfo) -> ClaimAsk:
    """What `template` asks of gputopo's devices; nothing for gputopo's own templates."""
    meta = template.meta
    if meta.name.startswith(TEMPLATE_PREFIX + "-"):
        return NO_ASK
    return read_claim_ask(template.devices, f"ResourceClaimTemplate {meta.namespace[:80]}/{meta.name[:80]}")


class TemplateAsks:
    """The asks of the templates that ask for gputopo's devices, by (namespace, name), bounded per namespace."""

    def __init__(self, *, max_per_namespace: int = MAX_PER_NAMESPACE) -> None:
        self.asks: dict[Key, ClaimAsk] = {}
        self._room = PerNamespace("ResourceClaimTemplates asking for gputopo's devices", max_per_namespace)
        # Names of the templates left out since the last list, per namespace (at most `limit` each: a
        # namespace holding them holds `limit` asks too), and the namespaces past that (bounded).
        self._left_out: dict[str, set[str]] = {}
        self._full: set[str] = set()
        self.limit = max_per_namespace

    def _put(self, key: Key, ask: ClaimAsk) -> bool:
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

    def replace(self, templates: list[ClaimTemplateInfo]) -> set[Key]:
        """A full list: the keys whose ask changed, and those left out before or now (what their pods
        read may have changed)."""
        before = self.asks
        was_left_out = {(namespace, name) for namespace, names in self._left_out.items() for name in names}
        self.asks, self._left_out, self._full = {}, {}, set()
        self._room.clear()
        left_out: set[Key] = set()
        for t in templates:
            ask = template_ask(t)
            self._put(t.meta.key, ask)
            if ask.asks and t.meta.key not in self.asks:
                left_out.add(t.meta.key)
        changed = {k for k in before.keys() | self.asks.keys() if before.get(k) != self.asks.get(k)}
        return left_out | was_left_out | changed

    def apply(self, template: ClaimTemplateInfo, *, deleted: bool = False) -> bool:
        """One template's event; whether its ask changed."""
        return self._put(template.meta.key, NO_ASK if deleted else template_ask(template))

    def __call__(self, namespace: str, templates: tuple[str, ...]) -> tuple[str, ClaimAsk]:
        """The one ask of a pod's claims from `templates` in `namespace`, with the template that asks it."""
        named: list[tuple[str, ClaimAsk]] = []
        for name in templates:
            if name.startswith(TEMPLATE_PREFIX + "-"):
                continue
            ask = self.asks.get((namespace, name))
            if ask is None and (name in self._left_out.get(namespace, ()) or namespace in self._full):
                left_out = (
                    f"ResourceClaimTemplate {short_repr(name, 60)} not read: namespace {short_repr(namespace, 60)}"
                )
                ask = ClaimAsk(
                    problem=f"{left_out} holds more than {self.limit} templates asking for gputopo's devices"
                )
            named.append((name, ask or NO_ASK))
        return pod_ask(named)

    def namespaces_held(self) -> dict[str, int]:
        """How many templates each namespace holds here (the per-namespace bound's count)."""
        return dict(self._room.counts)
