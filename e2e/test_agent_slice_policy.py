"""The agent's ResourceSlice writes on a real kube-apiserver: the chart's agent ValidatingAdmissionPolicy
with agent.dra.enabled, applied as every e2e stack applies the chart's access objects (`Stack.install`,
rendered for the control plane's own release), judged on requests made with the agent's own identity: a
token of its service account bound to its Node, as the kubelet projects it into the agent's pod, so the
request carries the user extra `authentication.kubernetes.io/node-name` the policy reads.

RBAC grants the agent create, update and delete on every ResourceSlice in the cluster. The policy admits
the slices of its own node's pool of `gpu.gputopo.io` (the singles slice, and from 1.36 the pool with
clique blocks and its counters slice) and refuses, with its message, every other: another node's pool,
its own node with another node's pool name, another node as `spec.nodeName`, our driver for all nodes,
another driver's slice on its own node, an update moving a slice between nodes or pools, the delete of
another node's or another driver's slice; and any slice from a token bound to no node. A refused write
leaves the object as it was. tests/adversarial/test_agent_slice_writes.py reads the same CEL as Python.
No kubelet, scheduler or agent process runs: only the API server judges.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gputopo.agent.dra.pool import desired_pool
from gputopo.agent.dra.slices import SliceShape, desired_spec, slice_name
from gputopo.localcluster import ControlPlane, KubeApiError, KubeClient, SimNode
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.stack import ChartRelease, Stack
from gputopo.model.dra import DRIVER
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
DENIED = (403, 422)
# The policy's messages (charts/gputopo/templates/agent-validatingadmissionpolicy.yaml).
REFUSED = (
    "gputopo-agent may write only ResourceSlices of gpu.gputopo.io with its own node as spec.nodeName "
    "and as the pool's name"
)
UNBOUND = "gputopo-agent must use a node-bound service-account token"
BLOCKS_SINCE = (1, 36)  # partitionable devices on by default: the pool's counters slice is kept as written
Spec = dict[str, Any]


def _release(cp: ControlPlane) -> tuple[int, int, int]:
    return kubernetes_version(cp.bin_dir)


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Stack:
    """The chart's access objects for DRA agents, rendered and applied as e2e/test_dra_blocks.py does."""
    version = ".".join(map(str, _release(control_plane)))
    s = Stack(control_plane, kube, chart=ChartRelease(dra=True, kube_version=version))
    s.install()
    return s


def _agent(cp: ControlPlane, kube: KubeClient, stack: Stack, node: str | None) -> KubeClient:
    """A client with a token of the agent's service account bound to `node` (None: bound to nothing)."""
    sa = stack.chart.agent_service_account
    token = kube.create_token(stack.namespace, sa, bound_node=node, expiration_seconds=3600)
    return cp.token_client(token, user=f"agent-{node or 'unbound'}")


DEVICES = desired_spec("gpu-node", build_system("dgx-h100"), SliceShape(list_attributes=False, device_taints=False))[
    "devices"
]


