"""A big gang's members cost the extender the same whatever the gang's size: a member's filter, prioritize and
bind read no view of every other member (bench/gang_member_cost.py measures the CPU). The counts a filter
reads instead (`gputopo.extender.state.podindex.GroupTally`) and the reservation's count of unbound slots are
checked against what they stand for, over any sequence of writes."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.gang.replan import Slot
from gputopo.extender.settings import Settings
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.podindex import PodTable
from gputopo.extender.state.records import PodRecord
from gputopo.extender.state.reservations import Reservation, ReservationBook
from gputopo.extender.verbs import gangs
from gputopo.model import SCHEDULER_NAME, InferredGroup, PodRequest
from gputopo.model import jobs as J
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, FakeClock, make_env, node_obj, pod_obj

GANG_NS = "train"


def _member(index: int) -> JSON:
    pod = pod_obj(f"big-{index}", 8, namespace=GANG_NS)
    pod["metadata"]["labels"] = {J.JOB_NAME: "big", J.JOB_COMPLETION_INDEX: str(index)}
    return pod


def _job(size: int, active: int = 0) -> JSON:
    return {
        "metadata": {"name": "big", "namespace": GANG_NS, "uid": "uid-job-big"},
        "spec": {"completions": size, "parallelism": size, "completionMode": "Indexed"},
        "status": {"active": active},
    }


@pytest.fixture
def counted_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Member records the group desk reads: the group's members listed, and views made of them."""
    reads: Counter[str] = Counter()
    members, view = Ledger.group_members, gangs.member_view

    def group_members(self: Ledger, key: tuple[str, str]) -> list[PodRecord]:
        out = members(self, key)
        reads["listed"] += len(out)
        return out

    def member_view(rec: PodRecord) -> Any:
        reads["viewed"] += 1
        return view(rec)

    monkeypatch.setattr(Ledger, "group_members", group_members)
    monkeypatch.setattr(gangs, "member_view", member_view)
    yield reads


@pytest.mark.parametrize("size", [8, 48])
def test_a_members_verbs_read_no_other_member_but_once_a_gang(size: int, counted_reads: Counter[str]) -> None:
    settings = Settings(namespace=NS, stale_after_seconds=1e9, reservation_timeout_seconds=1e9)
    with make_env(FakeSource(NS), FakeClock(), settings) as env:
        names = [f"gpu-{i:02d}" for i in range(size)]
        env.add_nodes(*(node_obj(n, leaf=f"leaf-{i // 16}", spine="s1") for i, n in enumerate(names)))
        env.source.put("jobs", _job(size))
        env.resync()
        for i in range(size - 1):  # each pod as it arrives, and its first filter: it waits for the others
            pod = env.source.put("pods", _member(i))
            env.cache.apply("pods", "ADDED", pod)
            assert env.filter(pod, names)["NodeNames"] == []
        assert counted_reads.total() == 0, "a member's filter while its gang arrives read the members"
        last = env.source.put("pods", _member(size - 1))
        env.cache.apply("pods", "ADDED", last)
        env.filter(last, names)  # the group is planned: every member read once
        counted_reads.clear()
        bound = set()
        for i in range(size):
            pod = _member(i)
            (node,) = env.filter(pod, names)["NodeNames"]
            env.prioritize(pod, [node])
            assert env.bind(pod, node) == ""
            stored = env.source.get("pods", GANG_NS, pod["metadata"]["name"])
            env.cache.apply("pods", "MODIFIED", stored or pod)  # what the pod informer hands over
            env.cache.apply("jobs", "MODIFIED", _job(size, active=i + 1))
            bound.add(node)
        assert len(bound) == size
        # Once per gang (the first filter after the plan checks it names the members), not once per call.
        assert counted_reads == Counter(listed=size)


# ------------------------------------------------------------------ the group's counts


@dataclasses.dataclass(frozen=True)
class _Write:
    uid: int
    group: str | None
    stage: int | None
    label: str
    phase: str
    scheduler: str
    bound: bool


_writes = st.lists(
    st.one_of(
        st.builds(
            _Write,
            uid=st.integers(0, 7),
            group=st.sampled_from([None, "g", "h"]),
            stage=st.one_of(st.none(), st.integers(0, 3)),
            label=st.sampled_from(["", J.JOB_COMPLETION_INDEX, J.KUEUE_POD_INDEX]),
            phase=st.sampled_from(["Pending", "Running", "Succeeded"]),
            scheduler=st.sampled_from([SCHEDULER_NAME, SCHEDULER_NAME, "default-scheduler"]),
            bound=st.booleans(),
        ),
        st.integers(0, 7),  # a pod deleted
    ),
    max_size=40,
)


