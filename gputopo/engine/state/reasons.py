"""Verdict codes and the fixed set of reason categories (mirrors kube-scheduler's Status codes).

Messages are short, stable and free of node names, so kube-scheduler's FailedScheduling event
aggregates them ("40 no free 4-GPU NVLink clique"). The node-specific story goes in `detail`.
"""

from __future__ import annotations

from enum import Enum, StrEnum


class Code(Enum):
    SUCCESS = "Success"
    UNSCHEDULABLE = "Unschedulable"  # preemption or time may help: goes to FailedNodes
    UNRESOLVABLE = "UnschedulableAndUnresolvable"  # it cannot: goes to FailedAndUnresolvableNodes


class Reason(StrEnum):
    """Why a node cannot take a pod. The value doubles as a Prometheus label."""

    INVALID_POD_ANNOTATION = "invalid_pod_annotation"
    TOPOLOGY_MISSING = "topology_missing"
    TOPOLOGY_INVALID = "topology_invalid"
    TOPOLOGY_STALE = "topology_stale"
    TOO_FEW_GPUS = "too_few_gpus"
    TOO_FEW_HEALTHY_GPUS = "too_few_healthy_gpus"
    INSUFFICIENT_GPU_MEMORY = "insufficient_gpu_memory"
    NO_NVLINK_DOMAIN = "no_nvlink_domain"
    NVLINK_DEGRADED = "nvlink_degraded"
    INSUFFICIENT_FREE_GPUS = "insufficient_free_gpus"
    NO_FREE_CLIQUE = "no_free_clique"
    NO_NETWORK = "no_network"
    GROUP_WAITING = "group_waiting"
    GROUP_NO_PLAN = "group_no_plan"
    GROUP_PLANNED_ELSEWHERE = "group_planned_elsewhere"
    COMPUTE_DOMAIN = "compute_domain"  # outside the pod's ComputeDomain's NVLink domain, or another's channel


# Reasons that no amount of preemption can fix.
UNRESOLVABLE = frozenset(
    {
        Reason.INVALID_POD_ANNOTATION,
        Reason.TOPOLOGY_MISSING,
        Reason.TOPOLOGY_INVALID,
        Reason.TOPOLOGY_STALE,
        Reason.TOO_FEW_GPUS,
        Reason.TOO_FEW_HEALTHY_GPUS,
        Reason.INSUFFICIENT_GPU_MEMORY,
        Reason.NO_NVLINK_DOMAIN,
        Reason.NVLINK_DEGRADED,
        Reason.NO_NETWORK,
        Reason.GROUP_PLANNED_ELSEWHERE,
        Reason.COMPUTE_DOMAIN,
    }
)


def code_for(reason: Reason) -> Code:
    return Code.UNRESOLVABLE if reason in UNRESOLVABLE else Code.UNSCHEDULABLE


def message(reason: Reason, *, k: int = 0, memory: str = "", network: str = "", text: str = "") -> str:
    """The categorical message for a reason; numbers and kinds only, never a node name."""
    match reason:
        case Reason.INVALID_POD_ANNOTATION | Reason.GROUP_WAITING | Reason.GROUP_NO_PLAN | Reason.COMPUTE_DOMAIN:
            return text
        case Reason.TOPOLOGY_MISSING:
            return "GPU topology not reported"
        case Reason.TOPOLOGY_INVALID:
            return "GPU topology unreadable"
        case Reason.TOPOLOGY_STALE:
            return "GPU topology stale"
        case Reason.TOO_FEW_GPUS:
            return f"fewer than {k} GPUs"
        case Reason.TOO_FEW_HEALTHY_GPUS:
            return f"fewer than {k} healthy GPUs"
        case Reason.INSUFFICIENT_GPU_MEMORY:
            return f"fewer than {k} GPUs with {memory} HBM"
        case Reason.NO_NVLINK_DOMAIN:
            return f"fewer than {k} NVLink-connected GPUs"
        case Reason.NVLINK_DEGRADED:
            return "NVLink degraded"
        case Reason.INSUFFICIENT_FREE_GPUS:
            return f"fewer than {k} free GPUs"
        case Reason.NO_FREE_CLIQUE:
            return f"no free {k}-GPU NVLink clique"
        case Reason.NO_NETWORK:
            return f"no active {network} NIC"
        case Reason.GROUP_PLANNED_ELSEWHERE:
            return "reserved for other members of the pod's group"


def summarize_failures(messages: list[str], total: int) -> str:
    """kube-scheduler's FitError text: '0/N nodes are available: <count> <msg>, ...' sorted as strings."""
    counts: dict[str, int] = {}
    for m in messages:
        counts[m] = counts.get(m, 0) + 1
    entries = sorted(f"{c} {m}" for m, c in counts.items())
    return f"0/{total} nodes are available: " + ", ".join(entries) + "."