def _slice(name: str, node: str | None, pool: str, driver: str = DRIVER, **extra: Any) -> Spec:
    """A ResourceSlice with a DGX H100's devices as the agent publishes them; `node` None: no nodeName."""
    spec: Spec = {"driver": driver, "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1}}
    if node is not None:
        spec["nodeName"] = node
    spec = {**spec, "devices": DEVICES, **extra}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


def _refused(err: KubeApiError, message: str = REFUSED) -> None:
    assert err.status in DENIED, err
    assert "ValidatingAdmissionPolicy" in err.message and message in err.message, err.message


@pytest.fixture(scope="module")
def policy_active(control_plane: ControlPlane, kube: KubeClient, stack: Stack) -> str:
    """The policy's name, as the API server holds it and in force: RBAC and policies reach admission
    asynchronously, so wait until a forged slice (a dry run: nothing is written) is refused."""
    for group, resource in (
        ("admissionregistration.k8s.io/v1", "validatingadmissionpolicies"),
        ("resource.k8s.io/v1", "resourceslices"),
    ):
        served = {r["name"] for r in kube.request("GET", f"/apis/{group}")["resources"]}
        assert resource in served, (group, sorted(served))
    name = stack.chart.component("ValidatingAdmissionPolicy", "agent")["metadata"]["name"]
    live = kube.request("GET", f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}")
    assert any(r["resources"] == ["resourceslices"] for r in live["spec"]["matchConstraints"]["resourceRules"])
    probe = f"slice-policy-probe-{secrets.token_hex(3)}"
    kube.create_node(SimNode(probe, gpus=0))
    try:
        with _agent(control_plane, kube, stack, probe) as agent:
            deadline = time.monotonic() + 30
            while not agent.can_i("create", "resource.k8s.io/resourceslices"):
                assert time.monotonic() < deadline, "the agent's RBAC never took effect"
                time.sleep(0.3)
            while True:
                try:
                    agent.request("POST", SLICES, _slice(probe, "elsewhere", "elsewhere"), query={"dryRun": "All"})
                except KubeApiError as e:
                    _refused(e)
                    return str(name)
                assert time.monotonic() < deadline, "the agent ValidatingAdmissionPolicy never took effect"
                time.sleep(0.3)
    finally:
        kube.delete_node(probe)


@dataclass
class Nodes:
    """A test's two nodes: the agent's own (its token is bound to it) and another; the slices made."""

    own: str
    other: str
    made: list[str] = field(default_factory=list)


@pytest.fixture
def nodes(kube: KubeClient, make_nodes: Any, test_id: str, policy_active: str) -> Iterator[Nodes]:
    assert policy_active
    own, other = make_nodes([SimNode(f"{test_id}-own", gpus=0), SimNode(f"{test_id}-other", gpus=0)])
    made = Nodes(own, other)
    yield made
    for name in made.made:
        try:
            kube.request("DELETE", f"{SLICES}/{name}")
        except KubeApiError as e:
            if e.status != 404:
                raise


@pytest.fixture
def agent(control_plane: ControlPlane, kube: KubeClient, stack: Stack, nodes: Nodes) -> Iterator[KubeClient]:
    """The agent of the test's own node."""
    with _agent(control_plane, kube, stack, nodes.own) as client:
        yield client


# --- what the agent writes is admitted ----------------------------------------------------


def _agents_slices(kube: KubeClient, node: str, blocks: bool) -> list[Spec]:
    """The slices the agent itself writes for `node`, in its order (the pool's counters slice first), at
    generation 1, owned by the Node as the agent's are."""
    topo = build_system("dgx-h100", node)
    shape = SliceShape(list_attributes=False, device_taints=False, best_fit_order=True, blocks=blocks)
    specs = desired_pool(node, topo, shape) if blocks else {slice_name(node): desired_spec(node, topo, shape)}
    owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": kube.get_node(node)["metadata"]["uid"]}
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name, "ownerReferences": [{**owner, "controller": True}]},
            "spec": {**spec, "pool": {**spec["pool"], "generation": 1}},
        }
        for name, spec in specs.items()
    ]


@pytest.mark.parametrize("blocks", [False, True], ids=["singles-slice", "pool-with-blocks-and-counters"])
def test_the_agent_creates_updates_and_deletes_its_own_pools_slices(
    control_plane: ControlPlane, kube: KubeClient, nodes: Nodes, agent: KubeClient, blocks: bool
) -> None:
    if blocks and _release(control_plane)[:2] < BLOCKS_SINCE:
        pytest.skip("a counters slice needs partitionable devices: on by default from 1.36")
    slices = _agents_slices(kube, nodes.own, blocks)
    assert len(slices) == (2 if blocks else 1)  # a DGX H100 pool: its counters slice and one of 15 devices
    for body in slices:
        nodes.made.append(body["metadata"]["name"])
        agent.request("POST", SLICES, body)
    for body in slices:
        path = f"{SLICES}/{body['metadata']['name']}"
        current = agent.request("GET", path)
        current["spec"]["pool"]["generation"] = 2  # what the agent's next publish writes
        assert agent.request("PUT", path, current)["spec"]["pool"]["generation"] == 2
    for body in slices:
        agent.request("DELETE", f"{SLICES}/{body['metadata']['name']}")
    left = kube.request("GET", SLICES, query={"fieldSelector": f"spec.nodeName={nodes.own}"})["items"]
    assert [s["metadata"]["name"] for s in left] == []


# --- every forged write is refused, with the policy's message -----------------------------


