"""TP groups across trays through the extender's verbs: each member's placement names its TP group, the
NVLink domain and the predicted TP all-reduce, whichever member binds first."""

from __future__ import annotations

import pytest

from gputopo.model import HEALTHY_MASK, PLACEMENT_ANNOTATION, GpuFabric, parse_placement
from gputopo.systems import build_system
from tests.extender.harness import JSON, Env, gputopo_pod, node_obj


def tray(name: str, rack: str) -> JSON:
    topo = build_system("gb200-tray", name)
    fabric = GpuFabric(state="completed", health_mask=HEALTHY_MASK)
    topo = topo.model_copy(update={"gpus": tuple(g.model_copy(update={"fabric": fabric}) for g in topo.gpus)})
    node = node_obj(name, None, topology_text=topo.to_annotation(), leaf=f"leaf-{rack}")
    node["metadata"]["labels"].update({"nvidia.com/gpu.clique": rack, "team": "llm"})
    return node


@pytest.mark.parametrize("selector", [False, True], ids=["plain", "node-selector"])
def test_every_member_of_a_tp16_group_is_told_its_tp_group_and_domain(env: Env, selector: bool) -> None:
    trays = [f"{r}-tray-{i}" for r in "ab" for i in range(1, 5)]
    env.add_nodes(*[tray(t, t[0]) for t in trays])
    pods = [gputopo_pod(f"tp-{i}", 4, group="tp", group_size="4", stage=str(i), **{"tp-size": "16"}) for i in range(4)]
    if selector:  # members with a nodeSelector are planned by gputopo.engine.gang.assigned
        for pod in pods:
            pod["spec"]["nodeSelector"] = {"team": "llm"}

    env.add_pods(*pods)
    bound = []
    for pod in pods:
        (node,) = env.filter(pod, trays)["NodeNames"]
        assert env.bind(pod, node) == ""
        bound.append(node)
    assert len({n[0] for n in bound}) == 1, bound
    for i, pod in enumerate(pods):
        stored = env.source.get("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])
        assert stored is not None
        placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert "TP group 0/1 (16 GPUs, ranks 0-3) in NVLink domain " in placement.reason, (i, placement.reason)
        assert "TP all-reduce 2.8 ms in one domain vs 10.8 ms across two" in placement.reason
        tp = placement.tp
        assert tp is not None and (tp.group, tp.groups, tp.gpus, tp.domain) == (0, 1, 16, bound[0][0]), tp
        assert [(s.domain, s.tp_groups) for s in tp.split] == [(bound[0][0], 1)]
        assert tp.across_all_reduce_ms is not None
        assert (round(tp.all_reduce_ms, 1), round(tp.across_all_reduce_ms, 1)) == (2.8, 10.8)
