"""What the ComputeDomain rules cost a filter, in process: a pod's filter over every tray of `--racks` GB200
NVL72 racks (18 trays each, 1,152 trays by default), with and without ComputeDomains in play.

Cases, each a fresh pod per filter (so no answer is reused) through the door as kube-scheduler sends it:
- `plain`: a 4-GPU pod, no ComputeDomain anywhere (the rules are skipped without a lock);
- `cd first`: the first pod of a ComputeDomain (numNodes 0: any domain);
- `cd first, numNodes 16`: the same, held to domains with room for 16 trays;
- `cd first, labels`: numNodes 16, and the two spare trays of every rack labelled by NVIDIA's plugin for
  another ComputeDomain (the node label joined to the pods bound: gputopo.engine.gang.imex.with_driver_labels);
- `plain, labels`: a 1-GPU pod of no ComputeDomain among those labels (steered onto served trays).

Prints CPU ms per filter, each case's ratio to `plain` and how many trays pass; the target (every case under
5 ms per filter: a ComputeDomain pod's rules go node by node where other pods' verdicts go by kind of node)
is printed, not asserted. No cluster, no I/O but the in-memory fake's (tests/extender/harness.py).

    .venv/bin/python bench/imex_cost.py
    .venv/bin/python bench/imex_cost.py --racks 128 --filters 50
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness lives under tests/

from gputopo.engine.gang.imex import DRIVER_NODE_LABEL
from gputopo.extender.settings import Settings
from gputopo.extender.watch.computedomains import CHANNEL_DEVICE_CLASS
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, FakeClock, make_env, node_obj, pod_obj

TARGET_MS = 5.0  # every case's CPU per filter
TRAYS_PER_RACK = 18


def template(name: str, uid: str) -> dict[str, Any]:
    request = {"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}
    return {
        "metadata": {"name": name, "namespace": "default", "labels": {DRIVER_NODE_LABEL: uid}},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }


def compute_domain(name: str, num_nodes: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": name}}},
    }


def tray(rack: int, t: int, labelled: bool) -> dict[str, Any]:
    node = node_obj(f"r{rack:03d}-t{t:02d}", "gb200-tray")
    node["metadata"]["labels"]["nvidia.com/gpu.clique"] = f"rack-{rack:03d}"
    if labelled:
        node["metadata"]["labels"][DRIVER_NODE_LABEL] = f"uid-other-{rack}"
    return node


def pod(i: int, gpus: int, cd: str | None) -> dict[str, Any]:
    p = pod_obj(f"p-{i}", gpus, {"gputopo.io/nvlink": "required"}, uid=f"uid-p-{i}")
    if cd is not None:
        p["spec"]["resourceClaims"] = [{"name": "imex", "resourceClaimTemplateName": cd}]
    return p


def per_filter_ms(env: Env, names: list[str], filters: int, gpus: int, cd: str | None) -> tuple[float, int]:
    """CPU ms per filter, after one untimed (the verdicts of each kind of tray are then known), and how many
    trays the filter passes."""
    passed = len(env.filter(pod(-1, gpus, cd), names)["NodeNames"] or [])
    start = time.process_time()
    for i in range(filters):
        env.filter(pod(i, gpus, cd), names)
    return (time.process_time() - start) * 1000 / filters, passed


def run(racks: int, filters: int) -> dict[str, tuple[float, int]]:
    settings = Settings(namespace=NS, stale_after_seconds=1e9, reservation_timeout_seconds=1e9, metrics_port=0)
    out: dict[str, tuple[float, int]] = {}
    for labels in (False, True):
        with make_env(FakeSource(NS), FakeClock(), settings) as env:
            for r in range(racks):
                env.source.put("resourceclaimtemplates", template(f"other-{r}", f"uid-other-{r}"))
            for name, n in (("cd-any", 0), ("cd-16", 16)):
                env.source.put("resourceclaimtemplates", template(name, f"uid-{name}"))
                env.source.put("computedomains", compute_domain(name, n))
            trays = [tray(r, t, labels and t >= 16) for r in range(racks) for t in range(TRAYS_PER_RACK)]
            env.add_nodes(*trays)
            names = [t["metadata"]["name"] for t in trays]
            if labels:
                out["cd first, labels"] = per_filter_ms(env, names, filters, 4, "cd-16")
                out["plain, labels"] = per_filter_ms(env, names, filters, 1, None)
            else:
                out["plain"] = per_filter_ms(env, names, filters, 4, None)
                out["cd first"] = per_filter_ms(env, names, filters, 4, "cd-any")
                out["cd first, numNodes 16"] = per_filter_ms(env, names, filters, 4, "cd-16")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--racks", type=int, default=64)
    ap.add_argument("--filters", type=int, default=30, help="filters per case")
    args = ap.parse_args()
    if not 1 <= args.racks <= 1024 or not 1 <= args.filters <= 1000:
        ap.error("--racks takes 1 to 1024, --filters 1 to 1000")
    got = run(args.racks, args.filters)
    print(f"{args.racks} racks, {args.racks * TRAYS_PER_RACK} trays; CPU ms per filter over every tray")
    base = got["plain"][0]
    for case, (ms, passed) in got.items():
        print(f"  {case:24s} {ms:8.2f} ms   x{ms / base:5.2f} of plain   ({passed} trays pass)")
    worst = max(ms for ms, _ in got.values())
    print(
        f"target: every case under {TARGET_MS} ms: {'met' if worst <= TARGET_MS else 'missed'} (worst {worst:.2f} ms)"
    )


if __name__ == "__main__":
    main()
