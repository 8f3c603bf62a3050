"""Who may place a pod: the chart's ValidatingAdmissionPolicy on the real kube-apiserver lets only the
scheduler's service account (the scheduler pod, whose extender sidecar binds) set or change
``gputopo.io/placement``, on pod create and update and on ``pods/binding``. Everyone else, whatever
RBAC lets them do to pods, is refused with a message naming the annotation; so are the pods a
controller (kube-controller-manager's Job controller) makes from a template that carries one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from workloads import create, events_about, indexed_job, live_pods, pod_template

from conftest import serve
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.kube import KubeApiError
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, Placement, parse_placement

pytestmark = pytest.mark.e2e

DENIED = (403, 422)
FORGED = Placement(node="any-node", gpus=(0, 1), score=10, reason="forged").to_annotation()


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    yield from serve(Stack(control_plane, kube, timing=StackTiming(stale_after_seconds=60)))


@pytest.fixture(scope="module")
def policy_active(kube: KubeClient, stack: Stack) -> str:
    """A namespace where the placement policy is in force (policies reach admission asynchronously)."""
    assert stack.pods, "the stack applied the chart's policies"
    ns = f"trust-probe-{int(time.time() * 1000) % 100000}"
    kube.create_namespace(ns)
    deadline = time.monotonic() + 30
    for attempt in range(1000):
        probe = pod_manifest(f"probe-{attempt}", namespace=ns, scheduling=PodScheduling(scheduler_name="none"))
        probe["metadata"]["annotations"] = {PLACEMENT_ANNOTATION: FORGED}
        try:
            kube.create_pod(probe)
        except KubeApiError as e:
            assert e.status in DENIED and PLACEMENT_ANNOTATION in e.message, e
            return ns
        kube.delete_pod(ns, f"probe-{attempt}")
        assert time.monotonic() < deadline, "the placement policy never took effect"
        time.sleep(0.3)
    raise AssertionError("unreachable")


@pytest.fixture
def user(control_plane: ControlPlane, kube: KubeClient, namespace: str, policy_active: str) -> Iterator[KubeClient]:
    """A user whose RBAC allows everything on pods in the namespace, bindings included."""
    assert policy_active
    kube.create_service_account(namespace, "alice")
    kube.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "pod-admin", "namespace": namespace},
                "rules": [
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
                    {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "alice-pod-admin", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-admin"},
                "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": namespace}],
            },
        ]
    )
    client = control_plane.token_client(kube.create_token(namespace, "alice"), user="alice")
    deadline = time.monotonic() + 15
    while not client.can_i("create", "pods", namespace=namespace, subresource="binding"):
        assert time.monotonic() < deadline, "alice's RBAC never took effect"
        time.sleep(0.2)
    try:
        yield client
    finally:
        client.close()


def _pending_pod(ns: str, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    # No scheduler will take it.
    pod = pod_manifest(name, namespace=ns, gpus=2, scheduling=PodScheduling(scheduler_name="none"))
    if annotations:
        pod["metadata"]["annotations"] = annotations
    return pod


def _refused(err: KubeApiError) -> None:
    assert err.status in DENIED, err
    assert "ValidatingAdmissionPolicy" in err.message and PLACEMENT_ANNOTATION in err.message, err.message


def test_a_user_creating_a_pod_with_a_placement_is_refused_naming_the_annotation(
    kube: KubeClient, user: KubeClient, namespace: str
) -> None:
    with pytest.raises(KubeApiError) as err:
        user.create_pod(_pending_pod(namespace, "forged", {PLACEMENT_ANNOTATION: FORGED}))
    _refused(err.value)
    assert not [p for p in kube.list_pods(namespace) if p["metadata"]["name"] == "forged"]
    # The same user creates the same pod without the annotation.
    user.create_pod(_pending_pod(namespace, "honest", {"gputopo.io/nvlink": "required"}))


def test_patching_a_placement_onto_an_existing_pod_is_refused_even_for_cluster_admin(
    kube: KubeClient, user: KubeClient, namespace: str
) -> None:
    user.create_pod(_pending_pod(namespace, "victim"))
    for who in (user, kube):
        with pytest.raises(KubeApiError) as err:
            who.patch_pod(namespace, "victim", {"metadata": {"annotations": {PLACEMENT_ANNOTATION: FORGED}}})
        _refused(err.value)
    assert PLACEMENT_ANNOTATION not in kube.get_pod(namespace, "victim")["metadata"].get("annotations", {})
    # Other annotations are the user's business.
    user.patch_pod(namespace, "victim", {"metadata": {"annotations": {"example.com/note": "fine"}}})


def test_a_binding_carrying_a_placement_from_another_identity_is_refused(
    kube: KubeClient, user: KubeClient, make_nodes: Any, namespace: str, test_id: str
) -> None:
    from gputopo.localcluster import SimNode

    (node,) = make_nodes([SimNode(f"{test_id}-n", gpus=8)])
    user.create_pod(_pending_pod(namespace, "unbound"))
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {
            "name": "unbound",
            "namespace": namespace,
            "annotations": {
                PLACEMENT_ANNOTATION: Placement(node=node, gpus=(0, 1), score=10, reason="forged").to_annotation()
            },
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    with pytest.raises(KubeApiError) as err:
        user.request("POST", f"/api/v1/namespaces/{namespace}/pods/unbound/binding", binding)
    _refused(err.value)
    pod = kube.get_pod(namespace, "unbound")
    assert not pod["spec"].get("nodeName")
    assert PLACEMENT_ANNOTATION not in pod["metadata"].get("annotations", {})


@pytest.mark.usefixtures("policy_active")
def test_the_schedulers_own_bind_succeeds_and_the_pod_carries_the_placement(
    kube: KubeClient, stack: Stack, namespace: str, test_id: str
) -> None:
    (node,) = [f"trust-h100-{test_id[-6:]}"]
    stack.add_nodes([GpuNode(node, "dgx-h100")], extra_labels={TEST_LABEL: test_id})
    try:
        stack.wait_published([node])
        kube.create_pod(
            pod_manifest(
                "placed",
                namespace=namespace,
                gpus=4,
                annotations={"gputopo.io/nvlink": "required"},
                scheduling=PodScheduling(scheduler_name=stack.scheduler_name, node_selector={TEST_LABEL: test_id}),
            )
        )
        assert kube.wait_pod_bound(namespace, "placed", timeout=60) == node
        p = parse_placement(kube.get_pod(namespace, "placed")["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert p.node == node and len(p.gpus) == 4
        # The identity that bound it: the scheduler pod's service account, the one the policy exempts.
        with KubeClient(stack.extender_kubeconfig(stack.pods[0])) as sidecar:
            assert sidecar.whoami()["username"] == (
                f"system:serviceaccount:{stack.namespace}:{stack.chart.scheduler_service_account}"
            )
    finally:
        stack.cp.remove(stack.agent_component(node), grace=2)
        kube.delete_node(node)


@pytest.mark.usefixtures("policy_active")
def test_jobs_template_with_placement_is_refused(kube: KubeClient, namespace: str) -> None:
    """The Job controller creates pods with its own service account; the policy refuses a placement
    in the template as it refuses any other identity's, and the Job says so in a FailedCreate event."""
    template = pod_template(_pending_pod(namespace, "t", {PLACEMENT_ANNOTATION: FORGED}))
    create(kube, indexed_job("forged-job", namespace, template, completions=1))
    deadline = time.monotonic() + 60
    while True:
        failed = [e for e in events_about(kube, namespace, "Job", "forged-job") if e.get("reason") == "FailedCreate"]
        if failed:
            break
        assert time.monotonic() < deadline, "the Job controller reported no FailedCreate"
        time.sleep(0.3)
    message = failed[0].get("message", "")
    assert "ValidatingAdmissionPolicy" in message and PLACEMENT_ANNOTATION in message, message
    assert (failed[0].get("source") or {}).get("component") == "job-controller", failed[0]
    assert not live_pods(kube, namespace, "batch.kubernetes.io/job-name=forged-job")
