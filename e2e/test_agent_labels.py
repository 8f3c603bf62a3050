"""The agent's node labels on a real API server: `gputopo.io/nvlink-fabric` follows a tray's fabric
health and is removed (a merge patch's null) once the node stops reporting fabric info."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.nodepublisher import KubeNodeApi, LeaseTerms, Publisher
from gputopo.kube import Kube
from gputopo.localcluster import ControlPlane, KubeClient, SimNode
from gputopo.model import LABEL_NVLINK_FABRIC, LABEL_NVSWITCH
from gputopo.systems import build_system

MakeNodes = Callable[[Sequence[SimNode]], list[str]]

pytestmark = pytest.mark.e2e


def test_the_fabric_label_follows_the_tray_and_is_removed_on_a_real_api_server(
    control_plane: ControlPlane, kube: KubeClient, make_nodes: MakeNodes, test_id: str
) -> None:
    (node,) = make_nodes([SimNode(f"{test_id}-n", gpus=4)])
    api = Kube(control_plane.kubeconfig)
    try:
        publisher = Publisher(KubeNodeApi(api), node, LeaseTerms("default", 60), sleep=lambda _s: False)
        for system, label in [("gb200-tray", "healthy"), ("gb200-tray-degraded", "degraded"), ("dgx-h100", None)]:
            assert publisher.publish(build_system(system, node), None) is PublishResult.CHANGED, system
            labels = kube.get_node(node)["metadata"]["labels"]
            assert labels.get(LABEL_NVLINK_FABRIC) == label, system
            assert labels[LABEL_NVSWITCH] == "true"  # the other agent labels stay
            assert labels["kubernetes.io/os"] == "linux"  # and so do everyone else's
    finally:
        api.close()
