"""The local control plane itself: real etcd, kube-apiserver and kube-scheduler (1.34 or 1.37)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gputopo.localcluster import (
    CONTROLLER_MANAGER,
    GPU_RESOURCE,
    NODE_NAME_EXTRA,
    TEST_LABEL,
    ApiFeatures,
    ControlPlane,
    KubeApiError,
    KubeClient,
    PodScheduling,
    SimNode,
    network_labels,
    pod_manifest,
)
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.chart import helm_binary, local_scheduler_config, local_values, render
from gputopo.localcluster.procs import insecure_ctx

MakeNodes = Callable[[Sequence[SimNode]], list[str]]

pytestmark = pytest.mark.e2e


def _alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is still one of our processes (its command line names ``marker``)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return marker.encode() in cmdline


def test_apiserver_ready_and_version(control_plane: ControlPlane, kube: KubeClient) -> None:
    assert kube.kubectl("get", "--raw", "/readyz").strip() == "ok"
    # the release the binaries were built as (GPUTOPO_K8S_VERSION picks 1.34.4 or 1.37.2)
    built = "v{}.{}.{}".format(*kubernetes_version(control_plane.bin_dir))
    assert kube.request("GET", "/version")["gitVersion"] == built
    me = kube.whoami()
    assert "system:masters" in me["groups"]
    assert control_plane.server.startswith("https://127.0.0.1:")


def test_gpu_nodes_show_capacity_and_no_not_ready_taint(kube: KubeClient, make_nodes: MakeNodes, test_id: str) -> None:
    names = make_nodes(
        [
            SimNode(f"{test_id}-{i}", gpus=8, labels=network_labels(leaf=f"leaf-{i % 2}", spine="spine-a"))
            for i in range(3)
        ]
    )
    nodes = kube.list_nodes(label_selector=f"{TEST_LABEL}={test_id}")
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(names)
    for n in nodes:
        assert not n["spec"].get("taints"), n["spec"]["taints"]
        assert n["status"]["allocatable"][GPU_RESOURCE] == "8"
        assert n["status"]["capacity"][GPU_RESOURCE] == "8"
        assert {"cpu", "memory", "pods"} <= set(n["status"]["allocatable"])
        ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        assert n["metadata"]["labels"]["gputopo.io/network-spine"] == "spine-a"
    out = kube.kubectl("get", "nodes", "-l", f"{TEST_LABEL}={test_id}", "--no-headers")
    assert out.count(" Ready ") == 3, out


def test_plain_pod_binds_under_scheduler_without_extender(
    kube: KubeClient, plain_scheduler: str, make_nodes: MakeNodes, namespace: str, test_id: str
) -> None:
    names = make_nodes([SimNode(f"{test_id}-{i}", gpus=4) for i in range(2)])
    pod = pod_manifest(
        "plain-0",
        namespace=namespace,
        gpus=1,
        scheduling=PodScheduling(scheduler_name=plain_scheduler, node_selector={TEST_LABEL: test_id}),
    )
    kube.create_pod(pod)
    node = kube.wait_pod_bound(namespace, "plain-0", timeout=30)
    assert node in names
    cond = kube.wait_pod_condition(namespace, "plain-0", "PodScheduled", status="True", timeout=10)
    assert cond.status == "True"
    ev = kube.wait_pod_event(namespace, "plain-0", "Scheduled", timeout=10)
    assert ev.source == plain_scheduler
    text = kube.describe_pod(namespace, "plain-0")
    assert f"Successfully assigned {namespace}/plain-0 to {node}" in text


def test_token_without_rbac_is_denied_patching_nodes(
    control_plane: ControlPlane, kube: KubeClient, make_nodes: MakeNodes, namespace: str, test_id: str
) -> None:
    (node,) = make_nodes([SimNode(f"{test_id}-0")])
    kube.create_service_account(namespace, "agent")
    token = kube.create_token(namespace, "agent", bound_node=node, expiration_seconds=3600)
    with control_plane.token_client(token, user="agent") as agent:
        me = agent.whoami()
        assert me["username"] == f"system:serviceaccount:{namespace}:agent"
        # ServiceAccountTokenNodeBinding: a Node-bound token names its node.
        assert me.get("extra", {}).get(NODE_NAME_EXTRA) == [node]
        with pytest.raises(KubeApiError) as err:
            agent.annotate_node(node, {"gputopo.io/topology": "{}"})
        assert err.value.status == 403
        assert not agent.can_i("patch", "nodes", name=node)
    assert "gputopo.io/topology" not in kube.get_node(node)["metadata"].get("annotations", {})


class _StubExtender:
    """A minimal extender (not an API server) that records what kube-scheduler sends: keeps the
    given nodes, scores ``preferred`` highest, binds through the real API."""

    def __init__(self, kube: KubeClient, allowed: list[str], preferred: str) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                verb = self.path.strip("/")
                stub.requests.append((verb, body))
                out: Any
                if verb == "filter":
                    names = body.get("NodeNames") or []
                    out = {"NodeNames": [n for n in names if n in allowed], "FailedNodes": {}, "Error": ""}
                elif verb == "prioritize":
                    out = [{"Host": n, "Score": 10 if n == preferred else 0} for n in body.get("NodeNames") or []]
                elif verb == "bind":
                    try:
                        kube.request(
                            "POST",
                            f"/api/v1/namespaces/{body['PodNamespace']}/pods/{body['PodName']}/binding",
                            {
                                "apiVersion": "v1",
                                "kind": "Binding",
                                "metadata": {"name": body["PodName"], "namespace": body["PodNamespace"]},
                                "target": {"apiVersion": "v1", "kind": "Node", "name": body["Node"]},
                            },
                        )
                        out = {"Error": ""}
                    except KubeApiError as e:
                        out = {"Error": str(e)}
                else:
                    out = {"Error": f"unknown verb {verb}"}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub_extender_scheduler(
    control_plane: ControlPlane, kube: KubeClient, make_nodes: MakeNodes, test_id: str
) -> Iterator[tuple[_StubExtender, list[str]]]:
    names = make_nodes([SimNode(f"{test_id}-{i}", gpus=8) for i in range(3)])
    stub = _StubExtender(kube, allowed=names, preferred=names[1])
    # The chart's own scheduler configuration, pointed at the stub instead of the extender sidecar.
    chart = render(helm_binary(control_plane.bin_dir), local_values())
    cfg = local_scheduler_config(chart.scheduler_config(), kubeconfig=control_plane.kubeconfig, extender_url=stub.url)
    control_plane.start_scheduler_config("gputopo-scheduler-stub", cfg)
    try:
        yield stub, names
    finally:
        control_plane.remove("gputopo-scheduler-stub")
        stub.close()


def test_the_charts_gputopo_profile_calls_extender_filter_prioritize_bind(
    kube: KubeClient, stub_extender_scheduler: tuple[_StubExtender, list[str]], namespace: str
) -> None:
    stub, names = stub_extender_scheduler
    kube.create_pod(
        pod_manifest(
            "tp-0",
            namespace=namespace,
            gpus=4,
            annotations={"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(scheduler_name="gputopo-scheduler"),
        )
    )
    assert kube.wait_pod_bound(namespace, "tp-0", timeout=30) == names[1]
    verbs = [v for v, _ in stub.requests]
    assert {"filter", "prioritize", "bind"} <= set(verbs), verbs
    filt = next(b for v, b in stub.requests if v == "filter")
    assert filt["Nodes"] is None and isinstance(filt["NodeNames"], list)  # nodeCacheCapable
    assert filt["Pod"]["metadata"]["annotations"]["gputopo.io/nvlink"] == "required"
    bind = next(b for v, b in stub.requests if v == "bind")
    assert bind["PodName"] == "tp-0" and bind["Node"] == names[1]
    assert f"Successfully assigned {namespace}/tp-0 to {names[1]}" in kube.describe_pod(namespace, "tp-0")
    # A pod without GPUs is sent to the extender too: the chart's managedResources is empty, so that a
    # group's members without GPUs are placed with their group (docs/install.md).
    n = len(stub.requests)
    kube.create_pod(
        pod_manifest("cpu-0", namespace=namespace, scheduling=PodScheduling(scheduler_name="gputopo-scheduler"))
    )
    kube.wait_pod_bound(namespace, "cpu-0", timeout=30)
    later = stub.requests[n:]
    assert any(v == "filter" and b["Pod"]["metadata"]["name"] == "cpu-0" for v, b in later), later
    assert any(v == "bind" and b["PodName"] == "cpu-0" for v, b in later), later


def test_restart_and_teardown_stop_only_own_processes(control_plane: ControlPlane, tmp_path: Path) -> None:
    session_pids = {n: control_plane.pid(n) for n in control_plane.components()}
    cp = ControlPlane(control_plane.bin_dir, base_dir=tmp_path)
    with cp:
        cp.start_plain_scheduler()
        first = cp.pid("plain-scheduler")
        cp.restart("plain-scheduler")
        assert cp.pid("plain-scheduler") not in (None, first)
        cp.stop("kube-apiserver", grace=1.0)
        assert not cp.is_running("kube-apiserver")
        cp.start_component("kube-apiserver")
        k = cp.client()
        try:
            assert k.kubectl("get", "--raw", "/readyz").strip() == "ok"
        finally:
            k.close()
        owned = cp.owned_pids()
        marker = str(cp.dir)
        assert len(owned) == 5  # etcd, apiserver x2, scheduler x2
    assert not [p for p in owned if _alive(p, marker)]
    assert not cp.dir.exists()
    # The session's control plane is untouched.
    for name, pid in session_pids.items():
        assert pid is not None and control_plane.pid(name) == pid and _alive(pid, str(control_plane.dir))


def test_validating_admission_policy_limits_agent_to_its_own_node(
    control_plane: ControlPlane, kube: KubeClient, make_nodes: MakeNodes, namespace: str, test_id: str
) -> None:
    """RBAC lets the agent patch nodes; a ValidatingAdmissionPolicy on the token's node-name
    extra confines it to its own Node."""
    own, other = make_nodes([SimNode(f"{test_id}-own"), SimNode(f"{test_id}-other")])
    user = f"system:serviceaccount:{namespace}:agent"
    kube.create_service_account(namespace, "agent")
    kube.apply_rbac(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": test_id},
                "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": test_id},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": test_id},
                "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": namespace}],
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": test_id},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {
                        "resourceRules": [
                            {
                                "apiGroups": [""],
                                "apiVersions": ["v1"],
                                "operations": ["UPDATE"],
                                "resources": ["nodes"],
                            }
                        ]
                    },
                    "matchConditions": [{"name": "is-agent", "expression": f"request.userInfo.username == '{user}'"}],
                    "validations": [
                        {
                            "expression": f"'{NODE_NAME_EXTRA}' in request.userInfo.extra && "
                            f"request.userInfo.extra['{NODE_NAME_EXTRA}'][0] == object.metadata.name",
                            "message": "an agent may only update its own node",
                            "reason": "Forbidden",  # 403; the default is Invalid (422)
                        }
                    ],
                },
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": test_id},
                "spec": {"policyName": test_id, "validationActions": ["Deny"]},
            },
        ]
    )
    token = kube.create_token(namespace, "agent", bound_node=own)
    agent = KubeClient(control_plane.write_kubeconfig(control_plane.dir / f"{test_id}.kubeconfig", token=token))
    try:
        # The policy becomes active asynchronously (the apiserver's informers); retry until then.
        deadline = time.monotonic() + 15
        while True:
            try:
                agent.annotate_node(other, {"gputopo.io/probe": "1"})
            except KubeApiError as e:
                assert e.status == 403 and "only update its own node" in e.message, e
                break
            kube.annotate_node(other, {"gputopo.io/probe": None})
            assert time.monotonic() < deadline, "ValidatingAdmissionPolicy never took effect"
            time.sleep(0.2)
        agent.annotate_node(own, {"gputopo.io/probe": "1"})
        assert kube.get_node(own)["metadata"]["annotations"]["gputopo.io/probe"] == "1"
    finally:
        agent.close()
        kube.kubectl(
            "delete",
            f"validatingadmissionpolicybinding/{test_id}",
            f"validatingadmissionpolicy/{test_id}",
            f"clusterrolebinding/{test_id}",
            f"clusterrole/{test_id}",
        )


def _status(url: str, token: str) -> int:
    """The HTTP status of a GET with the admin token (any TLS certificate accepted), asking for
    text (the only type /flagz serves)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "text/plain"})
    try:
        with urllib.request.urlopen(req, timeout=5, context=insecure_ctx()) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _flagz_served(cp: ControlPlane) -> dict[str, bool]:
    """Whether kube-apiserver, the plain scheduler and kube-controller-manager serve /flagz
    (feature gate ComponentFlagz)."""
    ports = {
        "kube-apiserver": cp.apiserver_port,
        "plain-scheduler": cp.scheduler_port("plain-scheduler"),
        CONTROLLER_MANAGER: cp.controller_manager_port,
    }
    return {name: _status(f"https://127.0.0.1:{port}/flagz", cp.admin_token) == 200 for name, port in ports.items()}


