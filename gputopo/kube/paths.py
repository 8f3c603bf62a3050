"""Where the project's resources live on the API server (the watched kinds' paths come from their one
declaration, `gputopo.kube.kinds`; every path and name in a query is built by `gputopo.kube.apipath` from
checked parts), and the JSON and time formats they are written in."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gputopo.kube.apipath import InvalidName, api_path, field_selector
from gputopo.kube.kinds import LEASES, NODES, PODS, RESOURCECLAIMS
from gputopo.model.k8snames import parse_time  # the one RFC 3339 reader, pure: the model reads pods' times too

__all__ = [
    "JSON",
    "MICROTIME",
    "InvalidName",
    "binding_path",
    "events_path",
    "lease_path",
    "micro_time",
    "node_path",
    "on_node",
    "parse_time",
    "pod_path",
    "pods_path",
    "resourceclaim_path",
]

JSON = dict[str, Any]

MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"


def node_path(name: str = "") -> str:
    return NODES.path(name=name)


def pods_path(namespace: str = "") -> str:
    """All namespaces' pods when `namespace` is empty."""
    return PODS.path(namespace)


def pod_path(namespace: str, name: str) -> str:
    return PODS.path(namespace, name)


def binding_path(namespace: str, name: str) -> str:
    """Where a pod's Binding is posted."""
    return PODS.path(namespace, name, "binding")


def on_node(node: str) -> str:
    """The field selector of the pods bound to `node` (the name checked: InvalidName)."""
    return field_selector("spec.nodeName", node)


def lease_path(namespace: str, name: str = "") -> str:
    return LEASES.path(namespace, name)


def resourceclaim_path(namespace: str, name: str) -> str:
    return RESOURCECLAIMS.path(namespace, name)


def events_path(namespace: str) -> str:
    return api_path("", "v1", "events", namespace)


def micro_time(t: datetime) -> str:
    """A MicroTime (Lease renewTime, Event eventTime) in UTC."""
    return t.astimezone(UTC).strftime(MICROTIME)