@dataclass(frozen=True)
class Forged:
    """A slice write by the agent of node `own`: `before`, the slice the cluster holds first (written by
    the admin), `after`, what the agent sends (None for a delete), each (spec.nodeName, pool, driver) with
    nodes "own" and "other"; `refusal`, what refuses it: the policy's message, or the API server's own
    validation, which refuses a change of `spec.nodeName` or the pool's name before any admission policy
    sees it (the policy's check of both objects of an update stays, should that ever change)."""

    operation: str
    before: tuple[str | None, str, str] | None
    after: tuple[str | None, str, str] | None
    extra: tuple[tuple[str, Any], ...] = ()
    refusal: str = REFUSED


IMMUTABLE = "field is immutable"
FORGED = [
    pytest.param(Forged("CREATE", None, ("other", "other", DRIVER)), id="create-another-node's-slice"),
    pytest.param(Forged("CREATE", None, ("own", "other", DRIVER)), id="create-own-node-with-another-node's-pool"),
    pytest.param(Forged("CREATE", None, ("other", "own", DRIVER)), id="create-own-pool-with-another-nodeName"),
    pytest.param(Forged("CREATE", None, ("own", "own", "gpu.nvidia.com")), id="create-another-driver's-slice"),
    pytest.param(
        Forged("CREATE", None, (None, "own", DRIVER), (("allNodes", True),)), id="create-our-driver-for-all-nodes"
    ),
    pytest.param(
        Forged("UPDATE", ("other", "other", DRIVER), ("other", "other", DRIVER)),
        id="update-another-node's-slice-in-place",
    ),
    pytest.param(
        Forged("UPDATE", ("own", "own", "x.example.com"), ("own", "own", "x.example.com")),
        id="update-another-driver's-slice-on-own-node",
    ),
    pytest.param(
        Forged("UPDATE", ("other", "other", DRIVER), ("own", "own", DRIVER), refusal=IMMUTABLE),
        id="update-another-node's-slice-to-own",
    ),
    pytest.param(
        Forged("UPDATE", ("own", "own", DRIVER), ("own", "other", DRIVER), refusal=IMMUTABLE),
        id="update-own-slice-into-another-pool",
    ),
    pytest.param(Forged("DELETE", ("other", "other", DRIVER), None), id="delete-another-node's-slice"),
    pytest.param(
        Forged("DELETE", ("own", "own", "gpu.nvidia.com"), None), id="delete-another-driver's-slice-on-own-node"
    ),
]


@pytest.mark.parametrize("case", FORGED)
def test_a_forged_slice_write_is_refused_and_changes_nothing(
    kube: KubeClient, nodes: Nodes, agent: KubeClient, test_id: str, case: Forged
) -> None:
    named = {"own": nodes.own, "other": nodes.other, None: None}
    name = f"{test_id}-slice"
    nodes.made.append(name)

    def body(fields: tuple[str | None, str, str]) -> Spec:
        node, pool, driver = fields
        return _slice(name, named[node], str(named[pool]), driver, **dict(case.extra))

    if case.before is not None:
        kube.request("POST", SLICES, body(case.before))
    before = kube.request("GET", f"{SLICES}/{name}") if case.before is not None else None
    with pytest.raises(KubeApiError) as err:
        if case.operation == "CREATE":
            assert case.after is not None
            agent.request("POST", SLICES, body(case.after))
        elif case.operation == "UPDATE":
            assert case.after is not None and before is not None
            sent = body(case.after)
            sent["metadata"]["resourceVersion"] = before["metadata"]["resourceVersion"]
            sent["spec"]["pool"]["generation"] = 2
            agent.request("PUT", f"{SLICES}/{name}", sent)
        else:
            agent.request("DELETE", f"{SLICES}/{name}")
    if case.refusal == IMMUTABLE:
        assert err.value.status == 422 and IMMUTABLE in err.value.message, err.value
    else:
        _refused(err.value, case.refusal)
    if before is None:
        with pytest.raises(KubeApiError) as gone:
            kube.request("GET", f"{SLICES}/{name}")
        assert gone.value.status == 404
    else:
        after = kube.request("GET", f"{SLICES}/{name}")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_a_token_bound_to_no_node_writes_no_slice(
    control_plane: ControlPlane, kube: KubeClient, stack: Stack, nodes: Nodes
) -> None:
    name = slice_name(nodes.own)
    nodes.made.append(name)
    with _agent(control_plane, kube, stack, None) as unbound, pytest.raises(KubeApiError) as err:
        unbound.request("POST", SLICES, _slice(name, nodes.own, nodes.own))
    _refused(err.value, UNBOUND)
