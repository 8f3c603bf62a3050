"""`gputopo simulate`: output formats, the examples, and one clear error line for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputopo.console.cli import main
from tests.paths import REPO

ROOT = REPO
CLUSTER = ROOT / "examples" / "cluster.yaml"
JOBS = ROOT / "examples" / "jobs.yaml"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["simulate", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("policy", ["gputopo", "default", "random"])
def test_json_output_has_placements_unplaced_and_summary(capsys: pytest.CaptureFixture[str], policy: str) -> None:
    rc, out, _ = _run(capsys, "--cluster", str(CLUSTER), "--jobs", str(JOBS), "--output", "json", "--policy", policy)
    assert rc == 0
    doc = json.loads(out)
    assert list(doc) == ["placements", "unplaced", "summary"]
    for p in doc["placements"]:
        assert list(p) == ["pod", "node", "gpus", "score", "reason"]
        assert isinstance(p["gpus"], list) and 0 <= p["score"] <= 10 and p["reason"]
    for u in doc["unplaced"]:
        assert list(u) == ["pod", "reasons"]
        assert u["reasons"].startswith("0/11 nodes are available: ")
    assert doc["summary"]["policy"] == policy
    assert len(doc["placements"]) + len(doc["unplaced"]) == doc["summary"]["pods"] == 12


def test_examples_show_every_feature_under_gputopo(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--cluster", str(CLUSTER), "--jobs", str(JOBS), "--output", "json")
    assert rc == 0
    doc = json.loads(out)
    where = {p["pod"]: (p["node"], p["gpus"]) for p in doc["placements"]}
    assert {where[f"llama-70b-pp-{i}"][0] for i in range(4)} == {f"dgx-h100-{i}" for i in range(1, 5)}
    assert where["llama-405b-fp8-0"][0].startswith("hgx-h200")
    assert where["resnet-tp4-0"] == ("dgx-1v-1", [4, 5, 6, 7])
    # preferred: no healthy 4-GPU clique is left, so it takes the clique with a degraded link
    assert "some with degraded links: no healthy clique was free" in next(
        p["reason"] for p in doc["placements"] if p["pod"] == "whisper-preferred-0"
    )
    (late,) = doc["unplaced"]
    assert late["pod"] == "gpt-tp4-late-0"
    assert "GPU topology stale" in late["reasons"] and "fewer than 4 NVLink-connected GPUs" in late["reasons"]
    assert doc["summary"]["groupsWithinOne"] == {"spine": 1, "leaf": 1}
    assert doc["summary"]["podsWithBrokenRequests"] == {}


def test_text_output_names_node_gpus_and_reason_per_pod(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--cluster", str(CLUSTER), "--jobs", str(JOBS))
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("resnet-tp4-0"))
    assert "dgx-1v-1" in line and "4-7" in line and "form a full NVLink clique" in line
    assert "gpt-tp4-late-0  0/11 nodes are available:" in out
    assert "Summary" in out and "multi-GPU pods on a full NVLink clique" in out and "stranded GPUs" in out


def test_default_policy_text_says_what_kubernetes_would_do(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--cluster", str(CLUSTER), "--jobs", str(JOBS), "--policy", "default", "--seed", "1")
    assert rc == 0
    assert "kube-scheduler (LeastAllocated) chose" in out
    broken = next(ln for ln in out.splitlines() if "pods placed against their requests" in ln)
    assert "required-tier" in broken and "nvlink" in broken, "blind to tiers and cliques, default breaks both"


BAD_JOB = "jobs:\n  - name: bad\n    gpusPerPod: 2\n    annotations: {gputopo.io/nvlink: maybe}\n"


@pytest.mark.parametrize(
    ("cluster", "jobs", "expected"),
    [
        (None, "missing.yaml", "missing.yaml: cannot read"),
        ("nodes: [", None, "not valid YAML"),
        ("nodes:\n  - name: n1\n    fixture: dgx-h900\n", None, "nodes[0] (n1).fixture: unknown system 'dgx-h900'"),
        (None, BAD_JOB, 'jobs[0] (bad).annotations: invalid annotation gputopo.io/nvlink="maybe"'),
        (None, "jobs:\n  - name: x\n", "jobs[0] (x).gpusPerPod"),
        (
            "racks:\n  - {name: r1, system: gb200-nvl72, trays: 20}\n",
            None,
            "racks[0] (r1).trays: a gb200-nvl72 rack holds 1 to 18 trays, not 20",
        ),
    ],
)
def test_bad_input_gives_one_error_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cluster: str | None, jobs: str | None, expected: str
) -> None:
    cluster_path, jobs_path = str(CLUSTER), str(JOBS)
    if cluster is not None:
        (tmp_path / "cluster.yaml").write_text(cluster)
        cluster_path = str(tmp_path / "cluster.yaml")
    if jobs == "missing.yaml":
        jobs_path = str(tmp_path / "missing.yaml")
    elif jobs is not None:
        (tmp_path / "jobs.yaml").write_text(jobs)
        jobs_path = str(tmp_path / "jobs.yaml")
    rc, out, err = _run(capsys, "--cluster", cluster_path, "--jobs", jobs_path)
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and expected in err
    assert "Traceback" not in err


def test_unknown_policy_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--cluster", str(CLUSTER), "--jobs", str(JOBS), "--policy", "best"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "simulate" in capsys.readouterr().err


RACKS_CLUSTER = """
nodes:
  - {name: h100-1, fixture: dgx-h100}
racks:
  - {name: rack-a, system: gb200-nvl72, degraded: [1]}
  - {name: rack-b, system: gb300-nvl72, trays: 16}
"""
RACK_JOBS = """
jobs:
  - name: tp16
    pods: 4
    gpusPerPod: 4
    annotations: {gputopo.io/required-tier: nvlink-domain}
"""


def test_simulate_reads_racks_from_the_cluster_file_and_keeps_a_domain_group_in_one_rack(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "cluster.yaml").write_text(RACKS_CLUSTER)
    (tmp_path / "jobs.yaml").write_text(RACK_JOBS)
    rc, out, err = _run(capsys, "--cluster", str(tmp_path / "cluster.yaml"), "--jobs", str(tmp_path / "jobs.yaml"))
    assert (rc, err) == (0, "")
    assert "Cluster 35 nodes, 144 GPUs (0 already in use)" in out
    rc, out, _ = _run(
        capsys, "--cluster", str(tmp_path / "cluster.yaml"), "--jobs", str(tmp_path / "jobs.yaml"), "--output", "json"
    )
    nodes = {p["node"] for p in json.loads(out)["placements"]}
    assert len(nodes) == 4
    assert {n.rsplit("-tray-", 1)[0] for n in nodes} in ({"rack-a"}, {"rack-b"})
