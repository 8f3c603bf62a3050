"""End to end: real etcd, kube-apiserver and kube-scheduler; the real gputopo-extender over HTTP; one
real gputopo-agent process per simulated GPU node; and real `kubectl describe`.

Each test creates its own nodes (labelled with the test id) and its pods select them by that label,
so tests sharing the session's cluster never see each other's nodes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from workloads import bound_after_nudges

from conftest import StackNodes
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.stack import GpuNode, SchedulerPods, Stack, StackTiming
from gputopo.model import (
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    parse_gpus_in_use,
    parse_placement,
    parse_topology,
)
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

# seconds; agents heartbeat every 2 s. Ten beats: an agent starved on a loaded machine must not make its
# node stale under another test (a pod refused as stale waits for the next node event).
STALE_AFTER = 20.0


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=STALE_AFTER, heartbeat_seconds=2, interval_seconds=1),
    )
    s.start()
    yield s
    s.stop()


def gputopo_pod(
    kube: KubeClient, ns: str, test_id: str, name: str, gpus: int, annotations: dict[str, str] | None = None
) -> str:
    kube.create_pod(
        pod_manifest(
            name,
            namespace=ns,
            gpus=gpus,
            annotations=annotations if annotations is not None else {"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector={TEST_LABEL: test_id}),
        )
    )
    return name


def placement(kube: KubeClient, ns: str, pod: str) -> tuple[str, list[int], str]:
    node = kube.wait_pod_bound(ns, pod, timeout=45)
    ann = kube.get_pod(ns, pod)["metadata"].get("annotations", {})
    p = parse_placement(ann[PLACEMENT_ANNOTATION])
    assert p.node == node
    return node, list(p.gpus), p.reason


def described(kube: KubeClient, ns: str, pod: str) -> str:
    return kube.describe_pod(ns, pod)


def failed_scheduling(kube: KubeClient, ns: str, pod: str, contains: str, timeout: float = 45) -> str:
    return kube.wait_pod_event(ns, pod, "FailedScheduling", contains=contains, timeout=timeout).message


def test_tp4_on_dgx1v_takes_the_intact_nvlink_quad_when_gpus_are_in_use(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (dgx1,) = nodes.add(GpuNode("dgx1v", "dgx-1v", in_use=[1]))
    pod = gputopo_pod(kube, namespace, test_id, "tp4", 4)
    node, gpus, _ = placement(kube, namespace, pod)
    assert (node, gpus) == (dgx1, [4, 5, 6, 7])
    text = described(kube, namespace, pod)
    assert "TopologyPlacement" in text
    assert f"GPUs 4-7 on {dgx1} form a full NVLink clique (NV1 direct links)" in text
    assert PLACEMENT_ANNOTATION in text
    # only GPUs 0, 2 and 3 are left: a second TP-4 cannot fit, and says why
    pod2 = gputopo_pod(kube, namespace, test_id, "tp4-second", 4)
    assert "0/1 nodes are available: 1 fewer than 4 free GPUs." in failed_scheduling(kube, namespace, pod2, "free GPUs")


def test_free_gpus_that_form_no_clique_are_refused_for_tp4(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (dgx1,) = nodes.add(GpuNode("dgx1v", "dgx-1v", in_use=[1, 5]))
    pod = gputopo_pod(kube, namespace, test_id, "tp4", 4)
    msg = failed_scheduling(kube, namespace, pod, "NVLink clique")
    assert "0/1 nodes are available: 1 no free 4-GPU NVLink clique." in msg
    pair = gputopo_pod(kube, namespace, test_id, "tp2", 2)
    node, gpus, _ = placement(kube, namespace, pair)
    published = kube.get_node(dgx1)["metadata"]["annotations"][GPUS_IN_USE_ANNOTATION]
    assert node == dgx1 and parse_gpus_in_use(published) == {1, 5}
    assert gpus in ([2, 3], [6, 7], [0, 3], [4, 7])


def test_8_gpu_pods_land_on_separate_nvswitch_nodes_with_every_gpu(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    names = nodes.add(GpuNode("h100-a", "dgx-h100"), GpuNode("h100-b", "dgx-h100"))
    pods = [gputopo_pod(kube, namespace, test_id, f"tp8-{i}", 8) for i in range(2)]
    placed = [placement(kube, namespace, p) for p in pods]
    assert sorted(p[0] for p in placed) == sorted(names)
    assert all(p[1] == list(range(8)) for p in placed)
    assert "NV18 via NVSwitch" in described(kube, namespace, pods[0])


def test_node_with_a_down_nvlink_link_is_avoided_and_the_reason_is_visible(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    doc = json.loads(build_system("dgx-h100").to_annotation())
    doc["degradedLinks"] = [{"gpu": 3, "link": 7, "state": "down", "detail": "link inactive"}]
    for j in range(8):
        if j != 3:
            doc["nvlink"]["links"][3][j] = doc["nvlink"]["links"][j][3] = 17
    broken = parse_topology(json.dumps(doc))
    _, good = nodes.add(GpuNode("h100-broken", topology=broken), GpuNode("h100-ok", "dgx-h100"))
    first = gputopo_pod(kube, namespace, test_id, "tp8-first", 8)
    assert placement(kube, namespace, first)[0] == good
    second = gputopo_pod(kube, namespace, test_id, "tp8-second", 8)
    msg = failed_scheduling(kube, namespace, second, "NVLink degraded")
    # the full node is refused by kube-scheduler's own GPU count before the extender sees it
    assert "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 NVLink degraded." in msg
    assert "NVLink degraded" in described(kube, namespace, second)


def test_min_gpu_memory_100gi_chooses_h200_over_h100(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    h100, h200 = nodes.add(GpuNode("h100", "dgx-h100"), GpuNode("h200", "hgx-h200"))
    pod = gputopo_pod(kube, namespace, test_id, "big-kv", 2, {"gputopo.io/min-gpu-memory": "100Gi"})
    assert placement(kube, namespace, pod)[0] == h200
    # the H100 is rejected for memory, a reason nothing can fix
    small = gputopo_pod(kube, namespace, test_id, "too-big", 8, {"gputopo.io/min-gpu-memory": "150Gi"})
    assert "fewer than 8 GPUs with 150Gi HBM" in failed_scheduling(kube, namespace, small, "HBM")
    assert h100


def test_four_stage_infiniband_group_lands_one_stage_per_node_under_one_leaf(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    leaf = {"gputopo.io/network-spine": "spine-a"}
    added = nodes.add(
        *[GpuNode(f"l1-{i}", "dgx-h100", labels={**leaf, "gputopo.io/network-leaf": "leaf-1"}) for i in range(3)],
        *[GpuNode(f"l2-{i}", "dgx-h100", labels={**leaf, "gputopo.io/network-leaf": "leaf-2"}) for i in range(4)],
        GpuNode("roce", "a100-pcie-bridged", labels={**leaf, "gputopo.io/network-leaf": "leaf-2"}),
    )
    leaf2 = {n for n in added if "-l2-" in f"-{n}"}
    ann = {
        "gputopo.io/group": "llama",
        "gputopo.io/group-size": "4",
        "gputopo.io/network": "infiniband",
        "gputopo.io/required-tier": "spine",
        "gputopo.io/preferred-tier": "leaf",
    }
    pods = [
        gputopo_pod(kube, namespace, test_id, f"llama-{i}", 8, {**ann, "gputopo.io/stage": str(i)}) for i in range(4)
    ]
    bound = kube.wait_pods_bound(namespace, pods, timeout=60)
    assert set(bound.values()) == leaf2, "one stage per node, all four under leaf-2"
    text = described(kube, namespace, "llama-2")
    assert "stage 2/4 shares leaf leaf-2 with stages 0-1,3" in text


def test_group_waits_for_its_members_then_places_all_of_them(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    nodes.add(*[GpuNode(f"g{i}", "dgx-h100") for i in range(3)])
    ann = {"gputopo.io/group": "trio", "gputopo.io/group-size": "3"}
    first = [gputopo_pod(kube, namespace, test_id, f"trio-{i}", 8, ann) for i in range(2)]
    # Each member is tried at least once on creation and must be told the group is incomplete.
    # Whether trio-0 is retried after trio-1 exists is kube-scheduler's business, so accept 1/3 or 2/3.
    for pod in first:
        msg = failed_scheduling(kube, namespace, pod, "pods exist, waiting")
        assert msg.startswith("0/")
        assert re.search(r"group trio: [12]/3 pods exist, waiting", msg), msg
    assert not any(kube.get_pod(namespace, p)["spec"].get("nodeName") for p in first)
    last = gputopo_pod(kube, namespace, test_id, "trio-2", 8, ann)
    bound = kube.wait_pods_bound(namespace, [*first, last], timeout=90)
    assert len(set(bound.values())) == 3


def test_malformed_annotation_gives_a_clear_reason_and_changes_nothing(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    before = kube.get_node(node)["metadata"]["annotations"]
    pod = gputopo_pod(kube, namespace, test_id, "typo", 4, {"gputopo.io/nvlink": "sometimes"})
    msg = failed_scheduling(kube, namespace, pod, "invalid annotation")
    assert 'invalid annotation gputopo.io/nvlink="sometimes": must be one of required, preferred, ignore' in msg
    got = kube.get_pod(namespace, pod)
    assert PLACEMENT_ANNOTATION not in got["metadata"].get("annotations", {})
    assert not got["spec"].get("nodeName")
    after = kube.get_node(node)["metadata"]["annotations"]
    assert {k: v for k, v in after.items() if k.startswith("gputopo.io/")} == {
        k: v for k, v in before.items() if k.startswith("gputopo.io/")
    }
    # a well-formed pod right after it is placed normally
    ok = gputopo_pod(kube, namespace, test_id, "fine", 4)
    assert placement(kube, namespace, ok)[0] == node


def test_plain_pods_under_the_same_scheduler_are_unaffected(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("l40s", "l40s-4"))
    for name, gpus in (("plain-gpu", 1), ("plain-cpu", 0)):
        kube.create_pod(
            pod_manifest(
                name,
                namespace=namespace,
                gpus=gpus,
                scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector={TEST_LABEL: test_id}),
            )
        )
    bound = kube.wait_pods_bound(namespace, ["plain-gpu", "plain-cpu"], timeout=45)
    assert set(bound.values()) == {node}
    for name in ("plain-gpu", "plain-cpu"):
        pod = kube.get_pod(namespace, name)
        assert PLACEMENT_ANNOTATION not in pod["metadata"].get("annotations", {})
        assert "TopologyPlacement" not in described(kube, namespace, name)


def test_extender_restart_loses_no_assumed_allocation_or_reservation(
    kube: KubeClient, stack: Stack, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    first = gputopo_pod(kube, namespace, test_id, "half-1", 4)
    _, gpus1, _ = placement(kube, namespace, first)
    # The agent would report these GPUs only once containers run (never, without a kubelet):
    # only the placement annotation records them.
    stack.restart_extender()
    second = gputopo_pod(kube, namespace, test_id, "half-2", 4)
    n2, gpus2, _ = placement(kube, namespace, second)
    assert n2 == node and set(gpus1).isdisjoint(gpus2)
    # and a second restart still knows both: a 1-GPU pod can only be refused (kube-scheduler counts 8 of 8)
    stack.restart_extender()
    third = gputopo_pod(kube, namespace, test_id, "half-3", 1)
    assert "Insufficient nvidia.com/gpu" in failed_scheduling(kube, namespace, third, "Insufficient")
    kube.delete_pod(namespace, first)
    bound_after_nudges(kube, namespace, third, node)
    n3, gpus3, _ = placement(kube, namespace, third)
    assert n3 == node and set(gpus3) <= set(gpus1), "only the deleted pod's GPUs are free again"


def test_group_reservation_survives_an_extender_restart(
    kube: KubeClient, stack: Stack, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    nodes.add(*[GpuNode(f"r{i}", "dgx-h100") for i in range(2)])
    ann = {"gputopo.io/group": "duo", "gputopo.io/group-size": "2"}
    a = gputopo_pod(kube, namespace, test_id, "duo-0", 8, ann)
    b = gputopo_pod(kube, namespace, test_id, "duo-1", 8, ann)
    kube.wait_pod_bound(namespace, a, timeout=60)
    stack.restart_extender()
    bound = kube.wait_pods_bound(namespace, [a, b], timeout=60)
    assert len(set(bound.values())) == 2


def test_agent_that_stops_heartbeating_makes_its_node_stale(
    kube: KubeClient, stack: Stack, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    stack.stop_agent(node)
    time.sleep(STALE_AFTER + 2)
    pod = gputopo_pod(kube, namespace, test_id, "after-stale", 2)
    assert "1 GPU topology stale" in failed_scheduling(kube, namespace, pod, "GPU topology stale")
    # The agent comes back: its Lease makes the node usable again. kube-scheduler does not watch
    # Leases, so the waiting pod is retried on the next cluster event (here node labels).
    restarted = time.time()
    stack.cp.start_component(stack.agent_component(node))
    stack.wait_heartbeat(node, after=restarted)
    bound_after_nudges(kube, namespace, pod, node)
    assert placement(kube, namespace, pod)[0] == node


def test_agent_republishes_gpus_in_use_and_extender_respects_them(
    kube: KubeClient, stack: Stack, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    stack.set_in_use(node, [0, 1, 2, 3, 4, 5])
    stack.wait_node_annotation(
        node, "gputopo.io/gpus-in-use", lambda v: v is not None and parse_gpus_in_use(v) == set(range(6))
    )
    pod = gputopo_pod(kube, namespace, test_id, "pair", 2)
    assert placement(kube, namespace, pod)[1] == [6, 7]


def _cli(stack: Stack, *args: str) -> str:
    import subprocess

    exe = stack._exe("gputopo")
    done = subprocess.run(
        [exe, *args, f"--kubeconfig={stack.cp.kubeconfig}", f"--stale-after-seconds={STALE_AFTER}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_gputopo_topo_shows_a_live_node_like_nvidia_smi(stack: Stack, nodes: StackNodes) -> None:
    (dgx1,) = nodes.add(GpuNode("dgx1v", "dgx-1v", in_use=[1]))
    out = _cli(stack, "topo", dgx1)
    assert "GPU0  X     NV1   NV1   NV2   NV2   SYS" in out
    assert "GPUs in use: 1" in out
    assert "(fresh)" in out
    assert "gputopo.io/nvlink-domain=4" in out


def test_gputopo_explain_lists_every_verdict_and_changes_nothing(
    kube: KubeClient, stack: Stack, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    h100, l40s = nodes.add(GpuNode("h100", "dgx-h100"), GpuNode("l40s", "l40s-4"))
    pod = gputopo_pod(kube, namespace, test_id, "tp8", 8)
    node, _, _ = placement(kube, namespace, pod)
    before = kube.get_pod(namespace, pod)["metadata"]["resourceVersion"]
    out = _cli(stack, "explain", "-n", namespace, pod)
    assert f"Bound to {node}, GPUs 0-7" in out
    assert f"{h100}" in out and "fits" in out
    assert f"{l40s}" in out and "fewer than 8 GPUs: node has 4 GPUs, pod needs 8" in out
    assert kube.get_pod(namespace, pod)["metadata"]["resourceVersion"] == before


def test_the_scheduler_runs_the_charts_configuration_with_only_the_local_rewrites(
    control_plane: ControlPlane, stack: Stack
) -> None:
    (pod,) = stack.pods
    running = json.loads((control_plane.dir / f"scheduler-{pod.scheduler}.yaml").read_text())
    chart = stack.chart.scheduler_config()
    assert running["clientConnection"]["kubeconfig"] == str(pod.kubeconfig)
    (ext,) = running["extenders"]
    assert ext["urlPrefix"] == pod.extender_url and pod.extender_url.startswith("http://127.0.0.1:")
    (chart_ext,) = chart["extenders"]
    rewritten = {"urlPrefix", "enableHTTPS", "tlsConfig"}
    assert {k: v for k, v in ext.items() if k not in rewritten} == {
        k: v for k, v in chart_ext.items() if k not in rewritten
    }
    assert {k: v for k, v in running.items() if k not in ("clientConnection", "extenders")} == {
        k: v for k, v in chart.items() if k not in ("clientConnection", "extenders")
    }
    # The scheduler and its sidecar both authenticate as the chart's scheduler service account.
    with KubeClient(pod.kubeconfig) as as_pod:
        assert as_pod.whoami()["username"] == (
            f"system:serviceaccount:{stack.namespace}:{stack.chart.scheduler_service_account}"
        )


def test_mutating_webhook_lets_the_annotation_alone_opt_a_pod_in(
    kube: KubeClient, control_plane: ControlPlane, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    # The webhook is the extender's own HTTPS listener (the apiserver calls webhooks only over TLS).
    hook = Stack(control_plane, kube, scheduler=SchedulerPods(extender_name="gputopo-extender-webhook", webhook=True))
    hook.start_extender()
    assert hook.ca_file is not None and hook.webhook_url.startswith("https://127.0.0.1:")
    name = f"gputopo-e2e-{test_id}"[:63]
    hook.route_pods_to_webhook(name, namespace)
    try:
        annotated = pod_manifest(
            "opted-in",
            namespace=namespace,
            gpus=4,
            annotations={"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(node_selector={TEST_LABEL: test_id}),
        )  # schedulerName: default-scheduler, as a user would leave it
        plain = pod_manifest(
            "not-opted-in", namespace=namespace, gpus=1, scheduling=PodScheduling(node_selector={TEST_LABEL: test_id})
        )
        kube.create_pod(annotated)
        kube.create_pod(plain)
        assert kube.get_pod(namespace, "opted-in")["spec"]["schedulerName"] == "gputopo-scheduler"
        assert kube.get_pod(namespace, "not-opted-in")["spec"]["schedulerName"] == "default-scheduler"
        assert placement(kube, namespace, "opted-in")[0] == node
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}")
        hook.stop()
