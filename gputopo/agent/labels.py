"""The `gputopo.io/*` node labels the agent publishes, derived from the topology only.

They live with the agent rather than in gputopo.model because the NVLink domain size needs the
engine's clique search, and the model sits below the engine.
"""

from __future__ import annotations

from gputopo.engine.state.cliques import max_clique_size
from gputopo.model import (
    LABEL_GPU_MEMORY_GIB,
    LABEL_NVLINK_DOMAIN,
    LABEL_NVLINK_FABRIC,
    LABEL_NVSWITCH,
    LABEL_RDMA,
    NodeTopology,
    on_fabric,
    tray_health,
)


def largest_clique_size(topology: NodeTopology) -> int:
    """Size of the largest fully NVLink-connected GPU set (1 when there is no NVLink at all)."""
    n = len(topology.gpus)
    adj = [0] * n
    for i in range(n):
        for j in range(n):
            if i != j and topology.link_count(i, j) > 0:
                adj[i] |= 1 << j
    return max_clique_size(tuple(adj), (1 << n) - 1)


def node_labels(topology: NodeTopology) -> dict[str, str]:
    """The `gputopo.io/*` node labels the agent publishes, derived from the topology only."""
    active = [n for n in topology.nics if n.active]
    kinds = {n.rdma_kind for n in active}
    rdma = "infiniband" if "infiniband" in kinds else ("roce" if "roce" in kinds else "none")
    memory = min((g.memory_mib for g in topology.gpus), default=0)
    labels = {
        LABEL_NVLINK_DOMAIN: str(largest_clique_size(topology) if topology.gpus else 0),
        LABEL_NVSWITCH: "true" if topology.nvlink.nvswitch else "false",
        LABEL_RDMA: rdma,
        LABEL_GPU_MEMORY_GIB: str(round(memory / 1024)),
    }
    if on_fabric(topology.gpus):  # a tray: any GPU in a multi-node NVLink fabric
        labels[LABEL_NVLINK_FABRIC] = tray_health(topology.gpus)[0].value
    return labels
