"""Whether this replica's kube-scheduler leads: it holds kube-scheduler's leader election Lease.

The extender runs beside each kube-scheduler replica (a sidecar: one pod, one hostname). kube-scheduler
names itself in the Lease's `spec.holderIdentity` as `<hostname>_<uuid>`, so the replica whose hostname
prefixes the holder is the leader's, while the holder renews the Lease within its `leaseDurationSeconds`.
A renewal counts from its `renewTime` or from when this replica first saw it, whichever is earlier (client-go's
election counts from the latter alone): a renewTime ahead of this clock holds no longer than one seen now.
What only the leader should do (lifting gputopo's scheduling gates, gputopo.extender.verbs.groupgates)
asks `Leadership.leading()`. Without leader election (no Lease named) every replica leads: there is one.

Two replicas on one host (the local control plane's processes) share the hostname: both lead, as they would
without this check (a standby's lift is then refused by its JSON patch's `test`, at the cost of a write).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

MAX_HOLDER = 1024  # characters of holderIdentity read: kube-scheduler's is a hostname (<= 253) and a UUID
MAX_LEASE_SECONDS = 86400  # leaseDurationSeconds read at most (kube-scheduler's default is 15)


@dataclass(frozen=True)
class LeaseHold:
    """What a leader election Lease says: who holds it (`holder`, "" when no one), when it was last renewed
    (epoch seconds, None when unreadable) and for how long a renewal holds (`duration`, seconds)."""

    holder: str
    renewed: float | None
    duration: float


class Leadership:
    """The leader Lease as the watch last delivered it (`put`) and whether this replica leads by it."""

    def __init__(self, lease: str, identity: str, clock: Callable[[], float]) -> None:
        self.lease = lease  # the Lease's name in the watched namespace; "": no election
        self.identity = identity  # this pod's hostname, the prefix of its kube-scheduler's holderIdentity
        self.clock = clock
        self.hold: LeaseHold | None = None
        self.seen = 0.0  # when `hold` was first delivered as it is (a relist of the same Lease is no renewal)

    def put(self, hold: LeaseHold | None) -> None:
        """The Lease as listed or watched; None: deleted (or not listed)."""
        if hold != self.hold:
            self.seen = self.clock()
        self.hold = hold

    def leading(self) -> bool:
        if not self.lease:
            return True
        h = self.hold
        if h is None or h.renewed is None or not self.identity or not math.isfinite(h.duration):
            return False
        if h.holder != self.identity and not h.holder.startswith(f"{self.identity}_"):
            return False
        return self.clock() <= min(h.renewed, self.seen) + h.duration
