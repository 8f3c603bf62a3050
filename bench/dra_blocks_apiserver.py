"""`--dra-blocks` against a real kube-apiserver (docs/devices.md, "Clique blocks"): starts a bare etcd and
kube-apiserver of one cached release on free ports (no kubelet, no scheduler), publishes each node's pool
through the agent's own publisher (`gputopo.agent.dra.pool`), re-publishes it with GPU 0 in use, and
prints what the server stored: per slice its generation, slice count, devices, blocks, devices that
consume counters, and its counter sets. On 1.36 and later the counters are kept; before, the server drops
them and the publisher falls back to the single GPUs. Stops what it started.

    .venv/bin/python bench/dra_blocks_apiserver.py 1.37.2 [dgx-h100 ... nvswitch32 mesh32]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gputopo.agent.dra.pool import PoolPublisher
from gputopo.agent.dra.slices import KubeSliceApi, SliceShape
from gputopo.kube import Kube
from gputopo.localcluster.controlplane import ControlPlane
from gputopo.model import NodeTopology
from gputopo.systems import build_system

SYSTEMS = ("dgx-h100", "dgx-1v", "a100-pcie-bridged", "gb200-tray", "nvswitch32", "mesh32")


def linked(n: int, *, mesh: bool) -> NodeTopology:
    """`n` GPUs all linked alike (NVSwitch), or (`mesh`) each to all but its partner 2k, 2k+1: 2^(n/2)
    maximal cliques, 96 blocks kept, the pool's devices in two slices."""
    base = build_system("dgx-h100", "bench")
    gpu = base.gpus[0]
    gpus = tuple(gpu.model_copy(update={"index": i, "uuid": f"GPU-{i:04d}", "pci_bus_id": ""}) for i in range(n))
    links = tuple(tuple(0 if j == i or (mesh and j == i ^ 1) else 18 for j in range(n)) for i in range(n))
    nvlink = base.nvlink.model_copy(update={"links": links})
    return base.model_copy(update={"gpus": gpus, "nvlink": nvlink, "nics": (), "degraded_links": ()})


def main(argv: list[str]) -> int:
    version, systems = argv[0], argv[1:] or list(SYSTEMS)
    bin_dir = next(Path.home().glob(f".cache/gputopo/k8s-v{version}_*/bin"))
    shape = SliceShape(list_attributes=False, device_taints=False, best_fit_order=True, blocks=True)
    with tempfile.TemporaryDirectory(prefix="gputopo-blocks-") as tmp, ControlPlane(bin_dir, base_dir=Path(tmp)) as cp:
        kube = Kube(cp.kubeconfig)
        api = KubeSliceApi(kube)
        for i, system in enumerate(systems):
            if system.startswith(("nvswitch", "mesh")):
                topo = linked(int(system.lstrip("nvswitchme")), mesh=system.startswith("mesh"))
            else:
                topo = build_system(system)
            node = f"node-{i}"
            kube.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
            pub = PoolPublisher(api, node, shape, sleep=lambda _s: False)
            results = [pub.publish(topo).value, pub.publish(topo, in_use=frozenset({0})).value]
            results.append(pub.publish(topo, in_use=frozenset({0})).value)
            items, _ = kube.list_items(
                "/apis/resource.k8s.io/v1/resourceslices", field_selector=f"spec.nodeName={node}"
            )
            print(f"{version} {system}: publishes {results}, counters dropped: {pub.counters_dropped}")
            for item in sorted(items, key=lambda x: str(x["metadata"]["name"])):
                spec = item["spec"]
                devices = spec.get("devices") or []
                blocks = sum(1 for d in devices if d["name"].startswith("block-"))
                consume = sum(1 for d in devices if d.get("consumesCounters"))
                sets = [(c["name"], len(c["counters"])) for c in spec.get("sharedCounters") or []]
                print(
                    f"  {item['metadata']['name']}: generation {spec['pool']['generation']}, "
                    f"{spec['pool']['resourceSliceCount']} slices, {len(devices)} devices, {blocks} blocks, "
                    f"{consume} consume counters, counter sets {sets}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
