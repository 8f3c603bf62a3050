"""cluster.yaml / jobs.yaml: loading, group defaults, and errors that name file and entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputopo.clusterfile import ClusterFileError, cluster_states, load_cluster, load_jobs
from gputopo.engine.reasons import Reason


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_cluster_file_builds_node_states_with_fixtures_labels_and_in_use(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "c.yaml",
        """
nodes:
  - name: dgx-01
    fixture: dgx-h100
    labels: {gputopo.io/network-leaf: leaf-1, gputopo.io/network-spine: spine-a}
    gpusInUse: [0, 5]
  - name: old
    fixture: dgx-1v
    stale: true
""",
    )
    states = cluster_states(load_cluster(p))
    assert states[0].in_use == frozenset({0, 5})
    assert states[0].location["leaf"] == "spine-a/leaf-1"
    assert states[1].problem is Reason.TOPOLOGY_STALE


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("nodes: [", "not valid YAML at line 1", id="bad-yaml"),
        pytest.param("items: []", "expected a mapping with a 'nodes' list", id="wrong-top-key"),
        pytest.param(
            "nodes:\n  - name: a\n    fixture: dgx-9000\n",
            "nodes[0] (a).fixture: unknown system 'dgx-9000'",
            id="unknown-fixture",
        ),
        pytest.param("nodes:\n  - name: a\n", "nodes[0] (a): give exactly one of 'fixture'", id="no-topology-source"),
        pytest.param(
            "nodes:\n  - name: a\n    fixture: l40s-4\n    gpusInUse: [7]\n",
            "gpusInUse: [7] out of range for 4 GPUs",
            id="in-use-out-of-range",
        ),
        pytest.param(
            "nodes:\n  - {name: a, fixture: l40s-4}\n  - {name: a, fixture: l40s-4}\n",
            "node name 'a' appears twice",
            id="duplicate-node",
        ),
    ],
)
def test_bad_cluster_file_errors_name_file_and_entry(tmp_path: Path, text: str, fragment: str) -> None:
    p = write(tmp_path, "c.yaml", text)
    with pytest.raises(ClusterFileError) as err:
        load_cluster(p)
    assert str(p) in str(err.value)
    assert fragment in str(err.value)


def test_missing_cluster_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ClusterFileError, match="cannot read"):
        load_cluster(tmp_path / "nope.yaml")


def test_job_with_several_pods_is_one_group_with_stages(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "j.yaml",
        """
jobs:
  - name: llama
    pods: 4
    gpusPerPod: 8
    annotations: {gputopo.io/network: infiniband}
  - name: single
    gpusPerPod: 2
""",
    )
    jobs = load_jobs(p).jobs
    assert jobs[0].pod_annotations(2) == {
        "gputopo.io/network": "infiniband",
        "gputopo.io/group": "llama",
        "gputopo.io/group-size": "4",
        "gputopo.io/stage": "2",
    }
    assert jobs[1].pod_annotations(0) == {}


def test_bad_job_entry_is_named(tmp_path: Path) -> None:
    p = write(tmp_path, "j.yaml", "jobs:\n  - name: x\n    gpusPerPod: -1\n")
    with pytest.raises(ClusterFileError, match=r"jobs\[0\] \(x\)\.gpusPerPod"):
        load_jobs(p)
