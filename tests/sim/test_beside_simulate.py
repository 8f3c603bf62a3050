"""`gputopo simulate` follows the extender's rule for a group member that asks for no GPU: it keeps its
stage and sits beside its nearest GPU-holding stage, without taking a node from the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gputopo.clusterfile import ClusterFileError, load_jobs
from gputopo.console.cli import main
from tests.paths import REPO

ROOT = REPO
CLUSTER = ROOT / "examples" / "cluster.yaml"

JOBS = """jobs:
  - name: llama
    pods: 5
    gpusPerPod: 8
    gpusByPod: {by_pod}
    annotations: {{gputopo.io/network: infiniband}}
"""


@pytest.mark.parametrize(("by_pod", "driver", "beside"), [([0, 8, 8, 8, 8], 0, 1), ([8, 8, 8, 8, 0], 4, 3)])
def test_simulate_places_a_member_without_gpus_beside_its_nearest_gpu_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], by_pod: list[int], driver: int, beside: int
) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(JOBS.format(by_pod=json.dumps(by_pod)))
    assert main(["simulate", "--cluster", str(CLUSTER), "--jobs", str(jobs), "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unplaced"] == []
    where = {p["pod"]: p for p in doc["placements"]}
    cpu = where[f"llama-{driver}"]
    assert cpu["gpus"] == [] and cpu["node"] == where[f"llama-{beside}"]["node"]
    assert f"stage {driver}/5 " in cpu["reason"]
    workers = [where[f"llama-{i}"] for i in range(5) if i != driver]
    assert len({w["node"] for w in workers}) == 4 and all(len(w["gpus"]) == 8 for w in workers)


def test_gpus_by_pod_names_one_count_per_pod(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(JOBS.format(by_pod="[0, 8]"))
    with pytest.raises(ClusterFileError, match="gpusByPod names 2 pods; the job has 5"):
        load_jobs(jobs)
