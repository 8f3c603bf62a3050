"""The default tiers read every topology labeler's keys (docs/configuration.md, "Topology labelers"): a node
labelled by any one of them lands under the right switch of each tier, gputopo's own keys win over the
labelers', and keys no tier reads change nothing."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.state.snapshot import locate
from gputopo.model.jobs import tier_of_label
from gputopo.tiers import DEFAULT_TIERS, Tier, TierConfig
from tests.paths import REPO

EKS = "topology.k8s.aws/network-node-layer-"

NONE = {"spine": None, "leaf": None, "nvlink-domain": None}


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        pytest.param(
            {"fabric.topograph.run/tier-1": "sw1", "fabric.topograph.run/tier-2": "sw2",
             "fabric.topograph.run/tier-3": "sw3", "accelerator.topograph.run/domain": "nvl72-a"},
            {"spine": "sw2", "leaf": "sw1", "nvlink-domain": "nvl72-a"},
            id="topograph-1.0-closest-first-tier-3-unread",
        ),
        pytest.param(
            {"accelerator.topograph.run/domain": "nvl72-a", "accelerator.topograph.run/sub-domain": "part-2"},
            {**NONE, "nvlink-domain": "part-2"},
            id="topograph-1.0-partition-before-domain",
        ),
        pytest.param(
            {"network.topology.nvidia.com/spine": "s", "network.topology.nvidia.com/leaf": "l",
             "network.topology.nvidia.com/core": "c", "network.topology.nvidia.com/accelerator": "a"},
            {"spine": "s", "leaf": "l", "nvlink-domain": "a"},
            id="topograph-before-1.0",
        ),
        pytest.param(
            {f"{EKS}1": "nn-1", f"{EKS}2": "nn-2", f"{EKS}3": "nn-3"},
            {**NONE, "spine": "nn-2", "leaf": "nn-3"},
            id="eks-3-layers-leaf-is-layer-3",
        ),
        pytest.param(
            {f"{EKS}1": "nn-1", f"{EKS}2": "nn-2", f"{EKS}3": "nn-3", f"{EKS}4": "nn-4"},
            {**NONE, "spine": "nn-3", "leaf": "nn-4"},
            id="eks-4-layers-leaf-is-layer-4-spine-layer-3",
        ),
        pytest.param(
            {"cloud.google.com/gce-topology-block": "b", "cloud.google.com/gce-topology-subblock": "sb",
             "cloud.google.com/gce-topology-host": "h"},
            {**NONE, "spine": "b", "leaf": "sb"},
            id="gke-host-is-the-node",
        ),
        pytest.param(
            {"topology.nebius.com/tier-0": "nvl", "topology.nebius.com/tier-1": "rack",
             "topology.nebius.com/tier-2": "spine", "topology.nebius.com/gpu-cluster-id": "gc"},
            {"spine": "spine", "leaf": "rack", "nvlink-domain": "nvl"},
            id="nebius",
        ),
        pytest.param({"ds.coreweave.com/nvlink.domain": "rack-7"}, {**NONE, "nvlink-domain": "rack-7"}, id="coreweave"),
        pytest.param({"nvidia.com/gpu.clique": "uuid.1"}, {**NONE, "nvlink-domain": "uuid.1"}, id="gfd-clique"),
        pytest.param(
            {"gputopo.io/network-spine": "own-s", "gputopo.io/network-leaf": "own-l",
             "network.topology.nvidia.com/spine": "old-s", "network.topology.nvidia.com/leaf": "old-l",
             "fabric.topograph.run/tier-2": "new-s", "fabric.topograph.run/tier-1": "new-l",
             "nvidia.com/gpu.clique": "clique", "accelerator.topograph.run/domain": "domain"},
            {"spine": "own-s", "leaf": "own-l", "nvlink-domain": "clique"},
            id="own-keys-win-over-old-and-new",
        ),
        pytest.param(
            {"network.topology.nvidia.com/leaf": "old-l", "fabric.topograph.run/tier-1": "new-l",
             "fabric.topograph.run/tier-2": "new-s"},
            {**NONE, "spine": "new-s", "leaf": "old-l"},
            id="old-topograph-keys-before-new-per-tier",
        ),
        pytest.param({f"{EKS}3": "nn-3", f"{EKS}4": ""}, {**NONE, "leaf": "nn-3"}, id="empty-layer-4-is-absent"),
        pytest.param(
            {"example.com/rack": "r", "kubernetes.io/hostname": "n1", "fabric.topograph.run/tier-9": "x"},
            NONE,
            id="unknown-keys-ignored",
        ),
    ],
)  # fmt: skip
def test_a_node_labelled_by_one_labeler_lands_under_its_switches(
    labels: dict[str, str], expected: dict[str, str | None]
) -> None:
    assert DEFAULT_TIERS.locate(labels) == expected


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        pytest.param({f"{EKS}2": "b", f"{EKS}3": "c"}, {"spine": "b", "leaf": "b/c"}, id="eks-3-layers"),
        pytest.param({f"{EKS}3": "c", f"{EKS}4": "d"}, {"spine": "c", "leaf": "c/d"}, id="eks-4-layers"),
        pytest.param({"fabric.topograph.run/tier-1": "l"}, {"spine": None, "leaf": "l"}, id="leaf-only"),
    ],
)
def test_a_leaf_is_qualified_by_the_spine_the_same_labeler_names(
    labels: dict[str, str], expected: dict[str, str | None]
) -> None:
    got = locate(labels, None, DEFAULT_TIERS)
    assert {t: got[t] for t in ("spine", "leaf")} == expected


@pytest.mark.parametrize(
    ("key", "tier"),
    [
        (f"{EKS}3", "leaf"),  # the spine's only on 4-layer nodes: the narrower holds on every node
        (f"{EKS}4", "leaf"),
        (f"{EKS}2", "spine"),
        (f"{EKS}1", None),
        ("fabric.topograph.run/tier-1", "leaf"),
        ("fabric.topograph.run/tier-2", "spine"),
        ("topology.nebius.com/tier-0", "nvlink-domain"),
        ("ds.coreweave.com/nvlink.domain", "nvlink-domain"),
    ],
)
def test_a_topology_key_names_the_narrowest_tier_that_reads_it(key: str, tier: str | None) -> None:
    assert tier_of_label([(t.name, t.labels) for t in DEFAULT_TIERS.tiers], key) == tier


def test_only_with_round_trips_through_the_json_setting_and_keeps_tiers_hashable() -> None:
    again = TierConfig.model_validate_json(DEFAULT_TIERS.model_dump_json())
    assert again == DEFAULT_TIERS and hash(again) == hash(DEFAULT_TIERS)
    custom = TierConfig(tiers=(Tier(name="rack", labels=("a", "b"), only_with={"a": "c"}),))
    assert [custom.switch_of(x, "rack") for x in ({"a": "1", "b": "2"}, {"a": "1", "c": "3"})] == ["2", "1"]


def test_the_labeler_table_in_the_docs_lists_each_tiers_keys_in_the_order_they_are_read() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    section = doc.split("### Topology labelers", 1)[1].split("\n#", 1)[0]
    documented: dict[str, list[str]] = {name: [] for name in DEFAULT_TIERS.names}
    for row in re.findall(r"^\|[^|]*\| `([^`]+)`[^|]*\| `([a-z-]+)` \|$", section, re.MULTILINE):
        documented[row[1]].append(row[0])
    assert documented == {t.name: list(t.labels) for t in DEFAULT_TIERS.tiers}


KEYS = st.sampled_from(
    [key for t in DEFAULT_TIERS.tiers for key in t.labels] + [f"{EKS}1", "x/y", "", "fabric.topograph.run/tier-3"]
)


@settings(max_examples=300, deadline=None)
@given(labels=st.dictionaries(st.one_of(KEYS, st.text(max_size=20)), st.text(max_size=20), max_size=12))
def test_locate_never_raises_and_names_only_values_of_present_keys(labels: dict[str, str]) -> None:
    flat = DEFAULT_TIERS.locate(labels)
    assert set(flat) == set(DEFAULT_TIERS.names)
    assert all(v is None or v in labels.values() for v in flat.values())
    qualified = locate(labels, None, DEFAULT_TIERS)
    assert {t: v is None for t, v in qualified.items()} == {t: v is None for t, v in flat.items()}
