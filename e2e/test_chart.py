"""The Helm chart against a real kube-apiserver: dry runs, install, upgrade and RBAC with real tokens.

No kubelet and no default scheduler run, so the chart's Pods (kube-controller-manager makes them)
never start; these tests check what the API server accepts and what each component's identity may do:

- every object the chart renders (each ``ci/*-values.yaml`` scenario) passes a server-side dry
  run (cert-manager's kinds excepted: no cert-manager CRDs here);
- ``helm install`` succeeds, and ``helm upgrade`` keeps the generated CA and certificate;
- the agent, with a token bound to node A (as the kubelet's projected token is), may change
  ``gputopo.io/`` annotations and labels of node A and its own Lease, and nothing else;
- the scheduler pod's service account (kube-scheduler and its extender sidecar) cannot touch Nodes and
  has what kube-scheduler and the extender need.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gputopo.localcluster import ControlPlane, KubeApiError, KubeClient, SimNode
from gputopo.localcluster.chart import run_helm
from gputopo.model import agent_lease_name

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gputopo"
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
DENIED = (403, 422)
# The admission policy's messages (charts/gputopo/templates/agent-validatingadmissionpolicy.yaml).
ANN = "only gputopo.io/ annotations"
LBL = "only gputopo.io/ labels"
SPEC = "may not change a Node's spec, finalizers or owner references"
OTHER = "may change only its own Node"
OPERATOR = "may not change the operator's labels"


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str

    @property
    def fullname(self) -> str:
        return f"{self.name}-gputopo"

    def sa(self, component: str) -> str:
        return f"{self.fullname}-{component}"

    def user(self, component: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.sa(component)}"


def _helm(cp: ControlPlane, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = run_helm(cp, *args, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    return proc


def _kubectl_rc(kube: KubeClient, *args: str) -> tuple[int, str]:
    assert kube.kubectl_path is not None
    proc = subprocess.run(
        [str(kube.kubectl_path), f"--kubeconfig={kube.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _eventually(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def release(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Release]:
    """The chart installed once for this module, with default values, in a fresh namespace. Uninstalled
    afterwards: its cluster-wide placement policy exempts only this release's scheduler, so left in
    place it would refuse every other scheduler's bindings in the session."""
    rel = Release(name=f"gtc{secrets.token_hex(3)}", namespace=f"gputopo-e2e-{secrets.token_hex(3)}")
    kube.create_namespace(rel.namespace)
    _helm(control_plane, "install", rel.name, str(CHART), "--namespace", rel.namespace)
    yield rel
    # --no-hooks: the post-delete cleanup Job needs a node that runs containers, which this
    # module's nodes are not (e2e/test_installed.py runs it).
    _helm(control_plane, "uninstall", rel.name, "--namespace", rel.namespace, "--wait", "--no-hooks")


@contextmanager
def _client_for(
    cp: ControlPlane, kube: KubeClient, rel: Release, component: str, bound_node: str | None
) -> Iterator[KubeClient]:
    token = kube.create_token(rel.namespace, rel.sa(component), bound_node=bound_node, expiration_seconds=3600)
    path = cp.dir / f"{rel.name}-{component}-{bound_node or 'unbound'}-{secrets.token_hex(2)}.kubeconfig"
    client = KubeClient(cp.write_kubeconfig(path, token=token, user=component), kubectl=cp.kubectl)
    try:
        yield client
    finally:
        client.close()


def _patch_node(client: KubeClient, node: str, patch: Mapping[str, Any], *, dry_run: bool = False) -> None:
    client.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        dict(patch),
        query={"dryRun": "All"} if dry_run else None,
        content_type="application/merge-patch+json",
    )


@pytest.fixture(scope="module")
def policy_active(control_plane: ControlPlane, kube: KubeClient, release: Release) -> None:
    """Wait until RBAC and the admission policy both apply to the agent (informer caches)."""
    probe = f"{release.name}-probe"
    kube.create_node(SimNode(probe, gpus=0))
    try:
        with _client_for(control_plane, kube, release, "agent", probe) as agent:
            _eventually(lambda: agent.can_i("patch", "nodes", name=probe), "the agent's RBAC")

            def denied() -> bool:
                try:
                    _patch_node(agent, probe, {"metadata": {"labels": {"example.com/probe": "x"}}}, dry_run=True)
                except KubeApiError as e:
                    return e.status in DENIED and "ValidatingAdmissionPolicy" in e.message
                return False

            _eventually(denied, "the agent ValidatingAdmissionPolicy to take effect")
    finally:
        kube.delete_node(probe)


