"""cluster.yaml / jobs.yaml: loading, group defaults, and errors that name file and entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.clusterfile import ClusterFileError, cluster_states, load_cluster, load_jobs
from gputopo.engine.state.reasons import Reason
from gputopo.model import FabricHealth
from gputopo.systems import RACKS, rack_clique


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
        pytest.param("items: []", "expected a mapping with a 'nodes' or 'racks' list", id="wrong-top-key"),
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


def test_a_rack_expands_to_its_trays_in_one_nvlink_domain_with_labels_degraded_trays_and_in_use(
    tmp_path: Path,
) -> None:
    p = write(
        tmp_path,
        "c.yaml",
        """
racks:
  - name: rack-a
    system: gb200-nvl72
    labels: {gputopo.io/network-spine: s1}
    degraded: [3]
    gpusInUse: {2: [0, 1]}
""",
    )
    states = {n.name: n for n in cluster_states(load_cluster(p))}
    assert sorted(states) == [f"rack-a-tray-{t:02d}" for t in range(1, 19)]
    assert {n.location["nvlink-domain"] for n in states.values()} == {rack_clique("rack-a")}
    assert all(n.labels["gputopo.io/network-spine"] == "s1" for n in states.values())
    assert {name for name, n in states.items() if n.fabric is not FabricHealth.HEALTHY} == {"rack-a-tray-03"}
    assert states["rack-a-tray-03"].fabric_detail == "GPU 2: healthMask 0xa9: degraded bandwidth"
    assert states["rack-a-tray-02"].in_use == frozenset({0, 1})
    assert sum(len(n.in_use) for n in states.values()) == 2


@pytest.mark.parametrize(
    ("racks", "trays", "domains"),
    [
        pytest.param("[{name: r1, system: gb200-nvl72}]", 18, 1, id="one rack: 18 trays, one domain"),
        pytest.param(
            "[{name: r1, system: gb200-nvl72}, {name: r2, system: gb300-nvl72, trays: 16}]",
            34,
            2,
            id="two racks: two domains",
        ),
        pytest.param("[{name: r1, system: gb300-nvl72, trays: 1}]", 1, 1, id="a rack of one tray"),
    ],
)
def test_racks_beside_nodes_are_one_nvlink_domain_each(tmp_path: Path, racks: str, trays: int, domains: int) -> None:
    p = write(tmp_path, "c.yaml", f"nodes:\n  - {{name: h, fixture: dgx-h100}}\nracks: {racks}\n")
    states = cluster_states(load_cluster(p))
    assert states[0].name == "h" and states[0].location.get("nvlink-domain") is None
    assert len(states) == 1 + trays
    assert len({n.location["nvlink-domain"] for n in states[1:]}) == domains


def _rack(fields: str) -> str:
    return f"racks:\n  - {{name: r1, {fields}}}\n"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param(
            _rack("system: gb100-nvl36"), "racks[0] (r1).system: unknown rack system 'gb100-nvl36'", id="system"
        ),
        pytest.param(_rack("trays: 18"), "racks[0] (r1).system: Field required", id="no-system"),
        pytest.param(
            _rack("system: gb200-nvl72, trays: 19"),
            "racks[0] (r1).trays: a gb200-nvl72 rack holds 1 to 18",
            id="trays-high",
        ),
        pytest.param(
            _rack("system: gb200-nvl72, trays: 0"),
            "racks[0] (r1).trays: a gb200-nvl72 rack holds 1 to 18",
            id="trays-zero",
        ),
        pytest.param(
            _rack("system: gb200-nvl72, trays: 4, degraded: [5]"),
            "racks[0] (r1).degraded: degraded trays [5] are not among the rack's trays 1-4",
            id="degraded-tray-outside",
        ),
        pytest.param(
            _rack("system: gb300-nvl72, gpusInUse: {19: [0]}"),
            "racks[0] (r1).gpusInUse: in-use trays [19] are not among the rack's trays 1-18",
            id="in-use-tray-outside",
        ),
        pytest.param(
            _rack("system: gb300-nvl72, gpusInUse: {2: [4]}"),
            "racks[0] (r1).gpusInUse: tray 2: [4] out of range for 4 GPUs",
            id="in-use-gpu-outside",
        ),
        pytest.param(_rack("system: gb200-nvl72, color: red"), "racks[0] (r1).color: Extra inputs", id="unknown-field"),
        pytest.param(
            "racks:\n  - {name: R_1, system: gb200-nvl72}\n", "racks[0] (R_1).name: String should match", id="name"
        ),
        pytest.param(
            "nodes:\n  - {name: r1-tray-07, fixture: gb200-tray}\n" + _rack("system: gb200-nvl72"),
            "racks[0] (r1).name: tray node 'r1-tray-07' is also nodes[0]",
            id="tray-name-taken-by-a-node",
        ),
        pytest.param(
            "racks:\n  - {name: r1, system: gb200-nvl72}\n  - {name: r1, system: gb300-nvl72, trays: 2}\n",
            "racks[1] (r1).name: tray node 'r1-tray-01' is also racks[0] (r1)",
            id="rack-name-twice",
        ),
    ],
)
def test_bad_rack_entries_name_file_rack_and_field(tmp_path: Path, text: str, fragment: str) -> None:
    p = write(tmp_path, "c.yaml", text)
    with pytest.raises(ClusterFileError) as err:
        load_cluster(p)
    assert str(err.value).startswith(f"{p}: ")
    assert fragment in str(err.value)


# Mostly valid entries, so that loads succeed as well as fail.
_RACK_ENTRIES = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["r1", "r-2", "r1-tray-01", "r.3", "R_1", ""]),
        "system": st.sampled_from([*RACKS, *RACKS, "gb200-tray", 7]),
    },
    optional={
        "trays": st.one_of(st.integers(-1, 20), st.sampled_from([None, "x"])),
        "labels": st.one_of(
            st.dictionaries(st.sampled_from(["a", "b/c"]), st.text(max_size=4), max_size=2), st.just(1)
        ),
        "degraded": st.one_of(st.lists(st.integers(-1, 20), max_size=3), st.just("x")),
        "gpusInUse": st.one_of(
            st.dictionaries(st.integers(-1, 20), st.lists(st.integers(-1, 5), max_size=3), max_size=2), st.none()
        ),
    },
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(racks=st.lists(_RACK_ENTRIES, max_size=3), with_node=st.booleans())
def test_any_racks_list_loads_into_one_domain_per_rack_or_is_an_error_naming_the_file(
    tmp_path: Path, racks: list[dict[str, Any]], with_node: bool
) -> None:
    p = tmp_path / "c.yaml"
    nodes = [{"name": "r1-tray-01", "fixture": "gb200-tray"}] if with_node else []
    p.write_text(yaml.safe_dump({"nodes": nodes, "racks": racks}))
    try:
        spec = load_cluster(p)
    except ClusterFileError as e:
        assert str(e).startswith(f"{p}: ")
        return
    states = cluster_states(spec)
    assert len({n.name for n in states}) == len(states) == len(nodes) + sum(r.get("trays") or 18 for r in racks)
    trays = states[len(nodes) :]
    assert {n.location["nvlink-domain"] for n in trays} == {rack_clique(r["name"]) for r in racks}


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
