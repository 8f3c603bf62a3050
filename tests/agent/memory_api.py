"""An in-memory NodeApi: one Node's metadata and Leases in dicts, with call counts.

Used by the unit tests and by bench/agent_cycle.py to count Node writes against Lease renewals
without an API server. `fail_next` queues exceptions that the next calls raise, in order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gputopo.agent.nodepublisher import LeaseSpec, NodeMeta
from gputopo.kube import KubeError


@dataclass
class InMemoryNodeApi:
    node: str
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    leases: dict[tuple[str, str], LeaseSpec] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    patches: list[tuple[dict[str, str], dict[str, str | None]]] = field(default_factory=list)
    fail_next: list[BaseException] = field(default_factory=list)

    def _enter(self, call: str) -> None:
        self.calls[call] += 1
        if self.fail_next:
            raise self.fail_next.pop(0)

    def _check(self, name: str) -> None:
        if name != self.node:
            raise KubeError(404, f"node {name} not found", "NotFound")

    def read_node_meta(self, name: str) -> NodeMeta:
        self._enter("read_node")
        self._check(name)
        return NodeMeta(annotations=dict(self.annotations), labels=dict(self.labels))

    def patch_node_meta(self, name: str, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> None:
        self._enter("patch_node")
        self._check(name)
        self.annotations.update(annotations)
        for key, value in labels.items():  # a JSON merge patch: null removes the label
            if value is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = value
        self.patches.append((dict(annotations), dict(labels)))

    def renew_lease(self, namespace: str, name: str, spec: LeaseSpec) -> None:
        self._enter("renew_lease")
        if (namespace, name) not in self.leases:
            raise KubeError(404, f"lease {namespace}/{name} not found", "NotFound")
        self.leases[(namespace, name)] = spec

    def create_lease(self, namespace: str, name: str, spec: LeaseSpec) -> None:
        self._enter("create_lease")
        self.leases[(namespace, name)] = spec

    def delete_lease(self, namespace: str, name: str, renewed_at: datetime) -> None:
        self._enter("delete_lease")
        lease = self.leases.get((namespace, name))
        if lease is None:
            raise KubeError(404, f"lease {namespace}/{name} not found", "NotFound")
        if lease.renew_time != renewed_at:
            raise KubeError(409, f"lease {namespace}/{name} was renewed since", "Conflict")
        del self.leases[(namespace, name)]
