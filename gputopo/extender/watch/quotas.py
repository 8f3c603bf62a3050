"""Each namespace's room for GPUs under its ResourceQuotas (the ResourceQuotas informer): what gputopo may hold
for the namespace's pods not created yet (docs/annotations.md, "JobSet exclusive placement").

A quota bounds GPUs by `requests.<resource>` in `spec.hard` (Kubernetes allows only the `requests.` prefix for
an extended resource), the resource the extender's pods ask for (`nvidia.com/gpu`); its room is that less
`status.used` of the same, never below 0. A namespace's room is the least over its quotas that bound GPUs; with
none, the chart's `--max-held-gpus-per-namespace` applies. A quota with `spec.scopes` or `spec.scopeSelector`
counts only some pods (by priority class, deadline, ...) and is not read. What cannot be read fails closed:
a hard or used amount that is no non-negative quantity within int64 (a fraction is rounded toward less room),
or a used amount the quota controller has not counted yet, leaves the namespace no room, with the quota named.

At most `max_per_namespace` quotas that bound GPUs are kept per namespace: past it, the namespace has no room
(said once) until the quotas are listed again (a restart, or a watch expired), so a namespace filling its
share costs no other namespace anything and never holds more than a quota that was not read allows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR
from typing import Any

from gputopo.extender.watch.handlers import Bad, KindHandler, each_readable, object_at
from gputopo.kube import JSON, RESOURCEQUOTAS
from gputopo.model import GPU_RESOURCE
from gputopo.model.quantity import parse_quantity

log = logging.getLogger("gputopo.extender.watch.quotas")

MAX_PER_NAMESPACE = 1024
MAX_NAME = 253  # a DNS-1123 subdomain


@dataclass(frozen=True)
class QuotaRoom:
    """One quota's room for GPUs: `hard` less `used` (0 when it has a `problem`, which says why)."""

    name: str
    resource: str  # the quota's key: requests.<resource>
    hard: int
    used: int
    problem: str = ""

    @property
    def free(self) -> int:
        return 0 if self.problem else max(0, self.hard - self.used)

    def words(self) -> str:
        """The quota as a refused pod is told it."""
        if self.problem:
            return f"ResourceQuota {self.name}: {self.problem}"
        return f"ResourceQuota {self.name}: {self.resource} hard {self.hard}, used {self.used}, free {self.free}"


def _gpus(raw: Any, where: str, rounding: str) -> tuple[int, str]:
    """A quota amount of GPUs rounded toward less room (`hard` down, `used` up), or 0 and why it is unreadable."""
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        return 0, f"{where} is not a Kubernetes quantity"
    try:
        value = parse_quantity(str(raw))
    except ValueError as e:
        return 0, f"{where} is unreadable: {e}"
    if value < 0:
        return 0, f"{where} is negative"
    return int(value.to_integral_value(rounding=rounding)), ""


def quota_room(obj: Any, resource: str = GPU_RESOURCE) -> tuple[str, str, QuotaRoom | None]:
    """A ResourceQuota's (namespace, name, room for `resource`); room None when the quota does not bound it
    for every pod (no `requests.<resource>` in spec.hard, or scoped). ValueError naming the field that makes
    the quota unreadable as a whole (no namespace or name)."""
    meta = object_at(object_at(obj, "the object").get("metadata"), "metadata")
    namespace, name = meta.get("namespace"), meta.get("name")
    for field, value in (("namespace", namespace), ("name", name)):
        if not isinstance(value, str) or not value or len(value) > MAX_NAME:
            raise ValueError(f"metadata.{field} is missing, not a string or longer than {MAX_NAME} characters")
    assert isinstance(namespace, str) and isinstance(name, str)
    spec = object_at(obj.get("spec"), "spec")
    key = f"requests.{resource}"
    hard_raw = object_at(spec.get("hard"), "spec.hard").get(key)
    if hard_raw is None or spec.get("scopes") or spec.get("scopeSelector"):
        return namespace, name, None
    hard, problem = _gpus(hard_raw, f"spec.hard[{key}]", ROUND_FLOOR)
    used_raw = object_at(object_at(obj.get("status"), "status").get("used"), "status.used").get(key)
    used = 0
    if not problem:
        if used_raw is None:
            problem = f"status.used[{key}] is not counted yet"
        else:
            used, problem = _gpus(used_raw, f"status.used[{key}]", ROUND_CEILING)
    return namespace, name, QuotaRoom(name, key, hard, used, problem)