def test_feature_gates_reach_every_component_and_runtime_config_the_apiserver(
    control_plane: ControlPlane, kube: KubeClient, tmp_path: Path
) -> None:
    """ComponentFlagz (alpha and off in 1.34, beta and on from 1.36) toggled against its default
    turns /flagz on or off in all three components; resource.k8s.io/v1beta2, off by default in
    both releases, is served once runtime-config asks for it."""
    if "plain-scheduler" not in control_plane.components():
        control_plane.start_plain_scheduler()
    default = _flagz_served(control_plane)
    assert len(set(default.values())) == 1, default
    flip = not default["kube-apiserver"]
    beta = "resource.k8s.io/v1beta2"
    versions = {v["groupVersion"] for v in kube.request("GET", "/apis/resource.k8s.io")["versions"]}
    assert beta not in versions
    cp = ControlPlane(
        control_plane.bin_dir,
        base_dir=tmp_path,
        features=ApiFeatures(feature_gates={"ComponentFlagz": flip}, runtime_config={beta: True}),
    )
    with cp:
        cp.start_controller_manager()
        cp.start_plain_scheduler()
        assert _flagz_served(cp) == dict.fromkeys(default, flip)
        with cp.client() as k:
            assert beta in {v["groupVersion"] for v in k.request("GET", "/apis/resource.k8s.io")["versions"]}