def _record(w: _Write) -> PodRecord:
    inferred = InferredGroup(w.group or "", "Job", "Job labels", 4, w.stage, w.label) if w.label else None
    request = PodRequest(gpus=8, group=w.group, group_size=4, stage=w.stage) if w.group else None
    return PodRecord(
        uid=f"u{w.uid}",
        namespace=NS,
        name=f"pod-{w.uid}",  # a pod's name, by its UID: names never repeat among live pods
        node_name="gpu-1" if w.bound else "",
        phase=w.phase,
        gpus=8,
        group=w.group,
        group_size="4" if w.group else None,
        request=request,
        placement=None,
        inferred=inferred,
        scheduler_name=w.scheduler,
    )


def _clash_of(members: list[PodRecord], name: str, stage: int | None) -> tuple[int, list[str]] | None:
    """The lowest rank two members claim, the asking pod `name` at `stage`: by every member's request."""
    by_name = {r.name: r.request.stage if r.request is not None else None for r in members}
    by_name[name] = stage
    by_rank: dict[int, list[str]] = {}
    for n, s in by_name.items():
        if s is not None:
            by_rank.setdefault(s, []).append(n)
    dup = sorted((r, sorted(ns)) for r, ns in by_rank.items() if len(ns) > 1)
    return dup[0] if dup else None


@settings(max_examples=300, deadline=None)
@given(writes=_writes, asking=st.integers(0, 9), stage=st.one_of(st.none(), st.integers(0, 3)))
def test_a_groups_counts_are_its_members_and_its_version_moves_only_when_they_change(
    writes: list[_Write | int], asking: int, stage: int | None
) -> None:
    table = PodTable()
    before: dict[tuple[str, str], frozenset[tuple[str, str]]] = {}
    versions: dict[tuple[str, str], int] = {}
    seen: set[int] = set()
    for w in writes:
        if isinstance(w, int):
            table.pop(f"u{w}", None)
        else:
            table[f"u{w.uid}"] = _record(w)
        for group in ("g", "h"):
            key = (NS, group)
            members = [
                r for r in table.values() if r.group == group and r.active and r.scheduler_name == SCHEDULER_NAME
            ]
            tally = table.tally(key)
            assert tally.uids == {r.uid for r in members}
            assert sorted(table.members(key), key=lambda r: r.uid) == sorted(members, key=lambda r: r.uid)
            assert tally.names == Counter(r.name for r in members)
            labels = Counter(r.inferred.rank_label for r in members if r.inferred is not None and r.inferred.rank_label)
            assert tally.labels == labels
            assert tally.present(f"pod-{asking}") == len({r.name for r in members} | {f"pod-{asking}"})
            assert tally.clash(f"pod-{asking}", stage) == _clash_of(members, f"pod-{asking}", stage)
            who = frozenset((r.uid, r.name) for r in members)
            if who != before.get(key, frozenset()):
                assert tally.version not in seen if who else tally.version == 0  # a new version, never reused
            else:
                assert tally.version == versions.get(key, 0)  # bound, re-inferred, or nothing: the same members
            seen.add(tally.version or -1)
            before[key], versions[key] = who, tally.version


# ------------------------------------------------------------------ the reservation's count of unbound slots


@given(size=st.integers(2, 12), pins=st.lists(st.integers(0, 11), max_size=20))
def test_a_reservation_waits_while_a_slot_is_unbound_whatever_the_order_of_binds(size: int, pins: list[int]) -> None:
    book = ReservationBook(timeout_seconds=60)
    key = (NS, "g")
    # m0 was bound before the plan was made: pinned from the start
    slots = {f"m{i}": Slot(f"m{i}", f"gpu-{i}", frozenset({0}), i, i == 0) for i in range(size)}
    res = Reservation(key, 0.0, slots)
    book.put(res)
    for p in pins:
        book.pin(key, f"m{p % size}")
        assert res.waiting == any(not s.pinned for s in res.slots.values())
        assert res.unpinned == sum(not s.pinned for s in res.slots.values())
        assert (key in book.reservations) == res.waiting
        assert book.next_expiry == (60.0 if res.waiting else float("inf"))