def _overflow(namespace: str, limit: int) -> QuotaRoom:
    return QuotaRoom(
        f"(more than {limit})", "", 0, 0, f"namespace {namespace} has more than {limit} ResourceQuotas on GPUs"
    )


class Quotas:
    """The quotas that bound GPUs, by namespace and name, and each namespace's tightest one (module doc).

    Each namespace's map is replaced whole, never mutated, so filters read it without a lock."""

    def __init__(self, bad: Bad, *, resource: str = GPU_RESOURCE, max_per_namespace: int = MAX_PER_NAMESPACE) -> None:
        self._bad = bad
        self.resource = resource
        self.limit = max_per_namespace
        self._rooms: dict[str, dict[str, QuotaRoom]] = {}
        self._least: dict[str, QuotaRoom] = {}  # each namespace's tightest quota, computed when it changes
        self._full: set[str] = set()  # namespaces that had more quotas on GPUs than are kept
        self.listed = False

    def handlers(self) -> dict[str, KindHandler]:
        return {RESOURCEQUOTAS.name: KindHandler(self.replace, self.apply)}

    def _read(self, obj: JSON) -> tuple[str, str, QuotaRoom | None]:
        return quota_room(obj, self.resource)

    def replace(self, items: list[JSON]) -> None:
        by_ns: dict[str, dict[str, QuotaRoom]] = {}
        full: set[str] = set()
        for _, (namespace, name, room) in each_readable(RESOURCEQUOTAS.name, items, self._read, self._bad):
            if room is None:
                continue
            rooms = by_ns.setdefault(namespace, {})
            if len(rooms) >= self.limit:
                self._said_full(namespace, full)
                continue
            rooms[name] = room
        self._rooms, self._full = by_ns, full
        self._least = {ns: min(rooms.values(), key=_tightness) for ns, rooms in by_ns.items()}
        self.listed = True

    def apply(self, event_type: str, obj: JSON) -> None:
        namespace, name, room = self._read(obj)
        rooms = self._rooms.get(namespace, {})
        if event_type == "DELETED" or room is None:
            if name not in rooms:
                return
            rooms = {n: r for n, r in rooms.items() if n != name}
        elif name in rooms or len(rooms) < self.limit:
            rooms = {**rooms, name: room}
        else:
            self._said_full(namespace, self._full)
            return
        if rooms:
            self._rooms[namespace] = rooms
            self._least[namespace] = _least(self._least.get(namespace), rooms, name)
        else:
            self._rooms.pop(namespace, None)
            self._least.pop(namespace, None)

    def _said_full(self, namespace: str, full: set[str]) -> None:
        if namespace not in full:
            full.add(namespace)
            log.warning(
                "namespace has more ResourceQuotas on GPUs than are read; it holds no GPUs for pods not created yet",
                extra={"namespace": namespace, "max": self.limit},
            )

    def room(self, namespace: str) -> QuotaRoom | None:
        """The namespace's tightest quota on GPUs; None when none bounds it (the chart's bound applies)."""
        if not self.listed:
            return QuotaRoom("(not read yet)", "", 0, 0, "ResourceQuotas are not read yet")
        if namespace in self._full:
            return _overflow(namespace, self.limit)
        return self._least.get(namespace)


def _tightness(room: QuotaRoom) -> tuple[int, str]:
    return room.free, room.name


def _least(was: QuotaRoom | None, rooms: Mapping[str, QuotaRoom], changed: str) -> QuotaRoom:
    """The tightest of `rooms` after quota `changed` changed: compared with the tightest before, unless that
    was the one changed (then all are compared again), so a flood of quotas costs one comparison each."""
    room = rooms.get(changed)
    if was is None or was.name == changed:
        return min(rooms.values(), key=_tightness)
    return was if room is None or _tightness(was) <= _tightness(room) else room
