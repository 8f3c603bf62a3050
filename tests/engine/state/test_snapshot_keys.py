"""The node-kind key table: racing callers never share a key between two kinds, agree on one key per
kind, and a cleared table never hands out an old key again."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.engine.state import snapshot


class _YieldingDict(dict[tuple[object, ...], int]):
    """The table, giving up the GIL after each lookup: a check-then-store window is then always open."""

    def get(self, key: tuple[object, ...], default: Any = None) -> Any:
        found = super().get(key, default)
        time.sleep(0)
        return found


@pytest.fixture
def fast_switching(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(snapshot, "_KEYS", _YieldingDict())
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("threads", "kinds_per_thread", "shared"),
    [
        pytest.param(8, 500, False, id="distinct-kinds-get-distinct-keys"),
        pytest.param(8, 500, True, id="the-same-kinds-get-one-key-each"),
    ],
)
@pytest.mark.usefixtures("fast_switching")
def test_racing_interns_never_share_a_key_between_kinds(threads: int, kinds_per_thread: int, shared: bool) -> None:
    tag = object()  # tuples no other test interns
    results: list[dict[tuple[object, ...], int]] = [{} for _ in range(threads)]
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(kinds_per_thread):
            parts = (tag, i if shared else (t, i))
            results[t][parts] = snapshot._intern_key(parts)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    merged: dict[tuple[object, ...], set[int]] = {}
    for r in results:
        for parts, key in r.items():
            merged.setdefault(parts, set()).add(key)
    assert all(len(keys) == 1 for keys in merged.values()), "one kind got two keys"
    owners: dict[int, tuple[object, ...]] = {}
    for parts, keys in merged.items():
        (key,) = keys
        assert owners.setdefault(key, parts) == parts, f"key {key} names two kinds"


def test_a_cleared_table_never_reuses_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "MAX_INTERNED", 4)
    monkeypatch.setattr(snapshot, "_KEYS", {})
    tag = object()
    keys = [snapshot._intern_key((tag, i)) for i in range(20)]
    assert len(set(keys)) == 20
    assert len(snapshot._KEYS) <= 4