# --- every object is accepted ------------------------------------------------------------


@pytest.mark.parametrize("values_file", CI_FILES, ids=lambda p: p.name)
def test_every_rendered_object_passes_a_server_side_dry_run(
    control_plane: ControlPlane, kube: KubeClient, values_file: Path, namespace: str
) -> None:
    rendered = _helm(
        control_plane,
        "template",
        "dry",
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        "1.34.4",
        "-f",
        str(values_file),
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # cert-manager's CRDs are not installed in the test control plane; everything else must pass.
    checked = [d for d in docs if not d["apiVersion"].startswith("cert-manager.io/")]
    assert len(checked) >= 20
    doc = {"apiVersion": "v1", "kind": "List", "items": checked}
    out = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(doc))
    accepted = [line for line in out.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(checked), out


def _api_server_slice(address: str) -> dict[str, Any]:
    """An EndpointSlice of the default/kubernetes Service as a real API server publishes it (the local
    one runs with --endpoint-reconciler-type=none, so it publishes none and this one stays)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "kubernetes"},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address]}],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
    }


def _webhook_sources(manifest: str) -> list[dict[str, Any]]:
    """The peers the scheduler's NetworkPolicy admits to the webhook port, from `helm install --dry-run`."""
    for doc in yaml.safe_load_all(manifest):
        if doc and doc.get("kind") == "NetworkPolicy" and doc["metadata"]["name"].endswith("-scheduler"):
            for rule in doc["spec"]["ingress"]:
                if any(p.get("port") == 8443 for p in rule.get("ports", [])):
                    return [peer for peer in rule["from"] if "ipBlock" in peer]
    raise AssertionError("no NetworkPolicy rule for the webhook port")


@pytest.mark.parametrize(
    ("published", "expected"),
    [
        # A documentation address (RFC 5737): only data in an object, nothing is sent to it.
        pytest.param("198.51.100.7", [{"ipBlock": {"cidr": "198.51.100.7/32"}}], id="the-api-servers-address"),
        pytest.param(None, None, id="nothing-published-fails-naming-the-value"),
    ],
)
def test_the_webhook_network_policy_is_derived_from_the_api_servers_endpoints_or_the_render_fails(
    control_plane: ControlPlane, kube: KubeClient, namespace: str, published: str | None, expected: Any
) -> None:
    """With the webhook on and no apiServerCIDRs, `helm install` (a server dry run: lookups reach the
    real API server) admits the webhook port only from the addresses of default/kubernetes, and with none
    to find refuses to render rather than open the port to anyone."""
    path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes"
    if published is not None:
        kube.request(
            "POST", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", _api_server_slice(published)
        )
    try:
        proc = _helm(
            control_plane,
            "install",
            "lookup",
            str(CHART),
            "--namespace",
            namespace,
            "--dry-run=server",
            "--set",
            "webhook.enabled=true",
            check=expected is not None,
        )
        if expected is None:
            assert proc.returncode != 0
            assert "networkPolicy.webhook.apiServerCIDRs" in proc.stderr, proc.stderr
            assert "networkPolicy.webhook.allowFromAnywhere" in proc.stderr, proc.stderr
        else:
            assert _webhook_sources(proc.stdout) == expected
    finally:
        if published is not None:
            kube.request("DELETE", path)


# --- install and upgrade -----------------------------------------------------------------


def test_helm_install_creates_every_component(control_plane: ControlPlane, kube: KubeClient, release: Release) -> None:
    status = json.loads(_helm(control_plane, "status", release.name, "-n", release.namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    ns = release.namespace
    assert kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/daemonsets/{release.sa('agent')}")
    scheduler = kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{release.sa('scheduler')}")
    # The extender is the scheduler pod's sidecar: no Deployment or Service of its own.
    assert {c["name"] for c in scheduler["spec"]["template"]["spec"]["containers"]} >= {"kube-scheduler", "extender"}
    with pytest.raises(KubeApiError) as err:
        kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{release.sa('extender')}")
    assert err.value.status == 404
    for policy in ("agent", "placement"):
        vap = f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{release.sa(policy)}"
        assert kube.request("GET", vap)


def test_helm_upgrade_keeps_the_generated_webhook_certificate_and_the_webhook_trusts_it(
    control_plane: ControlPlane, kube: KubeClient, release: Release
) -> None:
    path = f"/api/v1/namespaces/{release.namespace}/secrets/{release.sa('webhook')}-tls"
    webhook = [
        "--set",
        "webhook.enabled=true",
        # match no namespace, so that other tests' pods never reach this endpoint-less webhook
        "--set",
        f"webhook.namespaceSelector.matchLabels.gputopo-e2e-webhook={release.name}",
        # the local API server publishes no endpoints for default/kubernetes (it listens on loopback),
        # so the chart cannot look its address up and would refuse to open the port to anyone
        "--set",
        "networkPolicy.webhook.apiServerCIDRs={127.0.0.1/32}",
    ]
    _helm(control_plane, "upgrade", release.name, str(CHART), "--namespace", release.namespace, *webhook)
    before = kube.request("GET", path)["data"]
    assert set(before) == {"ca.crt", "tls.crt", "tls.key"}
    _helm(control_plane, "upgrade", release.name, str(CHART), "--namespace", release.namespace, *webhook)
    after = kube.request("GET", path)["data"]
    assert after == before
    hook = kube.request(
        "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{release.sa('webhook')}"
    )
    assert hook["webhooks"][0]["clientConfig"]["caBundle"] == before["ca.crt"]
    _helm(control_plane, "upgrade", release.name, str(CHART), "--namespace", release.namespace)


# --- the agent: its own Node, gputopo.io/ keys only ---------------------------------------


@pytest.mark.parametrize(
    ("target", "patch", "denial"),
    [
        pytest.param(
            "own", {"metadata": {"annotations": {"gputopo.io/topology": "{}"}}}, None, id="own gputopo annotation"
        ),
        pytest.param(
            "own", {"metadata": {"annotations": {"gputopo.io/gpus-in-use": None}}}, None, id="own drop gputopo ann"
        ),
        pytest.param("own", {"metadata": {"labels": {"gputopo.io/nvswitch": "true"}}}, None, id="own gputopo label"),
        # What the agent sends when a node stops reporting a label it owns (gputopo.io/nvlink-fabric).
        pytest.param(
            "own", {"metadata": {"labels": {"gputopo.io/simulated": None}}}, None, id="own drop gputopo label"
        ),
        pytest.param(
            "own", {"metadata": {"annotations": {"example.com/x": "1"}}}, ANN, id="own add foreign annotation"
        ),
        pytest.param(
            "own", {"metadata": {"annotations": {"example.com/keep": None}}}, ANN, id="own drop foreign annotation"
        ),
        pytest.param(
            "own", {"metadata": {"annotations": {"example.com/keep": "2"}}}, ANN, id="own edit foreign annotation"
        ),
        pytest.param("own", {"metadata": {"labels": {"example.com/x": "1"}}}, LBL, id="own add foreign label"),
        pytest.param("own", {"metadata": {"labels": {"kubernetes.io/os": None}}}, LBL, id="own drop foreign label"),
        pytest.param(
            "own", {"metadata": {"labels": {"kubernetes.io/os": "windows"}}}, LBL, id="own edit foreign label"
        ),
        # The operator's gputopo.io/ labels: a domain's cap is read where all its trays agree, never from an agent.
        pytest.param(
            "own", {"metadata": {"labels": {"gputopo.io/nvlink-domain-cap": "1"}}}, OPERATOR, id="own add domain cap"
        ),
        pytest.param(
            "own", {"metadata": {"labels": {"gputopo.io/network-leaf": "x"}}}, OPERATOR, id="own add network leaf"
        ),
        pytest.param("own", {"spec": {"unschedulable": True}}, SPEC, id="own cordon"),
        pytest.param(
            "own", {"spec": {"taints": [{"key": "x", "value": "y", "effect": "NoSchedule"}]}}, SPEC, id="own taint"
        ),
        pytest.param("own", {"metadata": {"finalizers": ["example.com/f"]}}, SPEC, id="own finalizer"),
        pytest.param(
            "other", {"metadata": {"annotations": {"gputopo.io/topology": "{}"}}}, OTHER, id="other annotation"
        ),
        pytest.param("other", {"metadata": {"labels": {"gputopo.io/rdma": "none"}}}, OTHER, id="other label"),
    ],
)
@pytest.mark.usefixtures("policy_active")
def test_agent_changes_only_gputopo_keys_of_its_own_node(
    control_plane: ControlPlane,
    kube: KubeClient,
    release: Release,
    make_nodes: Any,
    test_id: str,
    target: str,
    patch: dict[str, Any],
    denial: str | None,
) -> None:
    annotations = {"example.com/keep": "1", "gputopo.io/gpus-in-use": "[]"}
    node_a, node_b = make_nodes(
        [SimNode(f"{test_id}-a", annotations=annotations), SimNode(f"{test_id}-b", annotations=annotations)]
    )
    victim = node_a if target == "own" else node_b
    before = kube.get_node(victim)
    with _client_for(control_plane, kube, release, "agent", node_a) as agent:
        if denial is None:
            _patch_node(agent, victim, patch)
            return
        with pytest.raises(KubeApiError) as err:
            _patch_node(agent, victim, patch)
    assert err.value.status in DENIED, err.value
    assert "ValidatingAdmissionPolicy" in err.value.message
    assert denial in err.value.message, err.value.message
    after = kube.get_node(victim)
    assert after["metadata"].get("labels") == before["metadata"].get("labels")
    assert after["metadata"].get("annotations") == before["metadata"].get("annotations")
    assert after["spec"] == before["spec"]


def test_agent_cannot_write_node_status_delete_nodes_or_list_them(
    control_plane: ControlPlane, kube: KubeClient, release: Release, make_nodes: Any, test_id: str
) -> None:
    (node,) = make_nodes([SimNode(f"{test_id}-a")])
    with _client_for(control_plane, kube, release, "agent", node) as agent:
        with pytest.raises(KubeApiError) as err:
            agent.patch_node(node, {"status": {"capacity": {"nvidia.com/gpu": "16"}}}, status=True)
        assert err.value.status == 403
        with pytest.raises(KubeApiError) as err:
            agent.delete_node(node)
        assert err.value.status == 403
        with pytest.raises(KubeApiError) as err:
            agent.list_nodes()
        assert err.value.status == 403


@pytest.mark.usefixtures("policy_active")
def test_agent_token_not_bound_to_a_node_is_refused(
    control_plane: ControlPlane, kube: KubeClient, release: Release, make_nodes: Any, test_id: str
) -> None:
    (node,) = make_nodes([SimNode(f"{test_id}-a")])
    with _client_for(control_plane, kube, release, "agent", None) as agent, pytest.raises(KubeApiError) as err:
        _patch_node(agent, node, {"metadata": {"annotations": {"gputopo.io/topology": "{}"}}})
    assert err.value.status in DENIED
    assert "node-bound" in err.value.message


def _lease(name: str, holder: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 120},
    }


@pytest.mark.usefixtures("policy_active")
def test_agent_writes_only_its_own_lease(
    control_plane: ControlPlane, kube: KubeClient, release: Release, make_nodes: Any, test_id: str
) -> None:
    node_a, node_b = make_nodes([SimNode(f"{test_id}-a"), SimNode(f"{test_id}-b")])
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{release.namespace}/leases"
    with _client_for(control_plane, kube, release, "agent", node_a) as agent:
        own = agent.request("POST", leases, _lease(agent_lease_name(node_a), node_a))
        own["spec"]["renewTime"] = "2026-01-01T00:00:00.000000Z"
        agent.request("PUT", f"{leases}/{agent_lease_name(node_a)}", own)
        agent.request(
            "PATCH",
            f"{leases}/{agent_lease_name(node_a)}",
            {"spec": {"renewTime": "2026-01-01T00:00:30.000000Z"}},
            content_type="application/merge-patch+json",
        )
        with pytest.raises(KubeApiError) as err:
            agent.request("POST", leases, _lease(agent_lease_name(node_b), node_a))
        assert err.value.status in DENIED
        assert "may write only its own Lease" in err.value.message
        # A stopping agent deletes its own Lease, and only that one.
        kube.request("POST", leases, _lease(agent_lease_name(node_b), node_b))
        with pytest.raises(KubeApiError) as err:
            agent.request("DELETE", f"{leases}/{agent_lease_name(node_b)}")
        assert err.value.status in DENIED
        assert "may write only its own Lease" in err.value.message
        agent.request("DELETE", f"{leases}/{agent_lease_name(node_a)}")
        agent.request("POST", leases, _lease(agent_lease_name(node_a), node_a))
        kube.request("POST", leases, _lease("gputopo-scheduler", "someone"))
        scheduler_lease = agent.request("GET", f"{leases}/gputopo-scheduler")
        scheduler_lease["spec"]["holderIdentity"] = node_a
        with pytest.raises(KubeApiError) as err:
            agent.request("PUT", f"{leases}/gputopo-scheduler", scheduler_lease)
        assert err.value.status in DENIED
        with pytest.raises(KubeApiError) as err:
            agent.request("POST", "/apis/coordination.k8s.io/v1/namespaces/default/leases", _lease("x", node_a))
        assert err.value.status == 403


# --- what each identity may do (SubjectAccessReview through kubectl auth can-i --as) ------


CAN_I = [
    # component, verb, resource, subresource, namespace ("" = cluster; "@" = the release namespace), expected
    # The scheduler pod's account is also its extender sidecar's.
    ("scheduler", "get", "nodes", "", "", True),
    ("scheduler", "list", "nodes", "", "", True),
    ("scheduler", "watch", "nodes", "", "", True),
    ("scheduler", "patch", "nodes", "", "", False),
    ("scheduler", "update", "nodes", "", "", False),
    ("scheduler", "delete", "nodes", "", "", False),
    ("scheduler", "patch", "nodes", "status", "", False),
    ("scheduler", "create", "pods", "binding", "team-a", True),
    ("scheduler", "update", "pods", "", "team-a", False),
    ("scheduler", "create", "events", "", "team-a", True),
    ("scheduler", "create", "events.events.k8s.io", "", "team-a", True),
    ("scheduler", "watch", "leases.coordination.k8s.io", "", "@", True),
    ("scheduler", "update", "leases.coordination.k8s.io/gputopo-scheduler", "", "@", True),
    ("scheduler", "update", "leases.coordination.k8s.io/another-lease", "", "@", False),
    ("scheduler", "get", "configmaps/extension-apiserver-authentication", "", "kube-system", True),
    ("scheduler", "get", "secrets", "", "@", False),
    ("agent", "get", "nodes", "", "", True),
    ("agent", "patch", "nodes", "", "", True),
    ("agent", "list", "nodes", "", "", False),
    ("agent", "delete", "nodes", "", "", False),
    ("agent", "patch", "nodes", "status", "", False),
    ("agent", "create", "leases.coordination.k8s.io", "", "@", True),
    ("agent", "update", "leases.coordination.k8s.io", "", "@", True),
    ("agent", "patch", "leases.coordination.k8s.io", "", "@", True),
    # Its own heartbeat Lease on shutdown; the agent admission policy refuses any other (test below).
    ("agent", "delete", "leases.coordination.k8s.io", "", "@", True),
    ("agent", "create", "leases.coordination.k8s.io", "", "kube-node-lease", False),
    # Reads pods (always with the field selector spec.nodeName=<its node>; RBAC cannot narrow reads), never writes.
    ("agent", "list", "pods", "", "", True),
    ("agent", "patch", "pods", "", "team-a", False),
    ("agent", "delete", "pods", "", "team-a", False),
    ("agent", "get", "secrets", "", "@", False),
]


@pytest.mark.parametrize(
    ("component", "verb", "resource", "subresource", "ns", "expected"),
    CAN_I,
    ids=[f"{c[0]} {'can' if c[5] else 'cannot'} {c[1]} {c[2]}{'/' + c[3] if c[3] else ''}" for c in CAN_I],
)
def test_component_permissions(
    kube: KubeClient,
    release: Release,
    component: str,
    verb: str,
    resource: str,
    subresource: str,
    ns: str,
    expected: bool,
) -> None:
    args = ["auth", "can-i", verb, resource, f"--as={release.user(component)}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    if ns:
        args.append(f"--namespace={release.namespace if ns == '@' else ns}")
    rc, out = _kubectl_rc(kube, *args)
    assert rc in (0, 1), out
    assert (rc == 0) is expected, out


def test_the_scheduler_pods_token_cannot_patch_nodes(
    control_plane: ControlPlane, kube: KubeClient, release: Release, make_nodes: Any, test_id: str
) -> None:
    (node,) = make_nodes([SimNode(f"{test_id}-a")])
    with _client_for(control_plane, kube, release, "scheduler", None) as extender:
        _eventually(lambda: extender.can_i("get", "nodes"), "the scheduler pod's RBAC")
        extender.get_node(node)
        with pytest.raises(KubeApiError) as err:
            extender.annotate_node(node, {"gputopo.io/topology": "{}"})
        assert err.value.status == 403
        with pytest.raises(KubeApiError) as err:
            extender.patch_node(node, {"spec": {"unschedulable": True}})
        assert err.value.status == 403
    assert "gputopo.io/topology" not in kube.get_node(node)["metadata"].get("annotations", {})
