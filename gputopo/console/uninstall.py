"""`gputopo uninstall-cleanup`: delete the Leases a release's components wrote at run time.

The chart runs it as its ``post-delete`` hook (a Job with its own ServiceAccount and Role), so that
``helm uninstall`` leaves no gputopo object: the Leases are not the chart's (kube-scheduler writes
its leader Lease, each agent its heartbeat ``gputopo-agent-<node>``), so helm cannot delete them.

It first waits, for at most ``--wait-seconds``, until the release's scheduler and agent pods are
gone: a kube-scheduler still running would re-create its leader Lease on its next renewal, and a
stopping agent deletes its own Lease anyway. Then it deletes the named Leases and every
``gputopo-agent-*`` Lease of the namespace (those of agents that died without deleting theirs).
Exit status 1 when a delete failed or the pods outlived the wait (the Leases are deleted anyway).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from gputopo.kube import Kube, KubeError, find_kubeconfig, lease_path, pods_path, short_error
from gputopo.model import AGENT_LEASE_PREFIX

COMPONENTS = ("scheduler", "agent")  # the chart's app.kubernetes.io/component of the Lease writers


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "uninstall-cleanup",
        help="delete the Leases a gputopo release wrote at run time (the chart's post-delete hook)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--namespace", required=True, help="the release namespace")
    p.add_argument("--release", required=True, help="the release name (app.kubernetes.io/instance of its pods)")
    p.add_argument(
        "--lease", action="append", default=[], help="a further Lease to delete (kube-scheduler's leader Lease)"
    )
    p.add_argument("--wait-seconds", type=float, default=120.0, help="how long to wait for the release's pods to go")
    p.add_argument("--kubeconfig", type=Path, default=None, help="kubeconfig (default: in-cluster)")
    return p


def _say(msg: str) -> None:
    print(msg, flush=True)


def release_pods(kube: Kube, namespace: str, release: str) -> list[str]:
    """Names of the release's scheduler and agent pods that still exist (terminating ones too)."""
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component in ({','.join(COMPONENTS)})"
    items, _ = kube.list_items(pods_path(namespace), label_selector=selector)
    return sorted(str(p["metadata"]["name"]) for p in items)


def leases_to_delete(names: list[str], extra: list[str]) -> list[str]:
    """The agents' heartbeat Leases and the named ones, among the namespace's Lease ``names``."""
    return sorted(n for n in names if n.startswith(AGENT_LEASE_PREFIX) or n in extra)


def cleanup(kube: Kube, namespace: str, release: str, leases: list[str], wait_s: float, poll_s: float = 1.0) -> int:
    """Wait for the release's pods to go (bounded), then delete the Leases; the exit status."""
    status = 0
    deadline = time.monotonic() + wait_s
    while pods := release_pods(kube, namespace, release):
        if time.monotonic() > deadline:
            _say(f"pods of release {release} still exist after {wait_s:.0f}s: {', '.join(pods)}")
            status = 1
            break
        time.sleep(poll_s)
    items, _ = kube.list_items(lease_path(namespace))
    for name in leases_to_delete([str(i["metadata"]["name"]) for i in items], leases):
        try:
            kube.delete(lease_path(namespace, name))
        except KubeError as e:
            if e.status == 404:
                continue
            _say(f"deleting Lease {namespace}/{name} failed: {short_error(e)}")
            status = 1
            continue
        _say(f"deleted Lease {namespace}/{name}")
    return status


def run(args: argparse.Namespace) -> int:
    try:
        kube = Kube(find_kubeconfig(args.kubeconfig))
    except Exception as e:  # no kubeconfig and not in a pod
        print(f"gputopo uninstall-cleanup: cannot configure the Kubernetes client: {e}", file=sys.stderr)
        return 2
    try:
        return cleanup(kube, args.namespace, args.release, list(args.lease), args.wait_seconds)
    except KubeError as e:
        print(f"gputopo uninstall-cleanup: {short_error(e)}", file=sys.stderr)
        return 1
    finally:
        kube.close()
