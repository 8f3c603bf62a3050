"""`gputopo defrag`: fragmentation figures on named systems, the moves it proposes (and refuses), and
its outputs. The live path and the extender's gauges are tested in tests/extender/test_defrag_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputopo.console.cli import main
from gputopo.engine.cluster import fragmentation as defrag_engine
from gputopo.engine.cluster.defrag import PlacedPod, plan
from gputopo.engine.cluster.fragmentation import class_figures, node_figures
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import PodRequest, parse_pod_request
from gputopo.systems import build_system
from tests.paths import REPO

ROOT = REPO
CLUSTER = ROOT / "examples" / "defrag" / "cluster.yaml"
PODS = ROOT / "examples" / "defrag" / "pods.yaml"


def node(name: str, system: str, in_use: set[int] | frozenset[int] = frozenset()) -> NodeState:
    return node_state(name, build_system(system, name), in_use=frozenset(in_use))


def pod(ref: str, where: str, gpus: set[int], **ann: str) -> PlacedPod:
    annotations = {f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()}
    return PlacedPod(ref, where, frozenset(gpus), parse_pod_request(annotations, len(gpus)))


# ------------------------------------------------------------------------------------ figures


@pytest.mark.parametrize(
    ("system", "in_use", "sizes", "free", "usable", "stranded"),
    [
        pytest.param("dgx-h100", set(), (8, 4, 2), 8, (8, 8, 8), 0, id="h100-empty-every-size-usable"),
        pytest.param("dgx-h100", {2, 5}, (8, 4, 2), 6, (0, 4, 6), 0, id="h100-tp2-breaks-only-the-8-clique"),
        pytest.param("dgx-h100", {0, 1, 2}, (8, 4, 2), 5, (0, 4, 4), 1, id="h100-odd-free-count-strands-one"),
        pytest.param("dgx-h100", {2, 5}, (8,), 6, (0,), 6, id="h100-only-8s-wanted-strands-all-six"),
        pytest.param("dgx-1v", set(), (8, 4, 2), 8, (0, 8, 8), 0, id="dgx1v-no-8-clique-even-empty"),
        pytest.param("dgx-1v", {0, 4}, (4, 2), 6, (0, 6), 0, id="dgx1v-one-gpu-per-quad-breaks-both-quads"),
        pytest.param("dgx-1v", {0, 1, 4}, (4, 2), 5, (0, 4), 1, id="dgx1v-five-free-pair-into-two"),
        pytest.param("dgx-1v", {0, 1, 2, 3}, (4, 2), 4, (4, 4), 0, id="dgx1v-whole-quad-free"),
        pytest.param("a100-pcie-bridged", set(), (8, 4, 2), 8, (0, 0, 8), 0, id="bridged-pairs-only"),
        pytest.param("a100-pcie-bridged", {0, 2}, (4, 2), 6, (0, 4), 2, id="bridged-broken-pairs-strand"),
        pytest.param("a100-pcie-bridged", {0, 2}, (2, 1), 6, (4, 6), 0, id="bridged-one-gpu-pods-use-all"),
    ],
)
def test_fragmentation_counts_free_gpus_in_full_cliques(
    system: str,
    in_use: set[int],
    sizes: tuple[int, ...],
    free: int,
    usable: tuple[int, ...],
    stranded: int,
) -> None:
    f = node_figures(node("n", system, in_use), sizes)
    assert (f.free, f.usable, f.stranded) == (free, usable, stranded)
    assert f.cliques == tuple(u // k for u, k in zip(usable, sizes, strict=True))


@pytest.mark.parametrize(
    ("system", "in_use", "usable", "stranded"),
    [
        pytest.param("dgx-1v", {0, 4}, (0, 6), 0, id="dgx1v-broken-quads"),
        pytest.param("dgx-1v", set(), (8, 8), 0, id="dgx1v-empty"),
        pytest.param("a100-pcie-bridged", {0, 2}, (0, 4), 2, id="bridged-broken-pairs"),
    ],
)
def test_past_the_search_budget_a_greedy_packing_answers(
    monkeypatch: pytest.MonkeyPatch, system: str, in_use: set[int], usable: tuple[int, ...], stranded: int
) -> None:
    def clear() -> None:  # memoised packings must not outlive the patched budget
        defrag_engine.cover.cache_clear()
        defrag_engine._figures.cache_clear()

    clear()
    monkeypatch.setattr(defrag_engine, "COVER_BUDGET", 0)
    try:
        f = node_figures(node("n", system, in_use), (4, 2))
    finally:
        clear()
    assert (f.usable, f.stranded) == (usable, stranded)


def test_figures_are_grouped_by_node_class_and_skip_stale_nodes() -> None:
    from gputopo.engine.state.reasons import Reason

    stale = node_state("s", build_system("dgx-h100", "s"), problem=Reason.TOPOLOGY_STALE)
    nodes = [node("a", "dgx-h100", {2, 5}), node("b", "dgx-h100"), node("c", "dgx-1v", {0, 4}), stale]
    got = {c.name.split(" ")[0]: (c.nodes, c.figures.free, c.figures.usable) for c in class_figures(nodes, (8, 4))}
    assert got == {"dgx-h100": (2, 14, (8, 12)), "dgx-1v": (1, 6, (0, 0))}


# ------------------------------------------------------------------------------------ moves


def _texts(nodes: list[NodeState], pods: list[PlacedPod], max_moves: int) -> list[str]:
    return [s.text() for s in plan(nodes, pods, (8, 4, 2), max_moves=max_moves).steps]


@pytest.mark.parametrize(
    ("nodes", "pods", "max_moves", "expected"),
    [
        pytest.param(
            [node("n7", "dgx-h100", {2, 5}), node("n9", "dgx-h100", {2, 3, 4, 5, 6, 7})],
            [pod("team-a/tp2-x", "n7", {2, 5})],
            10,
            ["move team-a/tp2-x from n7 GPUs 2,5 to n9 GPUs 0,1: frees an 8-GPU clique on n7"],
            id="tp2-moves-to-a-used-node-freeing-an-8-clique",
        ),
        pytest.param(
            [node("n1", "dgx-h100", {0, 1}), node("n2", "dgx-h100")],
            [pod("a/tp2", "n1", {0, 1})],
            10,
            [],
            id="no-move-when-it-only-shifts-the-break-elsewhere",
        ),
        pytest.param(
            [node("v1", "dgx-1v", {0, 4})],
            [pod("a/tp2", "v1", {0, 4}, nvlink="preferred")],
            10,
            ["move a/tp2 on v1 from GPUs 0,4 to GPUs 0,3: frees a 4-GPU clique on v1"],
            id="same-node-move-joins-one-quad",
        ),
        pytest.param(
            [node("n1", "dgx-h100", {0, 1, 4, 5}), node("n2", "dgx-h100", {0, 1, 2, 3})],
            [pod("a/x", "n1", {0, 1}), pod("a/y", "n1", {4, 5})],
            10,
            [
                "move a/x from n1 GPUs 0,1 to n2 GPUs 4,5; move a/y from n1 GPUs 4,5 to n2 GPUs 6,7: "
                "frees an 8-GPU clique on n1"
            ],
            id="two-pods-leave-together-when-one-alone-frees-nothing",
        ),
        pytest.param(
            [node("n1", "dgx-h100", {0, 1, 4, 5}), node("n2", "dgx-h100", {0, 1, 2, 3})],
            [pod("a/x", "n1", {0, 1}), pod("a/y", "n1", {4, 5})],
            1,
            [],
            id="move-budget-too-small-for-the-pair",
        ),
    ],
)
def test_moves_proposed(nodes: list[NodeState], pods: list[PlacedPod], max_moves: int, expected: list[str]) -> None:
    assert _texts(nodes, pods, max_moves) == expected


@pytest.mark.parametrize(
    ("annotations", "moves"),
    [
        pytest.param({}, 1, id="no-hbm-request-may-go-to-v100"),
        pytest.param({"min_gpu_memory": "40Gi"}, 0, id="hbm-request-blocks-the-32gb-v100"),
    ],
)
def test_move_respects_hbm_request(annotations: dict[str, str], moves: int) -> None:
    # The only free pair elsewhere is on a 32 GB V100.
    nodes = [node("n7", "dgx-h100", {2, 5}), node("v1", "dgx-1v", {2, 3, 4, 5, 6, 7})]
    result = plan(nodes, [pod("a/tp2", "n7", {2, 5}, **annotations)])
    assert len(result.moves) == moves
    if moves:
        assert (result.moves[0].target, result.moves[0].target_gpus) == ("v1", (0, 1))


@pytest.mark.parametrize(
    ("nvlink", "moves"),
    [
        pytest.param("required", 0, id="four-gpu-clique-needed-none-free-elsewhere"),
        pytest.param("ignore", 1, id="nvlink-ignore-takes-two-pairs"),
    ],
)
def test_move_respects_clique_size(nvlink: str, moves: int) -> None:
    # v1 has 4 free GPUs (0, 1, 4, 5) that hold no 4-GPU NVLink clique.
    nodes = [node("n1", "dgx-h100", {0, 1, 2, 3}), node("v1", "dgx-1v", {2, 3, 6, 7})]
    result = plan(nodes, [pod("a/tp4", "n1", {0, 1, 2, 3}, nvlink=nvlink)])
    assert [m.target for m in result.moves] == ["v1"] * moves


def test_group_members_and_unreadable_requests_are_never_moved() -> None:
    nodes = [node("n7", "dgx-h100", {2, 5, 6}), node("n9", "dgx-h100", {2, 3, 4, 5, 6, 7})]
    group = pod("a/ring-0", "n7", {2, 5}, group="ring", group_size="2")
    broken = PlacedPod("a/odd", "n7", frozenset({6}), None)
    result = plan(nodes, [group, broken])
    assert result.steps == []
    assert [(p.ref, why.split(" ")[0]) for p, why in result.pinned] == [("a/odd", "its"), ("a/ring-0", "group")]


def test_planning_is_bounded_on_a_synthetic_cluster() -> None:
    # 60 nodes, each H100 with one 2-GPU pod across its clique: ten moves at most, each freeing a clique.
    nodes = [node(f"n{i:02d}", "dgx-h100", {2, 5} if i % 2 else {0, 1, 2, 3, 4, 5}) for i in range(60)]
    pods = [pod(f"a/p{i:02d}", f"n{i:02d}", {2, 5}) for i in range(1, 60, 2)]
    result = plan(nodes, pods)
    assert len(result.moves) == 10
    assert all(s.freed and s.freed[0].size == 8 for s in result.steps)
    assert class_figures(result.after, (8,))[0].figures.usable[0] == 80


# ------------------------------------------------------------------------------------ command


def test_json_report_shape_on_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["defrag", "--cluster", str(CLUSTER), "--pods", str(PODS), "--output", "json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert list(doc) == [
        "sizes",
        "sizesFrom",
        "pendingPods",
        "classes",
        "total",
        "steps",
        "after",
        "pinned",
        "skippedNodes",
    ]
    assert doc["sizes"] == [8, 4, 2]
    row = doc["classes"][0]
    assert list(row) == ["class", "nodes", "freeGpus", "usableGpus", "freeCliques", "strandedGpus"]
    assert list(row["usableGpus"]) == ["8", "4", "2"]
    step = doc["steps"][0]
    assert list(step) == ["moves", "frees", "reason", "text"]
    assert step["moves"][0] == {
        "pod": "team-a/tp2-x",
        "from": {"node": "h100-1", "gpus": [2, 5]},
        "to": {"node": "h100-2", "gpus": [6, 7]},
    }
    assert step["frees"] == [{"node": "h100-1", "size": 8, "cliques": 1}]
    assert doc["total"]["strandedGpus"] == 2 and doc["after"]["total"]["strandedGpus"] == 0
    assert doc["pinned"][0]["pod"] == "team-d/ring-0"
    assert doc["skippedNodes"] == [
        {"node": "a100p-2", "why": "GPU topology stale: agent heartbeat is older than staleAfterSeconds"}
    ]


def test_text_report_on_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["defrag", "--cluster", str(CLUSTER), "--pods", str(PODS), "--sizes", "4,8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Free GPUs against pod sizes 8, 4 (--sizes)\n")
    assert (
        "  1. move team-a/tp2-x from h100-1 GPUs 2,5 to h100-2 GPUs 6,7: frees an 8-GPU clique on h100-1, "
        "4 fewer stranded GPUs\n"
        "  2. move team-c/infer-0 on v100-1 from GPUs 1 to GPUs 4: frees a 4-GPU clique on v100-1, "
        "4 fewer stranded GPUs\n"
    ) in out
    assert "Not moved: team-d/ring-0 on h100-3: group member" in out


def test_pending_pods_set_the_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n- {name: wait-8, gpusPerPod: 8}\n- {name: wait-4, gpusPerPod: 4}\n")
    assert main(["defrag", "--cluster", str(CLUSTER), "--pods", str(pods), "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["sizes"], doc["pendingPods"]) == ([8, 4], 2)


@pytest.mark.parametrize(
    ("pods_yaml", "error"),
    [
        pytest.param(
            "pods:\n- {name: x, node: nope, gpus: [0]}\n", "pods[0] (x).node: no node 'nope'", id="unknown-node"
        ),
        pytest.param("pods:\n- {name: x, node: h100-1, gpus: [9]}\n", "[9] out of range for 8 GPUs", id="gpu-range"),
        pytest.param(
            "pods:\n- {name: x, node: h100-1, gpus: [0]}\n- {name: y, node: h100-1, gpus: [0]}\n",
            "GPU 0 on h100-1 is held by default/x too",
            id="gpu-held-twice",
        ),
        pytest.param("pods:\n- {name: x, node: h100-1}\n", "needs its 'gpus'", id="placed-without-gpus"),
        pytest.param(
            "pods:\n- {name: x, gpusPerPod: 2, annotations: {gputopo.io/nvlink: often}}\n",
            "invalid annotation gputopo.io/nvlink",
            id="bad-annotation",
        ),
    ],
)
def test_bad_pods_file_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pods_yaml: str, error: str
) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text(pods_yaml)
    assert main(["defrag", "--cluster", str(CLUSTER), "--pods", str(pods)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gputopo defrag: ") and error in err and err.count("\n") == 1


def test_bad_sizes_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["defrag", "--cluster", str(CLUSTER), "--sizes", "8,x"])
    assert e.value.code == 2
    assert "give GPU counts separated by commas" in capsys.readouterr().err


def test_request_defaults_match_the_simulator() -> None:
    assert pod("a/x", "n", {0, 1}).request == PodRequest(gpus=2)
