"""The project's one Kubernetes access layer: configuration, raw-JSON requests, list+watch, retries.

Everything that talks to an API server goes through here: the extender (`gputopo.extender.watch.source`), the node
agent, the local control plane's client and the benchmarks. Importers take every name from
`gputopo.kube`; each lives in one module:

- `errors`: `KubeError` (one type for every failed call) and `Gone` (410: relist);
- `config`: which kubeconfig, and the `kubernetes` client configuration built from it;
- `kinds`: the kinds the project watches, each declared once (`WATCHED`: path, scope, optional, RBAC verbs);
- `apipath`: the one builder of API paths (and names in queries), from parts checked as Kubernetes does;
- `paths`: where the project's resources live, and their JSON and MicroTime formats;
- `watch`: a watch stream decoded line by line into `WatchEvent`s;
- `backoff`: the one capped exponential backoff, `retry`, and the list+watch thread body (the
  informer core, paced as client-go's reflector: `Pacing`, `REFLECTOR_BACKOFF`);
- `transport`: every request and watch over one pool of kept-alive connections;
- `client`: `Kube` (one per process, shared by its parts), the requests, paged lists, watches and
  typed writes.
"""

from gputopo.kube.backoff import (
    MIN_WATCH_S,
    REFLECTOR_BACKOFF,
    Backoff,
    Pacing,
    is_retryable,
    retry,
    run_list_watch,
    short_error,
)
from gputopo.kube.client import LIST_PAGE_SIZE, MAX_LIST_PAGES, Kube, Query
from gputopo.kube.config import client_configuration, find_kubeconfig
from gputopo.kube.errors import Gone, KubeError, status_error
from gputopo.kube.kinds import (
    COMPUTEDOMAINS,
    JOBS,
    JOBSETS,
    KIND_NAMES,
    LEASES,
    NODES,
    PODGROUPS,
    PODS,
    RESOURCECLAIMS,
    RESOURCECLAIMTEMPLATES,
    RESOURCEQUOTAS,
    RESOURCESLICES,
    WATCHED,
    KindName,
    WatchedKind,
    watched,
)
from gputopo.kube.paths import (
    JSON,
    MICROTIME,
    InvalidName,
    binding_path,
    events_path,
    lease_path,
    micro_time,
    node_path,
    on_node,
    parse_time,
    pod_path,
    pods_path,
    resourceclaim_path,
)
from gputopo.kube.watch import MAX_LINE_BYTES, WatchEvent, decode_event, error_event, iter_lines

__all__ = [
    "COMPUTEDOMAINS",
    "JOBS",
    "JOBSETS",
    "JSON",
    "KIND_NAMES",
    "LEASES",
    "LIST_PAGE_SIZE",
    "MAX_LINE_BYTES",
    "MAX_LIST_PAGES",
    "MICROTIME",
    "MIN_WATCH_S",
    "NODES",
    "PODGROUPS",
    "PODS",
    "REFLECTOR_BACKOFF",
    "RESOURCECLAIMS",
    "RESOURCECLAIMTEMPLATES",
    "RESOURCEQUOTAS",
    "RESOURCESLICES",
    "WATCHED",
    "Backoff",
    "Gone",
    "InvalidName",
    "KindName",
    "Kube",
    "KubeError",
    "Pacing",
    "Query",
    "WatchEvent",
    "WatchedKind",
    "binding_path",
    "client_configuration",
    "decode_event",
    "error_event",
    "events_path",
    "find_kubeconfig",
    "is_retryable",
    "iter_lines",
    "lease_path",
    "micro_time",
    "node_path",
    "on_node",
    "parse_time",
    "pod_path",
    "pods_path",
    "resourceclaim_path",
    "retry",
    "run_list_watch",
    "short_error",
    "status_error",
    "watched",
]
