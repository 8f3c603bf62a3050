"""GetPreferredAllocation: find the pod being admitted and answer with its gputopo placement.

The kubelet's request names no pod, only the available devices, the ones that must be included and a
size. It admits pods one at a time, in the order they reached it (oldest first among pods that reached
it together), and asks per container (init containers first). Before it admits a pod it adds it to the
pods its PodResources `List` reports, and it has not added the pods it has not reached yet. So the pod
being admitted is, among the pending pods the kubelet lists, the oldest with an unanswered request of
that size whose placed GPUs are all available and hold every must-include device. Without the
kubelet's list (PodResources unreachable) the search runs over every pending local pod, which guesses
wrong only when the kubelet reached a younger pod first:

- a pod's requests are its app containers' slices of the placement, in container order (container
  `k` gets the next `n_k` placed GPUs), plus, for init containers which the pod view does not list,
  a prefix of the placement of any other size while no app container has been answered yet;
- every answer is remembered as a promise (pod, slice) and not handed out again, and neither is a
  container the kubelet lists as holding devices already; Allocate confirms which devices went out;
  promises of pods that left the view are forgotten;
- when no pod in the view could be the one (the watch may lag behind the binding), the view is
  refreshed once and the search repeated;
- no candidate (no placement, its GPUs taken, or `besteffort` mode): go-gpuallocator's besteffort
  policy over the available GPUs, as NVIDIA's plugin would answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gputopo.agent.pods import LocalPod, LocalPods
from gputopo.engine.node.besteffort import best_effort
from gputopo.model import NodeTopology

log = logging.getLogger(__name__)

# Phases in which a pod can still be in admission; a Running pod was admitted long ago.
ADMITTABLE_PHASES = ("Pending", "")


BESTEFFORT_ANSWER = "besteffort"


class PreferredAllocation(StrEnum):
    PLACEMENT = "placement"
    BESTEFFORT = "besteffort"


class AllocationRequestError(ValueError):
    """A request no answer can satisfy (size larger than available, must-include not available)."""


BestEffort = Callable[[NodeTopology, Sequence[int], Sequence[int], int], tuple[int, ...]]

# (namespace, name) → names of its containers already holding devices, for every pod the kubelet holds.
KubeletHolds = Mapping[tuple[str, str], frozenset[str]]


class KubeletPods(Protocol):
    def kubelet_pods(self) -> KubeletHolds:
        """The kubelet's PodResources `List`; raises when it cannot be read."""
        ...


@dataclass(frozen=True)
class Slice:
    key: str  # "c:<container>" for an app container, "p:<n>" for an init container's prefix
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Answer:
    device_ids: tuple[str, ...]
    pod: str | None  # namespace/name when a placement answered, None for best effort
    source: str  # "placement" or "besteffort"


def pod_slices(pod: LocalPod) -> list[Slice]:
    """Every request of `pod` its placement answers, app containers first; [] if it has no usable placement."""
    if pod.placement is None:
        return []
    gpus = pod.placement.gpus
    if len(gpus) != pod.gpus_requested or len(set(gpus)) != len(gpus):
        return []
    out: list[Slice] = []
    start = 0
    for name, n in pod.container_gpus:
        if start + n > len(gpus):
            return []
        out.append(Slice(f"c:{name}", gpus[start : start + n]))
        start += n
    taken = {s.gpus for s in out}
    out += [Slice(f"p:{n}", gpus[:n]) for n in range(1, len(gpus) + 1) if gpus[:n] not in taken]
    return out


def fallback_answer(available: Sequence[str], must_include: Sequence[str], size: int) -> Answer:
    """Must-include devices first, then the available ones in the kubelet's order."""
    return Answer(tuple(dict.fromkeys([*must_include, *available]))[: max(size, 0)], None, BESTEFFORT_ANSWER)


@dataclass
class _Promise:
    uid: str
    pod: str
    key: str
    devices: frozenset[str]


