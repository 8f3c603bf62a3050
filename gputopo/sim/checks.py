"""Which of a pod's own requests a placement breaks (the topology-blind policies cannot see them)."""

from __future__ import annotations

from collections.abc import Sequence

from gputopo.engine.state.snapshot import NodeState
from gputopo.model import NetworkKind, NvlinkPolicy, PodRequest, format_mib
from gputopo.sim.comm import node_shape

HBM = "min-gpu-memory"
NETWORK = "network"
NVLINK = "nvlink"
STALE = "stale-topology"


def broken_requests(node: NodeState, gpus: Sequence[int], req: PodRequest) -> list[tuple[str, str]]:
    """(kind, words) for each request of the pod this placement does not meet."""
    out: list[tuple[str, str]] = []
    topo = node.topology
    if topo is None:
        return out
    if node.problem is not None:
        out.append((STALE, f"{node.name}'s GPU topology is {node.problem.value.removeprefix('topology_')}"))
    if req.min_gpu_memory_mib and gpus:
        have = min(topo.gpus[g].memory_mib for g in gpus)
        if have < req.min_gpu_memory_mib:
            out.append(
                (HBM, f"its GPUs have {format_mib(have)} HBM, the pod asked for {format_mib(req.min_gpu_memory_mib)}")
            )
    if req.network is not NetworkKind.ANY and not any(req.network.accepts(n) for n in topo.nics):
        word = {"infiniband": "InfiniBand", "roce": "RoCE", "rdma": "RDMA"}.get(req.network.value, req.network.value)
        out.append((NETWORK, f"{node.name} has no active {word} NIC, the pod asked for one"))
    if req.nvlink is NvlinkPolicy.REQUIRED and len(gpus) > 1:
        shape = node_shape(node)
        if shape is not None and any(shape.links[a][b] == 0 for i, a in enumerate(gpus) for b in gpus[i + 1 :]):
            out.append((NVLINK, "the GPUs are not one NVLink clique, the pod requires one"))
    return out
