"""ComputeDomain facts from their owners: a channel template in another namespace cannot claim a
ComputeDomain's UID (where ComputeDomains are served only the ComputeDomain object names its UID), a node's
driver label is matched against the ComputeDomain that UID is, the tables are bounded per namespace (one
namespace's flood leaves every other namespace's facts read), and bind re-checks the ComputeDomain rules and
a planned group's NVLink domain cap, read again at bind."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import pytest

from gputopo.engine.gang.imex import DRIVER_NODE_LABEL
from gputopo.engine.gang.rack import LABEL_DOMAIN_CAP
from gputopo.extender.settings import Settings
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.computedomains import MAX_PER_NAMESPACE, ChannelTemplates, ComputeDomainSizes
from gputopo.extender.watch.source import Informer
from gputopo.model import HEALTHY_MASK, GpuFabric
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS, TierConfig, TierSet
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, make_env, node_obj
from tests.extender.watch.test_compute_domains import NAMES, TRAYS, cd_pod, compute_domain, template, tray


def labelled(obj: JSON, uid: str) -> JSON:
    obj["metadata"].setdefault("labels", {})[DRIVER_NODE_LABEL] = uid
    return obj


def _no_bad(*_a: Any) -> None:
    raise AssertionError("no object here is unreadable")


@pytest.fixture
def victim(env: Env) -> Env:
    """Team a's ComputeDomain (UID u-a, channel template cd-a in namespace default) runs on tray a1, which
    NVIDIA's driver labelled; team b's ComputeDomain (u-b) is in namespace team-b."""
    env.source.put("resourceclaimtemplates", labelled(template("cd-a"), "u-a"))
    env.source.put("computedomains", compute_domain("a", "cd-a", uid="u-a"))
    env.source.put("resourceclaimtemplates", labelled(template("cd-b", ns="team-b"), "u-b"))
    env.source.put("computedomains", compute_domain("b", "cd-b", ns="team-b", uid="u-b"))
    env.add_nodes(*(tray(n, r) for n, r in TRAYS.items() if n != "a1"), labelled(tray("a1", "rack-a"), "u-a"))
    return env


def test_the_victims_next_pod_joins_its_own_tray_and_domain(victim: Env) -> None:
    """The control: nothing forged, the victim's pod goes to rack a (its ComputeDomain's), a1 included."""
    pod = cd_pod("a-1", 4, "cd-a")
    victim.add_pods(pod)
    assert victim.passed(pod, NAMES) == ["a1", "a2"]


@pytest.mark.parametrize(
    "forged",
    [
        pytest.param(labelled(template("evil", ns="team-b"), "u-a"), id="another namespace's template claims the UID"),
        pytest.param(labelled(template("evil"), "u-a"), id="a second template in the victim's namespace claims it"),
        pytest.param(labelled(template("zzz", ns="team-b"), "u-a"), id="a later name in another namespace"),
    ],
)
def test_a_template_claiming_another_compute_domains_uid_changes_nothing_for_the_victim(
    victim: Env, forged: JSON
) -> None:
    victim.source.put("resourceclaimtemplates", forged)
    victim.resync()
    pod = cd_pod("a-1", 4, "cd-a")
    victim.add_pods(pod)
    assert victim.passed(pod, NAMES) == ["a1", "a2"]  # not sent off its NVLink domain, not refused on a1
    assert victim.cache.channels.compute_domain_of("u-a") == "default/cd-a"


def test_a_node_label_naming_a_uid_no_compute_domain_has_names_no_one(victim: Env) -> None:
    """A tray labelled with a UID no ComputeDomain object has (and a template claims) serves no one's
    ComputeDomain: it pins nobody's pods and refuses every ComputeDomain's pods (one channel per tray)."""
    victim.source.put("resourceclaimtemplates", labelled(template("evil", ns="team-b"), "u-made-up"))
    victim.add_nodes(labelled(tray("b1", "rack-b"), "u-made-up"))
    assert victim.cache.channels.compute_domain_of("u-made-up") is None
    b = cd_pod("b-0", 4, "cd-b")
    b["metadata"]["namespace"] = "team-b"
    victim.add_pods(b)
    assert "b1" not in victim.passed(b, NAMES)


# --------------------------------------------------------------------------------------------------
# where ComputeDomains are not served: a UID claimed from two namespaces names neither


@pytest.mark.parametrize(
    ("claims", "named"),
    [
        pytest.param([("default", "cd-a")], "default/cd-a", id="one template in one namespace"),
        pytest.param([("default", "cd-a"), ("team-b", "evil")], None, id="two namespaces: neither"),
        pytest.param([("default", "cd-a"), ("default", "cd-a2")], "default/cd-a", id="one namespace: the first name"),
    ],
)
def test_without_the_crd_a_uid_is_named_only_by_templates_of_one_namespace(
    claims: list[tuple[str, str]], named: str | None
) -> None:
    owners = ComputeDomainSizes(_no_bad)
    owners.not_served()
    channels = ChannelTemplates(_no_bad, owners=owners)
    channels.replace([labelled(template(name, ns=ns), "u-a") for ns, name in claims])
    assert channels.compute_domain_of("u-a") == named


def test_where_served_only_the_compute_domain_object_names_a_uid() -> None:
    owners = ComputeDomainSizes(_no_bad)
    owners.replace([compute_domain("a", "cd-a", uid="u-a")])
    channels = ChannelTemplates(_no_bad, owners=owners)
    channels.replace([labelled(template("evil", ns="team-b"), "u-a"), labelled(template("evil2", ns="x"), "u-x")])
    assert channels.compute_domain_of("u-a") == "default/cd-a"
    assert channels.compute_domain_of("u-x") is None  # a template's label alone names nothing
    owners.apply("DELETED", compute_domain("a", "cd-a", uid="u-a"))
    assert channels.compute_domain_of("u-a") is None


# --------------------------------------------------------------------------------------------------
# tables bounded per namespace


def test_one_namespaces_flood_of_channel_templates_leaves_other_namespaces_read() -> None:
    channels = ChannelTemplates(_no_bad)
    flood = [template(f"t-{i}", ns="flood") for i in range(MAX_PER_NAMESPACE + 500)]
    channels.replace([*flood, template("cd-a", ns="team-a")])
    assert channels.namespaces_held() == {"flood": MAX_PER_NAMESPACE, "team-a": 1}
    for i in range(MAX_PER_NAMESPACE + 500, MAX_PER_NAMESPACE + 1000):  # more by watch events
        channels.apply("ADDED", template(f"t-{i}", ns="flood"))
    channels.apply("ADDED", template("cd-b", ns="team-b"))
    assert channels("team-a", ("cd-a",)) == ("team-a/cd-a", "")
    assert channels("team-b", ("cd-b",)) == ("team-b/cd-b", "")
    assert channels.namespaces_held() == {"flood": MAX_PER_NAMESPACE, "team-a": 1, "team-b": 1}
    assert len(channels.channels) == MAX_PER_NAMESPACE + 2


def test_deleting_the_flood_frees_its_namespaces_share_and_leaks_nothing() -> None:
    channels = ChannelTemplates(_no_bad, max_per_namespace=8)
    for i in range(20):
        channels.apply("ADDED", labelled(template(f"t-{i}", ns="flood"), f"u-{i}"))
    for i in range(20):
        channels.apply("DELETED", template(f"t-{i}", ns="flood"))
    assert channels.namespaces_held() == {} and channels.channels == set()
    channels.apply("ADDED", template("late", ns="flood"))
    assert channels("flood", ("late",)) == ("flood/late", "")


def test_one_namespaces_flood_of_compute_domains_leaves_other_namespaces_sizes_and_uids() -> None:
    owners = ComputeDomainSizes(_no_bad)
    flood = [compute_domain(f"cd-{i}", f"t-{i}", 2, ns="flood", uid=f"f-{i}") for i in range(MAX_PER_NAMESPACE + 500)]
    owners.replace([*flood, compute_domain("a", "cd-a", 16, ns="team-a", uid="u-a")])
    owners.apply("ADDED", compute_domain("b", "cd-b", 4, ns="team-b", uid="u-b"))
    assert owners.namespaces_held() == {"flood": MAX_PER_NAMESPACE, "team-a": 1, "team-b": 1}
    assert owners.num_nodes("team-a/cd-a") == 16 and owners.num_nodes("team-b/cd-b") == 4
    assert owners.named("u-a") == "team-a/cd-a" and owners.named("u-b") == "team-b/cd-b"


def test_a_flood_through_the_informer_leaves_the_victims_pod_its_compute_domain(victim: Env) -> None:
    for i in range(MAX_PER_NAMESPACE + 100):
        victim.source.put("resourceclaimtemplates", labelled(template(f"t-{i}", ns="flood"), "u-a"))
    victim.resync()
    assert victim.cache.channels.namespaces_held()["flood"] == MAX_PER_NAMESPACE
    pod = cd_pod("a-1", 4, "cd-a")
    victim.add_pods(pod)
    assert victim.passed(pod, NAMES) == ["a1", "a2"]


# --------------------------------------------------------------------------------------------------
# bind re-checks the rules filter applied


def test_a_tray_relabelled_for_another_compute_domain_between_filter_and_bind_is_refused(victim: Env) -> None:
    pod = cd_pod("a-1", 4, "cd-a")
    victim.add_pods(pod)
    assert "a2" in victim.passed(pod, NAMES)
    victim.add_nodes(labelled(tray("a2", "rack-a"), "u-b"))  # the driver gave a2's channel to team b's domain
    victim.source.calls.clear()
    error = victim.bind(pod, "a2")
    assert "no longer fits" in error and "IMEX channel serves another ComputeDomain" in error
    assert not any(c.startswith("bind ") for c in victim.source.calls)  # no Binding sent


def _fabric_tray(name: str, rack: str, cap: str | None = None) -> JSON:
    topo = build_system("gb200-tray", name)
    fabric = GpuFabric(state="completed", health_mask=HEALTHY_MASK)
    topo = topo.model_copy(update={"gpus": tuple(g.model_copy(update={"fabric": fabric}) for g in topo.gpus)})
    node = node_obj(name, None, topology_text=topo.to_annotation(), leaf=f"leaf-{rack}")
    node["metadata"]["labels"]["nvidia.com/gpu.clique"] = rack
    if cap is not None:
        node["metadata"]["labels"][LABEL_DOMAIN_CAP] = cap
    return node


def test_a_domain_cap_lowered_on_every_tray_between_plan_and_bind_refuses_the_bind(env: Env) -> None:
    trays = [f"a-tray-{i}" for i in range(1, 5)]
    env.add_nodes(*[_fabric_tray(t, "a") for t in trays])
    pods = [gputopo_pod(f"tp-{i}", 4, group="tp", group_size="4", stage=str(i), **{"tp-size": "16"}) for i in range(4)]
    env.add_pods(*pods)
    (node,) = env.filter(pods[0], trays)["NodeNames"]
    env.add_nodes(*[_fabric_tray(t, "a", cap="2") for t in trays])  # the operator keeps 2 spares now
    error = env.bind(pods[0], node)
    assert "cap is now 2 trays" in error and "plan takes 4 there" in error


def test_one_tray_lowering_its_own_cap_label_between_plan_and_bind_changes_nothing(env: Env) -> None:
    """The control: a cap only counts where all of the domain's trays agree; one tray's label is not it."""
    trays = [f"a-tray-{i}" for i in range(1, 5)]
    env.add_nodes(*[_fabric_tray(t, "a") for t in trays])
    pods = [gputopo_pod(f"tp-{i}", 4, group="tp", group_size="4", stage=str(i), **{"tp-size": "16"}) for i in range(4)]
    env.add_pods(*pods)
    (node,) = env.filter(pods[0], trays)["NodeNames"]
    env.add_nodes(_fabric_tray(trays[-1], "a", cap="1"))
    assert env.bind(pods[0], node) == ""


# --------------------------------------------------------------------------------------------------
# a planned group member: its plan's node and tier set, read again at bind


def _pooled(name: str, pool: str) -> JSON:
    node = node_obj(name)
    node["metadata"]["labels"]["example.com/pool"] = pool
    return node


def _sets_env() -> AbstractContextManager[Env]:
    sets = tuple(TierSet(name=p, match={"example.com/pool": p}, tiers=DEFAULT_TIERS.tiers) for p in ("a", "b"))
    settings = Settings(
        namespace=NS, stale_after_seconds=120, reservation_timeout_seconds=120, tiers=TierConfig(sets=sets)
    )
    return make_env(FakeSource(NS), FakeClock(), settings)


def _gang() -> list[JSON]:
    return [gputopo_pod(f"g-{i}", 8, group="g", group_size="2", stage=str(i)) for i in range(2)]


def test_a_member_bound_to_another_node_than_its_plan_is_refused_naming_the_planned_one(env: Env) -> None:
    nodes = ["n1", "n2", "n3"]
    env.add_nodes(*(node_obj(n) for n in nodes))
    pods = _gang()
    env.add_pods(*pods)
    (planned,) = env.filter(pods[0], nodes)["NodeNames"]
    other = next(n for n in nodes if n != planned and n not in env.filter(pods[1], nodes)["NodeNames"])
    error = env.bind(pods[0], other)
    assert f"planned this member on node {planned}" in error


def test_a_node_moved_to_another_tier_set_between_plan_and_bind_is_refused() -> None:
    with _sets_env() as env:
        env.add_nodes(*(_pooled(n, "a") for n in ("n1", "n2")), _pooled("n3", "b"))
        pods = _gang()
        env.add_pods(*pods)
        (planned,) = env.filter(pods[0], ["n1", "n2", "n3"])["NodeNames"]
        assert planned in ("n1", "n2")
        env.add_nodes(_pooled(planned, "b"))  # relabelled into the other hardware shape's set
        error = env.bind(pods[0], planned)
        assert "now in tier set b" in error and "planned in tier set a" in error


def test_the_informer_tells_the_table_when_compute_domains_are_not_served() -> None:
    """Where NVIDIA's CRD is absent (the list answers 404), the templates' labels are read instead, and a UID
    two namespaces' templates claim names neither; once the CRD is served, only ComputeDomain objects name."""
    source, cache = FakeSource(NS), ClusterCache()
    source.not_served.add("computedomains")
    source.put("resourceclaimtemplates", labelled(template("cd-a"), "u-a"))
    for kind in ("resourceclaimtemplates", "computedomains"):
        Informer(source, kind, cache, not_served_recheck_seconds=0).relist()
    assert not cache.compute_domain_sizes.served
    assert cache.channels.compute_domain_of("u-a") == "default/cd-a"
    source.put("resourceclaimtemplates", labelled(template("evil", ns="team-b"), "u-a"))
    Informer(source, "resourceclaimtemplates", cache).relist()
    assert cache.channels.compute_domain_of("u-a") is None
    source.not_served.clear()
    Informer(source, "computedomains", cache).relist()  # served now, and no ComputeDomain has u-a
    assert cache.compute_domain_sizes.served and cache.channels.compute_domain_of("u-a") is None
