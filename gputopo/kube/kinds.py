"""The Kubernetes kinds the project watches, each declared once: where it lives on the API server, how
far it is watched, whether the API server may not serve it or RBAC may not grant it, and the verbs the
extender needs on it.

The extender's informers, its cache's handlers, its metrics and the chart's RBAC test all read `WATCHED`;
the agent and the clients take these kinds' paths from here (`gputopo.kube.paths` builds on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from gputopo.kube.apipath import api_path

KindName = str  # one of `KIND_NAMES`


@dataclass(frozen=True)
class WatchedKind:
    name: str  # what the extender calls it (metrics' `kind` label, logs)
    group: str  # "" for the core API
    version: str
    resource: str  # the plural in URLs and RBAC rules
    namespaced: bool  # the objects live in namespaces (watched across all of them unless `one_namespace`)
    one_namespace: bool = False  # watched only in the agents' namespace (a Role there, not a ClusterRole)
    optional: bool = False  # a 404 on list means "not served here" (an API this cluster may not have)
    rbac_optional: bool = False  # a 403 on list means "not granted here" (the chart grants it only with DRA)
    verbs: frozenset[str] = frozenset({"list", "watch"})  # what the extender's service account needs

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str = "", subresource: str = "") -> str:
        """The collection (or the object `name`, or its `subresource`) in `namespace`; every namespace's
        when `namespace` is None or empty. A cluster-scoped kind takes no namespace; a one-namespace kind
        needs one. Built by `gputopo.kube.apipath.api_path`: InvalidName for a namespace or name Kubernetes
        would refuse."""
        if namespace and not self.namespaced:
            raise ValueError(f"{self.name} are cluster-scoped: no namespace")
        if not namespace and self.one_namespace:
            raise ValueError(f"{self.name}: a namespace is needed")
        return api_path(self.group, self.version, self.resource, namespace, name, subresource)


NODES = WatchedKind("nodes", "", "v1", "nodes", namespaced=False)
PODS = WatchedKind("pods", "", "v1", "pods", namespaced=True, verbs=frozenset({"get", "list", "watch"}))
# The agents' heartbeats, in the release namespace only.
LEASES = WatchedKind("leases", "coordination.k8s.io", "v1", "leases", namespaced=True, one_namespace=True)
# The sizes an Indexed Job's or a JobSet's pod labels do not carry (read only).
JOBS = WatchedKind("jobs", "batch", "v1", "jobs", namespaced=True)
# Native gangs kube-scheduler holds pods to (Kubernetes 1.36+ with the Workload API; read only).
PODGROUPS = WatchedKind("podgroups", "scheduling.k8s.io", "v1beta1", "podgroups", namespaced=True, optional=True)
# DRA (Kubernetes >= 1.34): read where the chart grants them (agent.dra.enabled).
# `get`: the bind reads a DRA pod's claims fresh (the watch may not have brought their allocation yet).
RESOURCECLAIMS = WatchedKind(
    "resourceclaims",
    "resource.k8s.io",
    "v1",
    "resourceclaims",
    namespaced=True,
    optional=True,
    rbac_optional=True,
    verbs=frozenset({"get", "list", "watch"}),
)
RESOURCESLICES = WatchedKind(
    "resourceslices", "resource.k8s.io", "v1", "resourceslices", namespaced=False, optional=True, rbac_optional=True
)

# Which templates are NVIDIA ComputeDomains' IMEX channel templates (read only, granted with or without DRA:
# NVIDIA's driver serves the ComputeDomains beside gputopo's GPUs either way).
RESOURCECLAIMTEMPLATES = WatchedKind(
    "resourceclaimtemplates", "resource.k8s.io", "v1", "resourceclaimtemplates", namespaced=True, optional=True
)

# NVIDIA's ComputeDomains (its DRA driver's CRD, read only, where served): each one's numNodes, so that its
# first pod goes to an NVLink domain with room for all of its nodes.
COMPUTEDOMAINS = WatchedKind(
    "computedomains", "resource.nvidia.com", "v1beta1", "computedomains", namespaced=True, optional=True
)

# JobSets (read only, where JobSet's CRD is served): a Job's JobSet ownerReference holds GPUs for its pods not
# created yet only while a JobSet of that name and UID exists.
JOBSETS = WatchedKind("jobsets", "jobset.x-k8s.io", "v1alpha2", "jobsets", namespaced=True, optional=True)

# ResourceQuotas (read only): a namespace's room for GPUs bounds what gputopo holds for its pods not created yet.
RESOURCEQUOTAS = WatchedKind("resourcequotas", "", "v1", "resourcequotas", namespaced=True)

WATCHED: tuple[WatchedKind, ...] = (
    NODES,
    PODS,
    LEASES,
    JOBS,
    PODGROUPS,
    RESOURCECLAIMS,
    RESOURCESLICES,
    RESOURCECLAIMTEMPLATES,
    COMPUTEDOMAINS,
    JOBSETS,
    RESOURCEQUOTAS,
)
KIND_NAMES: tuple[KindName, ...] = tuple(k.name for k in WATCHED)
_BY_NAME = {k.name: k for k in WATCHED}


def watched(name: KindName) -> WatchedKind:
    """The declared kind `name`; KeyError for one the project does not watch."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a watched kind (gputopo.kube.kinds.WATCHED)") from None
