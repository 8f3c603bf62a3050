"""End to end under DRA: gputopo's agent as the node's DRA driver, a real kubelet, and kube-scheduler's
DynamicResources plugin choosing the GPUs from the attributes the agent publishes.

Each kubelet node is DGX-1V-shaped (the hybrid cube mesh: quads 0-3 and 4-7 are the only 4-GPU
cliques; the cross-quad pairs 0-4, 1-5, 2-6 and 3-7 are linked too), run by an upstream kubelet on
Kubernetes' fake CRI. Its gputopo-agent runs with `--dra`: it registers with the kubelet's plugin
watcher, publishes one ResourceSlice, and serves NodePrepareResources. Claims come from the same
builder the webhook uses (`gputopo.engine.dra.claims`): the scalar partitions on every release, and the
list attribute where the API server serves it (`DRAListTypeAttributes`, alpha from 1.36).

GPUs are taken with "pin" pods whose one-device claims select a GPU by its `index` attribute, so the
tests say exactly which GPUs are in use. One node's agent reads the NVML mock library through
nvidia-ml-py (`--backend nvml`) instead of a fixture, and loses a GPU under it. Needs root (a private
mount namespace per kubelet) and the kubelet and fakecri binaries; skipped otherwise.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from itertools import combinations
from typing import Any

import pytest

from gputopo.engine.cluster.explain import gpu_ranges
from gputopo.engine.dra.claims import claim_template
from gputopo.engine.state.cliques import mask_of
from gputopo.engine.state.snapshot import shape_of
from gputopo.localcluster import PLAIN_PROFILE, TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.kubelet import kubelet_unavailable
from gputopo.localcluster.nvmlmock import profile_for_system
from gputopo.localcluster.stack import ChartRelease, KubeletAgent, SchedulerPods, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, NvlinkPolicy, PodRequest, parse_placement
from gputopo.model.dra import DEVICE_CLASS, DRIVER, device_gpus, device_index
from gputopo.model.topology import Health
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

SYSTEM = "dgx-1v"
NS = "default"
ADJ = shape_of(build_system(SYSTEM)).adj


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def _is_clique(gpus: Sequence[int]) -> bool:
    return all(ADJ[a] >> b & 1 for a, b in combinations(gpus, 2))


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    reason = kubelet_unavailable(control_plane.bin_dir)
    if reason is not None:
        pytest.skip(reason)
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=2, interval_seconds=1),
        scheduler=SchedulerPods(extender_name="gputopo-extender-dra"),
        chart=ChartRelease(dra=True),  # the chart's DRA RBAC and its DeviceClass
    )
    # The chart's scheduler profile with agent.dra.enabled: kube-scheduler calls the extender for every
    # pod, and the extender reads our ResourceSlices and ResourceClaims.
    s.start()
    yield s
    control_plane.remove(s.scheduler_name)
    control_plane.remove(s.extender_name, grace=3)


def _plain_scheduler(stack: Stack) -> str:
    """The scheduler without the extender (the session's `plain_scheduler`), started here if it is not yet."""
    try:
        stack.cp.scheduler_port(PLAIN_PROFILE)
    except KeyError:
        stack.cp.start_plain_scheduler()
    return PLAIN_PROFILE


class DraNode:
    """One test's DRA kubelet node, and the pods and claim templates it makes."""

    def __init__(
        self,
        stack: Stack,
        test_id: str,
        *,
        list_attributes: bool = False,
        best_fit: bool = False,
        suffix: str = "",
        nvml: bool = False,
        blocks: bool = False,
    ) -> None:
        self.stack = stack
        self.kube = stack.kube
        self.test_id = test_id
        self.list_attributes = list_attributes
        self.name = f"dra-{hashlib.sha256(test_id.encode()).hexdigest()[:8]}{suffix}"
        stack.add_kubelet_node(
            self.name,
            SYSTEM,
            labels={TEST_LABEL: test_id},
            agent=KubeletAgent(
                dra=True,
                dra_list_attributes=list_attributes,
                dra_best_fit_order=best_fit,
                dra_blocks=blocks,
                nvml=nvml,
            ),
        )
        self.kubelet = stack.kubelets[self.name]
        self.pods: list[str] = []

    def template(self, name: str, devices: dict[str, Any]) -> str:
        self.kube.apply(
            [
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaimTemplate",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"spec": {"devices": devices}},
                }
            ]
        )
        return name

    def tp_template(self, gpus: int, nvlink: NvlinkPolicy = NvlinkPolicy.REQUIRED) -> str:
        """The template gputopo's webhook gives a pod asking for `gpus` GPUs under `nvlink`."""
        t = claim_template(PodRequest(gpus=gpus, nvlink=nvlink), list_attributes=self.list_attributes)
        return self.template(t.name, dict(t.devices))

    def pin_template(self, indices: Sequence[int]) -> str:
        expr = f'device.attributes["{DRIVER}"].index in [{", ".join(map(str, indices))}]'
        selector = [{"cel": {"expression": expr}}]
        name = f"pin-{'-'.join(map(str, indices))}"
        return self.template(
            name,
            {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {"deviceClassName": DEVICE_CLASS, "count": len(indices), "selectors": selector},
                    }
                ]
            },
        )

    def pin(self, name: str, indices: Sequence[int]) -> str:
        """A pod on this node holding GPUs `indices` (its claim's CEL selector picks them by index), placed by
        the scheduler without the extender: under gputopo's, a claim it cannot read is refused
        (docs/install.md, "Your own claims")."""
        return self.pod(name, self.pin_template(indices), scheduler=_plain_scheduler(self.stack))

    def pod(
        self,
        name: str,
        template: str,
        *,
        anywhere: bool = False,
        annotations: dict[str, str] | None = None,
        scheduler: str | None = None,
    ) -> str:
        """A pod on this node (with `anywhere`: on any node of this test) whose one claim comes from
        `template`, under gputopo's scheduler (or `scheduler`)."""
        full = f"{self.name}-{name}"
        m = pod_manifest(
            full,
            labels={TEST_LABEL: self.test_id},
            annotations=annotations,
            scheduling=PodScheduling(
                scheduler_name=scheduler or self.stack.scheduler_name,
                node_selector={TEST_LABEL: self.test_id} if anywhere else {"kubernetes.io/hostname": self.name},
            ),
        )
        m["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
        m["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
        self.kube.create_pod(m)
        self.pods.append(full)
        return full

    def claim_of(self, pod: str) -> dict[str, Any]:
        """The claim made for the pod: from its template, else for its extended resource (KEP-5004)."""
        status = self.kube.get_pod(NS, pod).get("status", {})
        statuses = status.get("resourceClaimStatuses") or [status.get("extendedResourceClaimStatus") or {}]
        claim = statuses[0].get("resourceClaimName")
        assert claim, f"{pod} has no generated claim yet"
        return dict(json.loads(self.kube.kubectl("get", "resourceclaim", "-n", NS, claim, "-o", "json")))

    def gpus_of(self, pod: str) -> tuple[int, ...]:
        results = self.claim_of(pod)["status"]["allocation"]["devices"]["results"]
        assert all(r["driver"] == DRIVER and r["pool"] == self.name for r in results), results
        out = [device_gpus(r["device"]) for r in results]  # a clique block stands for its GPUs
        assert None not in out, results
        return tuple(sorted(i for gpus in out if gpus is not None for i in gpus))

    def running(self, pod: str, *, timeout: float = 90.0) -> tuple[int, ...]:
        """Until the kubelet runs `pod` (its claim prepared by the agent); the GPUs it holds."""
        self.kube.wait_pod_condition(NS, pod, "Ready", status="True", timeout=timeout)
        return self.gpus_of(pod)

    def unschedulable(self, pod: str) -> str:
        cond = self.kube.wait_pod_condition(NS, pod, "PodScheduled", status="False", reason="Unschedulable")
        return cond.message

    def delete(self, pod: str, *, timeout: float = 90.0) -> None:
        """Delete `pod` and wait until it and its generated claim are gone: the GPUs are free again."""
        claim = self.claim_of(pod)["metadata"]["name"]
        self.kube.delete_pod(NS, pod)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = {p["metadata"]["name"] for p in self.kube.list_pods(NS)}
            claims = self.kube.kubectl("get", "resourceclaims", "-n", NS, "-o", "name")
            if pod not in pods and f"resourceclaim.resource.k8s.io/{claim}" not in claims.split():
                self.pods.remove(pod)
                return
            time.sleep(0.5)
        raise AssertionError(f"{pod} or its claim {claim} still there after {timeout:.0f}s")

    def checkpoint(self) -> dict[str, Any]:
        path = self.kubelet.dra_plugins_dir / DRIVER / "checkpoint.json"
        return dict(json.loads(path.read_text())["claims"]) if path.exists() else {}

    def close(self) -> None:
        for pod in list(self.pods):
            self.kube.delete_pod(NS, pod)
        self.stack.remove_kubelet_node(self.name)


@pytest.fixture
def dra_node(stack: Stack, test_id: str) -> Iterator[DraNode]:
    node = DraNode(stack, test_id)
    try:
        yield node
    finally:
        node.close()


def test_dra_slice_lists_every_gpu_with_its_clique_partitions(stack: Stack, dra_node: DraNode) -> None:
    slices = stack.resource_slices(dra_node.name)
    assert len(slices) == 1
    spec = slices[0]["spec"]
    assert spec["pool"]["name"] == dra_node.name and spec["nodeName"] == dra_node.name
    devices = {d["name"]: d for d in spec["devices"]}
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    attrs = devices["gpu-0"]["attributes"]
    assert attrs["nvlinkPartition0"] == {"string": "0-3"}
    assert attrs["nvlinkPartition1"] == {"string": "0,4"}
    assert attrs["index"] == {"int": 0}
    assert "memory" in devices["gpu-0"]["capacity"]
    # Steady state: the slice is not rewritten while nothing changes.
    version = slices[0]["metadata"]["resourceVersion"]
    time.sleep(3 * stack.interval_seconds)
    assert stack.resource_slices(dra_node.name)[0]["metadata"]["resourceVersion"] == version


def test_dra_slice_follows_a_gpu_failing_and_recovering(stack: Stack, dra_node: DraNode) -> None:
    """A GPU that fails leaves the slice (no device taints here) and its cliques; the quad it was in is
    no longer a TP-4 choice. When it recovers, the agent republishes the whole node."""
    n = dra_node
    healthy = build_system(SYSTEM, n.name)
    gpus = list(healthy.gpus)
    gpus[3] = gpus[3].model_copy(update={"health": Health.FAILED})
    stack.set_topology(n.name, healthy.model_copy(update={"gpus": tuple(gpus)}))
    devices = {d["name"]: d for d in stack.wait_resource_slice(n.name, 7)["spec"]["devices"]}
    assert "gpu-3" not in devices
    assert devices["gpu-0"]["attributes"]["nvlinkPartition0"] == {"string": "0-2"}
    tp4 = n.pod("tp4", n.tp_template(4))
    assert n.running(tp4) == (4, 5, 6, 7)
    stack.set_topology(n.name, healthy)
    devices = {d["name"]: d for d in stack.wait_resource_slice(n.name, 8)["spec"]["devices"]}
    assert devices["gpu-0"]["attributes"]["nvlinkPartition0"] == {"string": "0-3"}


def test_dra_nvml_driver_on_the_real_binding_drops_a_lost_gpu_and_takes_it_back(stack: Stack, test_id: str) -> None:
    """The agent as DRA driver reading the NVML mock library through nvidia-ml-py (`--backend nvml`, no
    fixture): GPU 3 lost under the running agent leaves the slice and its quad is no TP-4 choice; when
    it answers again the whole node is republished."""
    n = DraNode(stack, test_id, suffix="-nvml", nvml=True)
    try:
        lost = profile_for_system(SYSTEM, n.name)
        lost.gpus[3].fails["*"] = 15  # NVML_ERROR_GPU_IS_LOST, from the handle on: fallen off the bus
        stack.set_nvml_profile(n.name, lost)
        devices = {d["name"]: d for d in stack.wait_resource_slice(n.name, 7)["spec"]["devices"]}
        assert "gpu-3" not in devices
        assert devices["gpu-0"]["attributes"]["nvlinkPartition0"] == {"string": "0-2"}
        tp4 = n.pod("tp4", n.tp_template(4))
        assert n.running(tp4) == (4, 5, 6, 7)
        stack.set_nvml_profile(n.name, profile_for_system(SYSTEM, n.name))
        devices = {d["name"]: d for d in stack.wait_resource_slice(n.name, 8)["spec"]["devices"]}
        assert devices["gpu-0"]["attributes"]["nvlinkPartition0"] == {"string": "0-3"}
    finally:
        n.close()


def test_dra_tp4_waits_for_a_full_quad_and_tp2_gets_only_nvlink_pairs(dra_node: DraNode) -> None:
    n = dra_node
    pin0 = n.pin("pin0", [0])
    pin5 = n.pin("pin5", [5])
    assert (n.running(pin0), n.running(pin5)) == ((0,), (5,))

    # GPUs 0 and 5 taken: neither quad is whole, so a TP-4 claim cannot be allocated on this node...
    tp4 = n.pod("tp4", n.tp_template(4))
    assert "claim" in n.unschedulable(tp4).lower()
    # ...until GPU 5 is free again: then it gets the quad 4-7, never a set spanning both quads.
    n.delete(pin5)
    assert n.running(tp4) == (4, 5, 6, 7)
    n.delete(tp4)
    pin5 = n.pin("pin5b", [5])
    assert n.running(pin5) == (5,)

    # TP-2 pods, one after another: each gets an NVLink pair. First fit without the constraint would
    # give the second one GPUs 3 and 4, which share no link (the next test).
    first = n.pod("tp2a", n.tp_template(2))
    assert n.running(first) == (1, 2)
    second = n.pod("tp2b", n.tp_template(2))
    assert n.running(second) == (4, 6)
    # Only 3 and 7 are left: not in one quad, but linked across the quads (the second partition).
    third = n.pod("tp2c", n.tp_template(2))
    assert n.running(third) == (3, 7)
    held = [n.gpus_of(p) for p in (pin0, pin5, first, second, third)]
    assert all(_is_clique(g) for g in held)
    assert mask_of([g for gs in held for g in gs]) == 0xFF


def test_dra_without_the_constraint_first_fit_breaks_the_clique(dra_node: DraNode) -> None:
    """The control for the test above: what KEP-5004's plain count gets on the same node."""
    n = dra_node
    pins = n.pin("pins", [0, 5])
    assert n.running(pins) == (0, 5)
    first = n.pod("any2a", n.tp_template(2, NvlinkPolicy.IGNORE))
    assert n.running(first) == (1, 2)
    second = n.pod("any2b", n.tp_template(2, NvlinkPolicy.IGNORE))
    got = n.running(second)
    assert got == (3, 4) and not _is_clique(got)


@pytest.mark.parametrize("encoding", ["partitions", "list"])
def test_dra_tp2_takes_the_cross_quad_pair_when_only_it_is_free(
    stack: Stack, control_plane: ControlPlane, test_id: str, encoding: str
) -> None:
    if encoding == "list" and not control_plane.feature_gates.get("DRAListTypeAttributes"):
        pytest.skip("list-typed attributes need the DRAListTypeAttributes gate (alpha from Kubernetes 1.36)")
    n = DraNode(stack, test_id, list_attributes=encoding == "list")
    try:
        if encoding == "list":
            attrs = stack.resource_slices(n.name)[0]["spec"]["devices"][0]["attributes"]
            assert attrs["nvlinkCliques"] == {"strings": ["0-3", "0,4"]}
        pins = n.pin("pins", [1, 2, 3, 5, 6, 7])
        assert n.running(pins) == (1, 2, 3, 5, 6, 7)
        pair = n.pod("tp2", n.tp_template(2))
        assert n.running(pair) == (0, 4)
    finally:
        n.close()


def test_dra_best_fit_order_fills_the_half_used_quad_and_the_placement_names_the_claims_gpus(
    stack: Stack, test_id: str
) -> None:
    """The issue's run through the real allocator: pairs take GPUs 4-5 (pinned), and with the agent in
    best-fit order a 2-GPU clique claim beside the half-used quad 4-7 and the whole quad 0-3 takes 6-7,
    where index order takes 0-1 (test_dra_tp4_waits_for_a_full_quad_and_tp2_gets_only_nvlink_pairs); a
    4-GPU claim then still gets the whole quad. Each pod's placement names exactly its claim's GPUs.
    The order is documented from 1.36 (the chart passes the flag from there); with one slice per node
    1.34's allocator goes in slice order too, so the test runs on both releases."""
    n = DraNode(stack, test_id, best_fit=True)
    try:
        pins = n.pin("pins", [4, 5])
        assert n.running(pins) == (4, 5)
        # The agent re-publishes once the pin's claim is prepared: the half-used quad's free pair first.
        deadline = time.monotonic() + 30
        while [d["name"] for d in stack.resource_slices(n.name)[0]["spec"]["devices"]][:2] != ["gpu-6", "gpu-7"]:
            assert time.monotonic() < deadline, "the slice was not re-published in best-fit order"
            time.sleep(0.3)
        ann = {"gputopo.io/nvlink": "required"}
        pair = n.pod("tp2", n.tp_template(2), annotations=ann)
        assert n.running(pair) == (6, 7)
        quad = n.pod("tp4", n.tp_template(4), annotations=ann)
        assert n.running(quad) == (0, 1, 2, 3)
        for pod in (pair, quad):
            annotations = stack.kube.get_pod(NS, pod)["metadata"]["annotations"]
            assert tuple(parse_placement(annotations[PLACEMENT_ANNOTATION]).gpus) == n.gpus_of(pod)
    finally:
        n.close()


def test_dra_kubelet_and_agent_restarts_lose_no_prepared_claim(stack: Stack, dra_node: DraNode) -> None:
    n = dra_node
    quad = n.pod("tp4", n.tp_template(4))
    assert n.running(quad) == (0, 1, 2, 3)
    uid = n.claim_of(quad)["metadata"]["uid"]
    assert uid in n.checkpoint()

    n.kubelet.restart()
    stack.wait_resource_slice(n.name, 8)  # the kubelet deletes its node's slices at start; the agent restores it
    stack.cp.remove(stack.agent_component(n.name), grace=3)
    stack.start_agent(n.name)
    stack.wait_resource_slice(n.name, 8)
    assert uid in n.checkpoint()
    n.kube.wait_pod_condition(NS, quad, "Ready", status="True", timeout=60)

    # The restarted pair still unprepares the claim when the pod goes, and the GPUs serve the next one.
    n.delete(quad)
    # A kubelet just restarted may drop the pod as an orphan before its DRA manager has the driver back;
    # its reconcile loop (once a minute) then unprepares the claim: wait for that, bounded.
    deadline = time.monotonic() + 150
    while uid in n.checkpoint() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert uid not in n.checkpoint()
    again = n.pod("tp4b", n.tp_template(4))
    assert n.running(again) == (0, 1, 2, 3)


def test_dra_extender_puts_a_tp2_claim_on_the_fragmented_node(stack: Stack, test_id: str) -> None:
    """Two DRA nodes of one test: A has GPUs 0 and 5 taken, B none. Both can allocate an NVLink pair, and
    kube-scheduler alone would spread to the empty B; the extender, reading A's claims, scores A first,
    since a pair on B breaks a whole quad. The placement's sentence names the GPUs the claim got."""
    a = DraNode(stack, test_id, suffix="a")
    b = DraNode(stack, test_id, suffix="b")
    try:
        pins = a.pin("pins", [0, 5])
        assert a.running(pins) == (0, 5)
        pair = a.pod("tp2", a.tp_template(2), anywhere=True, annotations={"gputopo.io/nvlink": "required"})
        got = a.running(pair)
        assert stack.kube.get_pod(NS, pair)["spec"]["nodeName"] == a.name
        assert _is_clique(got)
        # The placement names the GPUs the claim got (kube-scheduler allocated them before the bind).
        placed = parse_placement(stack.kube.get_pod(NS, pair)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert tuple(placed.gpus) == got
        event = stack.kube.wait_pod_event(NS, pair, "TopologyPlacement", timeout=60)
        assert f"GPUs {gpu_ranges(got)} on {a.name}" in event.message
    finally:
        a.close()
        b.close()


def test_dra_webhook_turns_an_opted_in_gpu_pod_into_a_clique_claim(
    stack: Stack, control_plane: ControlPlane, kube: KubeClient, namespace: str, test_id: str
) -> None:
    """The webhook in DRA mode (the chart's agent.dra.enabled), answering only kube-apiserver's client
    certificate (the control plane's admission configuration presents it): a pod written for the device
    plugin, `nvidia.com/gpu: 2` and `gputopo.io/nvlink: required`, is given gputopo's claim template
    instead, which the extender creates in its namespace once the pod exists, and the real allocator
    gives it an NVLink pair of at least the HBM the pod asks for. A forged review from anyone else (no
    client certificate) is refused with 401 and creates nothing."""
    node = DraNode(stack, test_id)
    hook = Stack(
        control_plane,
        kube,
        scheduler=SchedulerPods(extender_name="gputopo-extender-dra-webhook", webhook=True),
        chart=ChartRelease(dra=True),
    )
    hook.start_extender()
    assert hook.ca_file is not None
    name = f"gputopo-e2e-{test_id}"[:63]
    ca = hook.ca_file.read_bytes()
    hook.route_pods_to_webhook(name, namespace, side_effects="NoneOnDryRun", timeout_seconds=10)
    try:
        pins = node.pin("pins", [0, 5])
        assert node.running(pins) == (0, 5)
        pod = pod_manifest(
            "tp2",
            namespace=namespace,
            gpus=2,
            annotations={"gputopo.io/nvlink": "required", "gputopo.io/min-gpu-memory": "16Gi"},
            scheduling=PodScheduling(node_selector={TEST_LABEL: test_id}),
        )  # schedulerName: default-scheduler, as a user would leave it
        created = kube.create_pod(pod)
        spec = created["spec"]
        assert spec["schedulerName"] == stack.scheduler_name
        assert "nvidia.com/gpu" not in spec["containers"][0]["resources"].get("limits", {})
        template = spec["resourceClaims"][0]["resourceClaimTemplateName"]
        # 16Gi rounds up to the smallest memory class, the RTX 4090's 24564 MiB (the V100s have 32510)
        assert template.startswith("gputopo-gpus-2-nvlink-24564mi-")
        kube.wait_pod_condition(namespace, "tp2", "Ready", status="True", timeout=90)
        forged = _forged_review(namespace="kube-system", gpus=8)
        status, answer = _post_without_client_certificate(hook.webhook_url + "/mutate", ca, forged)
        assert status == 401 and "client certificate" in answer["Error"]
        made = kube.request("GET", "/apis/resource.k8s.io/v1/namespaces/kube-system/resourceclaimtemplates")
        assert not [t for t in made["items"] if t["metadata"]["name"].startswith("gputopo-gpus-8-")]
        statuses = kube.get_pod(namespace, "tp2")["status"]["resourceClaimStatuses"]
        claim_name = statuses[0]["resourceClaimName"]
        claim = json.loads(kube.kubectl("get", "resourceclaim", "-n", namespace, claim_name, "-o", "json"))
        gpus = sorted(device_index(r["device"]) or 0 for r in claim["status"]["allocation"]["devices"]["results"])
        assert len(gpus) == 2 and _is_clique(gpus) and not {0, 5} & set(gpus)
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}")
        control_plane.remove(hook.extender_name, grace=3)  # not hook.stop(): the scheduler is the module's
        kube.delete_pod(namespace, "tp2")
        node.close()


def _forged_review(*, namespace: str, gpus: int) -> dict[str, Any]:
    pod = pod_manifest("forged", namespace=namespace, gpus=gpus, annotations={"gputopo.io/nvlink": "required"})
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "forged-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "object": pod,
        },
    }


def _post_without_client_certificate(url: str, ca: bytes, review: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What anyone who reaches the webhook's port can send: a review over TLS, no client certificate."""
    context = ssl.create_default_context(cadata=ca.decode())
    request = urllib.request.Request(
        url, data=json.dumps(review).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
