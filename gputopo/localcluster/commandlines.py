"""The command lines of the local control plane's components: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager, as `ControlPlane` starts them, on loopback, from one private directory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gputopo.localcluster.procs import HOST

SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.0.0.0/24"
# What kube-controller-manager runs, and nothing else. Left out on purpose: the node-lifecycle
# controller (it would mark every simulated, kubelet-less Node NotReady and taint it), the pod GC
# (it would delete pods bound to Nodes a test deleted) and the namespace controller.
CONTROLLERS = (
    "serviceaccount-token-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "garbage-collector-controller",
    "daemonset-controller",
    "deployment-controller",
    "replicaset-controller",
    "job-controller",
    "statefulset-controller",
    # DRA: makes a pod's ResourceClaims from its templates and deletes them with it.
    "resourceclaim-controller",
)


def etcd_argv(exe: Path, data_dir: Path, client_url: str, peer_url: str) -> list[str]:
    """A one-member etcd for throwaway data: no fsync, warnings only."""
    return [
        str(exe),
        "--name=gputopo",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=gputopo={peer_url}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync=true",
        "--log-level=warn",
        "--quota-backend-bytes=8589934592",
    ]


def apiserver_argv(
    exe: Path,
    state_dir: Path,
    *,
    etcd_port: int,
    port: int,
    service_account_admission: bool,
    verbosity: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """kube-apiserver over the etcd on `etcd_port`, its keys, tokens and admission configuration in
    `state_dir` (as `ControlPlane` writes them)."""
    return [
        str(exe),
        f"--etcd-servers=http://{HOST}:{etcd_port}",
        f"--bind-address={HOST}",
        f"--advertise-address={HOST}",
        f"--secure-port={port}",
        f"--cert-dir={state_dir / 'pki'}",
        f"--token-auth-file={state_dir / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={state_dir / 'sa.pub'}",
        f"--service-account-signing-key-file={state_dir / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # ServiceAccount: tests create pods in a namespace the moment they create it, before the
        # serviceaccount controller (when kube-controller-manager runs at all) has made its
        # `default` account, which the plugin would require. TaintNodesByCondition: no
        # node-lifecycle controller runs to remove the not-ready taint it puts on new Nodes.
        "--disable-admission-plugins="
        + ("" if service_account_admission else "ServiceAccount,")
        + "TaintNodesByCondition",
        "--enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy",
        # Webhooks are called with a client certificate (what a real cluster can be set up to do).
        f"--admission-control-config-file={state_dir / 'admission.json'}",
        "--allow-privileged=true",
        # The `kubernetes` Service cannot point at a loopback address; skip it.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        f"--v={verbosity}",
        *extra,
    ]


@dataclass(frozen=True)
class Serving:
    """Where a component serves its /healthz and /metrics: its loopback `port`, over TLS with the
    certificate it makes itself in `cert_dir`."""

    port: int
    cert_dir: Path


def scheduler_argv(
    exe: Path, config: Path, *, serving: Serving, auth: Path, verbosity: int, extra: Sequence[str] = ()
) -> list[str]:
    """kube-scheduler with its configuration file; `auth` serves its delegated authentication and
    authorization, as the in-cluster config would."""
    return [
        str(exe),
        f"--config={config}",
        f"--bind-address={HOST}",
        f"--secure-port={serving.port}",
        f"--cert-dir={serving.cert_dir}",
        f"--authentication-kubeconfig={auth}",
        f"--authorization-kubeconfig={auth}",
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
        f"--v={verbosity}",
        *extra,
    ]


def controller_manager_argv(
    exe: Path,
    kubeconfig: Path,
    *,
    serving: Serving,
    sa_key: Path,
    ca_file: Path | None,
    verbosity: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """kube-controller-manager with `CONTROLLERS` only, each with its own service account, no leader
    election (there is one)."""
    argv = [
        str(exe),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}",
        f"--secure-port={serving.port}",
        f"--cert-dir={serving.cert_dir}",
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS)}",
        "--use-service-account-credentials=true",
        # The service-account token controller signs legacy token Secrets with the apiserver's key.
        f"--service-account-private-key-file={sa_key}",
        "--profiling=false",
        f"--v={verbosity}",
        *extra,
    ]
    if ca_file is not None:
        # What the root-CA publisher puts in every namespace's kube-root-ca.crt ConfigMap.
        argv.append(f"--root-ca-file={ca_file}")
    return argv
