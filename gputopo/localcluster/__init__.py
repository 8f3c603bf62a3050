"""A local, real Kubernetes control plane for end-to-end tests, the demo and benchmarks.

Upstream etcd, kube-apiserver, kube-scheduler and kube-controller-manager run as child processes
on loopback (``ControlPlane``); GPU nodes are simulated as Node objects without kubelets (``SimNode``), or run
by a real kubelet with a fake container runtime (``RealKubelet``, root only);
``KubeClient`` is a small typed wrapper over ``gputopo.kube`` plus the real kubectl.
The binaries are built once per machine by ``build_binaries.sh`` (``ensure_binaries``); the real job
controllers (JobSet, LeaderWorkerSet, Kueue, Kubeflow Trainer) by ``build_controllers.sh``, and
``JobControllers`` runs them on a ``ControlPlane`` with their own webhooks.
"""

from gputopo.localcluster.binaries import BUILD_SCRIPT, BinariesError, ensure_binaries, expected_bin_dir, find_binaries
from gputopo.localcluster.controlplane import (
    APISERVER,
    CONTROLLER_MANAGER,
    CONTROLLERS,
    ETCD,
    GPUTOPO_PROFILE,
    PLAIN_PROFILE,
    ApiFeatures,
    ControlPlane,
    ControlPlaneError,
    ExtenderConfig,
    Lifetime,
    SchedulerOptions,
    free_port,
    kubeconfig_text,
    scheduler_configuration,
)
from gputopo.localcluster.featureflags import FlagError, parse_flag_map
from gputopo.localcluster.jobcontrollers import JobControllers, find_controllers_dir
from gputopo.localcluster.kube import (
    NODE_NAME_EXTRA,
    TEST_LABEL,
    KubeApiError,
    KubeClient,
    PodCondition,
    PodContainer,
    PodEvent,
    PodScheduling,
    SimNode,
    WaitTimeout,
    network_labels,
    pod_manifest,
)
from gputopo.localcluster.kubelet import RealKubelet, kubelet_unavailable
from gputopo.model import GPU_RESOURCE

__all__ = [
    "APISERVER",
    "BUILD_SCRIPT",
    "CONTROLLERS",
    "CONTROLLER_MANAGER",
    "ETCD",
    "GPUTOPO_PROFILE",
    "GPU_RESOURCE",
    "NODE_NAME_EXTRA",
    "PLAIN_PROFILE",
    "TEST_LABEL",
    "ApiFeatures",
    "BinariesError",
    "ControlPlane",
    "ControlPlaneError",
    "ExtenderConfig",
    "FlagError",
    "JobControllers",
    "KubeApiError",
    "KubeClient",
    "Lifetime",
    "PodCondition",
    "PodContainer",
    "PodEvent",
    "PodScheduling",
    "RealKubelet",
    "SchedulerOptions",
    "SimNode",
    "WaitTimeout",
    "ensure_binaries",
    "expected_bin_dir",
    "find_binaries",
    "find_controllers_dir",
    "free_port",
    "kubeconfig_text",
    "kubelet_unavailable",
    "network_labels",
    "parse_flag_map",
    "pod_manifest",
    "scheduler_configuration",
]
