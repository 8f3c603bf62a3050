"""The pods filter calls carried moments ago, for the bind that follows (saves a GET per bind)."""

from __future__ import annotations

import collections
import threading

from gputopo.extender.wire import PodInfo


class RecentPods:
    """Pods as their filter call carried them moments ago (saves a GET per bind). Bounded in count and
    in bytes of annotations, since filter bodies carry whatever the pod's author wrote."""

    MAX_PODS = 4096
    MAX_BYTES = 64 * 1024 * 1024

    def __init__(self) -> None:
        self._pods: collections.OrderedDict[str, tuple[PodInfo, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pods)

    def remember(self, info: PodInfo) -> None:
        size = sum(len(k) + len(v) for k, v in info.annotations.items()) + 256
        with self._lock:
            for key in (info.uid, info.ref):
                if key:
                    old = self._pods.pop(key, None)
                    self._bytes += size - (old[1] if old else 0)
                    self._pods[key] = (info, size)
            while self._pods and (len(self._pods) > self.MAX_PODS or self._bytes > self.MAX_BYTES):
                self._bytes -= self._pods.popitem(last=False)[1][1]

    def recall(self, uid: str, ref: str) -> PodInfo | None:
        with self._lock:
            hit = self._pods.get(uid) if uid else self._pods.get(ref)
        info = hit[0] if hit is not None else None
        return info if info is not None and (not uid or info.uid == uid) else None
