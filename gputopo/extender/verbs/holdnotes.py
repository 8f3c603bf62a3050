"""What a refused pod is told of other namespaces' holds, and the GPUs held per namespace (a metric)."""

from __future__ import annotations

from datetime import UTC, datetime

from gputopo.extender.state.ledger import Ledger


def whose_holds(ledger: Ledger, namespace: str, answer: dict[str, str]) -> dict[str, str]:
    """`answer` (node -> why the pod of `namespace` was refused there) with each node on which another
    namespace's group holds GPUs telling whose hold it is and until when (the earliest-expiring such
    group), so a tenant refused for someone else's reservation knows what it waits for."""
    book = ledger.book
    if not book.reservations:
        return answer  # the common case: nothing held anywhere
    timeout = book.timeout
    with ledger.lock:
        held = {n: per for n, per in book.held_on().items() if n in answer}
        for node, per in held.items():
            groups = {k for k, _ in per if k[0] != namespace}
            res = [book.reservations[k] for k in groups if k in book.reservations]
            if not res:
                continue
            first = min(res, key=lambda r: (r.expires(timeout), r.key))
            gpus = sum(len(g) for (k, _), g in per.items() if k == first.key)
            until = datetime.fromtimestamp(first.expires(timeout), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            answer[node] = (
                f"{answer[node]} ({gpus} GPUs here held for group {first.key[0]}/{first.key[1]} until {until})"
            )
    return answer


def held_gpus(ledger: Ledger) -> dict[str, int]:
    """GPUs group reservations hold per namespace, for members not bound yet."""
    with ledger.lock:
        return ledger.book.held_by_namespace()
