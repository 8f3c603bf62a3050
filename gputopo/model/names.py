"""Names gputopo's processes and charts share: node annotation and label keys, the resource it places,
its scheduler, namespace, components and the agents' Lease names (docs/annotations.md lists the keys for
users; a pod's request annotations live with their parser in gputopo.model.request).

Every component reads these from here, so a rename happens once; the chart spells some of them in YAML
and tests/chart checks those spellings against these constants.
"""

from __future__ import annotations

PREFIX = "gputopo.io/"
TOPOLOGY_ANNOTATION = "gputopo.io/topology"
GPUS_IN_USE_ANNOTATION = "gputopo.io/gpus-in-use"
PLACEMENT_ANNOTATION = "gputopo.io/placement"

LABEL_NVLINK_DOMAIN = "gputopo.io/nvlink-domain"
LABEL_NVSWITCH = "gputopo.io/nvswitch"
LABEL_RDMA = "gputopo.io/rdma"
LABEL_GPU_MEMORY_GIB = "gputopo.io/gpu-memory-gib"
# Only on nodes whose GPUs report multi-node NVLink fabric info (NVL72 trays): healthy, degraded, unknown.
# For people (`kubectl get nodes -L`); placement reads the fabric from the topology annotation instead.
LABEL_NVLINK_FABRIC = "gputopo.io/nvlink-fabric"
# Every label the agent owns: one it no longer publishes is removed from the Node.
NODE_LABEL_KEYS = (LABEL_NVLINK_DOMAIN, LABEL_NVSWITCH, LABEL_RDMA, LABEL_GPU_MEMORY_GIB, LABEL_NVLINK_FABRIC)
# Set by the operator (or the cloud's own labels, gputopo.tiers lists them): the node's network switches.
LABEL_NETWORK_SPINE = "gputopo.io/network-spine"
LABEL_NETWORK_LEAF = "gputopo.io/network-leaf"
# Set by the operator, not the agent: each NIC's fabric rail (gputopo.model.rails reads it).
LABEL_RAILS = "gputopo.io/rails"
# Set by the operator on every tray of an NVLink domain: the trays one group may take there
# (gputopo.engine.gang.rack reads it where all of the domain's trays agree).
LABEL_NVLINK_DOMAIN_CAP = "gputopo.io/nvlink-domain-cap"
# The gputopo.io/ labels only the operator writes: the agents' admission policy forbids them to
# add, change or remove these (charts/gputopo/templates/agent-validatingadmissionpolicy.yaml).
OPERATOR_LABEL_KEYS = (LABEL_NVLINK_DOMAIN_CAP, LABEL_NETWORK_SPINE, LABEL_NETWORK_LEAF, LABEL_RAILS)

GPU_RESOURCE = "nvidia.com/gpu"
SCHEMA_VERSION = 1

# The scheduler profile that opted-in pods name in spec.schedulerName (the webhook sets it).
SCHEDULER_NAME = "gputopo-scheduler"
# The namespace the chart installs into by default; the agents' Leases live there.
DEFAULT_NAMESPACE = "gputopo-system"
# The programs, as they name themselves in Events, logs, labels and process listings.
EXTENDER_COMPONENT = "gputopo-extender"
AGENT_COMPONENT = "gputopo-agent"
# Each agent renews the Lease `gputopo-agent-<node>`; the extender reads a node's heartbeat from it, and
# the chart's admission policy lets an agent write only its own node's Lease by this name.
AGENT_LEASE_PREFIX = AGENT_COMPONENT + "-"


def agent_lease_name(node: str) -> str:
    """The name of the heartbeat Lease of the agent on `node`."""
    return AGENT_LEASE_PREFIX + node