class Preferrer:
    """Pod identification and the promises it made; thread-safe (gRPC serves on a thread pool)."""

    def __init__(
        self,
        pods: LocalPods,
        mode: PreferredAllocation = PreferredAllocation.PLACEMENT,
        best: BestEffort = best_effort,
        kubelet: KubeletPods | None = None,
    ) -> None:
        self._pods = pods
        self._mode = mode
        self._best = best
        self._kubelet = kubelet
        self._kubelet_failing = False
        self._lock = threading.Lock()
        self._handed: dict[str, set[str]] = {}  # pod uid → slice keys answered (or allocated)
        # The last answer until its Allocate arrives (the kubelet allocates right after asking): the promise
        # it made, BESTEFFORT_ANSWER, or None when nothing was asked.
        self._awaiting: _Promise | str | None = None

    # ------------------------------------------------------------------ GetPreferredAllocation

    def choose(
        self,
        topology: NodeTopology,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
    ) -> Answer:
        avail = list(dict.fromkeys(available))
        must = list(dict.fromkeys(must_include))
        missing = [d for d in must if d not in set(avail)]
        if missing:
            raise AllocationRequestError(f"mustIncludeDeviceIDs {missing} are not in availableDeviceIDs")
        if size < len(must) or size > len(avail):
            raise AllocationRequestError(
                f"allocationSize {size} cannot be met from {len(avail)} available devices"
                f" with {len(must)} that must be included"
            )
        with self._lock:
            if self._mode is PreferredAllocation.PLACEMENT:
                answer = self._from_placement(topology, avail, must, size)
                if answer is not None:
                    return answer
            self._awaiting = BESTEFFORT_ANSWER
            return Answer(self._best_effort(topology, avail, must, size), None, BESTEFFORT_ANSWER)

    def _kubelet_holds(self) -> KubeletHolds | None:
        """The kubelet's pods now, or None (search every pending pod) when it cannot say."""
        if self._kubelet is None:
            return None
        try:
            holds = self._kubelet.kubelet_pods()
        except Exception as e:
            if not self._kubelet_failing:
                log.warning("kubelet PodResources unreadable; guessing the admitted pod", extra={"error": str(e)})
            self._kubelet_failing = True
            return None
        if self._kubelet_failing:
            log.info("kubelet PodResources readable again")
        self._kubelet_failing = False
        return holds

    def _from_placement(self, topology: NodeTopology, avail: list[str], must: list[str], size: int) -> Answer | None:
        holds = self._kubelet_holds()
        for attempt in (0, 1):
            pods = self._pods.pods()
            self._forget_gone(pods)
            found = self._candidate(pods, topology, set(avail), set(must), size, holds)
            if found is not None:
                pod, piece, ids = found
                self._handed.setdefault(pod.uid, set()).add(piece.key)
                self._awaiting = _Promise(pod.uid, pod.ref, piece.key, frozenset(ids))
                log.info(
                    "preferred allocation from the placement",
                    extra={"pod": pod.ref, "request": piece.key, "gpus": list(piece.gpus)},
                )
                return Answer(ids, pod.ref, PreferredAllocation.PLACEMENT.value)
            if attempt == 0 and not any(self._could_be(p, size, holds) for p in pods):
                # No pod in the view could be the one being admitted: the watch lags behind the binding.
                try:
                    self._pods.refresh()
                except Exception as e:
                    log.warning("pod view refresh failed", extra={"error": str(e)})
                    return None
                continue
            return None
        return None

    def _could_be(self, pod: LocalPod, size: int, holds: KubeletHolds | None) -> bool:
        if pod.phase not in ADMITTABLE_PHASES or not 0 < size <= pod.gpus_requested:
            return False
        if holds is not None and (pod.namespace, pod.name) not in holds:
            return False
        answered = self._answered(pod, holds)
        return not (pod.container_gpus and all(f"c:{name}" in answered for name, _ in pod.container_gpus))

    def _answered(self, pod: LocalPod, holds: KubeletHolds | None) -> set[str]:
        """Keys of the pod's requests answered: promised here, or holding devices per the kubelet."""
        handed = self._handed.get(pod.uid, set())
        if holds is None:
            return handed
        return handed | {f"c:{name}" for name in holds.get((pod.namespace, pod.name), frozenset())}

    def _candidate(
        self,
        pods: Sequence[LocalPod],
        topology: NodeTopology,
        avail: set[str],
        must: set[str],
        size: int,
        holds: KubeletHolds | None,
    ) -> tuple[LocalPod, Slice, tuple[str, ...]] | None:
        uuids = {g.index: g.uuid for g in topology.gpus}
        best: tuple[LocalPod, Slice, tuple[str, ...]] | None = None
        for pod in pods:
            if pod.phase not in ADMITTABLE_PHASES:
                continue
            if holds is not None and (pod.namespace, pod.name) not in holds:
                continue  # the kubelet has not reached it: it cannot be the one it admits
            handed = self._answered(pod, holds)
            app_started = any(k.startswith("c:") for k in handed)
            for piece in pod_slices(pod):
                if len(piece.gpus) != size or piece.key in handed or (app_started and piece.key.startswith("p:")):
                    continue
                if any(i not in uuids for i in piece.gpus):
                    continue
                ids = tuple(uuids[i] for i in piece.gpus)
                if not set(ids) <= avail or not must <= set(ids):
                    continue
                if best is None or (pod.created, pod.namespace, pod.name) < (
                    best[0].created,
                    best[0].namespace,
                    best[0].name,
                ):
                    best = (pod, piece, ids)
                break  # a pod's requests come in order: its first match is the one being asked
        return best

    def _forget_gone(self, pods: Sequence[LocalPod]) -> None:
        present = {p.uid for p in pods}
        for uid in [u for u in self._handed if u not in present]:
            del self._handed[uid]
        if isinstance(self._awaiting, _Promise) and self._awaiting.uid not in present:
            self._awaiting = None

    def _best_effort(self, topology: NodeTopology, avail: list[str], must: list[str], size: int) -> tuple[str, ...]:
        index = {g.uuid: g.index for g in topology.gpus}
        uuid = {g.index: g.uuid for g in topology.gpus}
        # The kubelet's lists come from a Go map: index order makes the answer repeatable.
        known = sorted(index[d] for d in avail if d in index)
        known_must = sorted(index[d] for d in must if d in index)
        other_must = [d for d in must if d not in index]  # the topology changed under the kubelet
        want = size - len(other_must)
        if want <= len(known):
            try:
                chosen = [uuid[i] for i in self._best(topology, known, known_must, want)]
                ok = len(set(chosen)) == want and set(chosen) <= set(avail)
                if ok and {uuid[i] for i in known_must} <= set(chosen):
                    return (*other_must, *chosen)
                log.error("best-effort allocation gave an unusable answer", extra={"answer": chosen})
            except ValueError as e:
                log.error("best-effort allocation failed", extra={"error": str(e)})
        # Still an answer the kubelet can use: must-include first, then the rest in index order.
        rest = [uuid[i] for i in known] + [d for d in avail if d not in index]
        return tuple(dict.fromkeys([*must, *rest]))[:size]

    # ------------------------------------------------------------------ Allocate

    def allocated(self, topology: NodeTopology, device_ids: Sequence[str]) -> None:
        """Allocate for one container: confirm the answer it follows, or note the request it answered unasked."""
        got = frozenset(device_ids)
        with self._lock:
            awaiting, self._awaiting = self._awaiting, None
            if isinstance(awaiting, _Promise):
                if awaiting.devices != got:
                    # The promise stays used up: the pod's request was answered, just not as preferred.
                    log.warning(
                        "the kubelet allocated other devices than the placement",
                        extra={
                            "pod": awaiting.pod,
                            "request": awaiting.key,
                            "preferred": sorted(awaiting.devices),
                            "allocated": sorted(got),
                        },
                    )
                return
            if awaiting is None and self._mode is PreferredAllocation.PLACEMENT:
                self._note_unasked(topology, got)

    def _note_unasked(self, topology: NodeTopology, got: frozenset[str]) -> None:
        # The kubelet skips GetPreferredAllocation when it has no choice; the request these devices answer
        # exactly, of the oldest pending pod, is then answered and must not be offered again.
        uuids = {g.index: g.uuid for g in topology.gpus}
        holds = self._kubelet_holds()
        for pod in sorted(self._pods.pods(), key=lambda p: (p.created, p.namespace, p.name)):
            if pod.phase not in ADMITTABLE_PHASES:
                continue
            if holds is not None and (pod.namespace, pod.name) not in holds:
                continue
            handed = self._answered(pod, holds)
            for piece in pod_slices(pod):
                if piece.key not in handed and frozenset(uuids.get(i, "") for i in piece.gpus) == got:
                    self._handed.setdefault(pod.uid, set()).add(piece.key)
                    return

    def promised(self) -> dict[str, set[str]]:
        """Pod uid → request keys answered so far (for tests and debugging)."""
        with self._lock:
            return {k: set(v) for k, v in self._handed.items()}
