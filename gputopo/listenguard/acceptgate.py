"""The accept loop of the listeners reachable from the pod network (`Gate`): every connection is counted against
a listener's connection limits, in all and per client address (`Slots`, with fair room across addresses), at
accept, before any byte is read, and over TLS its handshake runs here under the handshake timeout, paced per
address (`HandshakePace`) and over all addresses (`HandshakeTurns`). asyncio's own server-side TLS counted a
connection only once its handshake was done and gave the handshake 60 s, so silent connections held file
descriptors and memory past every bound.

`Slots` holds any connection that can say whether it may be closed and close itself (`Held`): the agent's
threaded /metrics server counts its connections with it too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

# Addresses whose handshake pace is remembered; past this, the ones back at a full burst are forgotten.
_MAX_PACED_PEERS = 4096
# Addresses that presented the API server's certificate, remembered for their next handshakes (its replicas).
_MAX_TRUSTED_PEERS = 64

log = logging.getLogger("gputopo.listenguard")


class Limits(Protocol):
    """What a listener allows (the extender's `ListenerLimits` has these and more)."""

    @property
    def max_connections(self) -> int: ...  # open at once, counted from the accept

    @property
    def max_connections_per_peer(self) -> int: ...  # of one client address

    @property
    def handshake_timeout_s(self) -> float: ...  # a TLS handshake, from the accept

    @property
    def handshakes_per_peer_per_s(self) -> float: ...  # TLS handshakes one address starts; 0: any

    @property
    def handshakes_per_s(self) -> float: ...  # TLS handshakes the listener starts, all addresses; 0: any


class Full(enum.Enum):
    """Why a connection found no room: the listener holds its limit, or the connection's address holds its own."""

    LISTENER = "listener"
    PEER = "peer"


class Held(Protocol):
    """A connection `Slots` counts: its address, whether it may be closed to make room for another address,
    and how it is closed then (after `Slots` has given its place to the newcomer)."""

    @property
    def peer(self) -> str: ...

    def evictable(self) -> bool: ...

    def evict(self) -> None: ...


class Released(Protocol):
    """A connection's protocol that calls `on_lost` once the connection ends (`BoundedHttpTools`), and says
    whether it may be closed to make room for another address (`Slot.evictable`)."""

    on_lost: Callable[[], None] | None
    slot: Slot | None

    def answering(self) -> bool:
        """A whole request is in and its answer is not yet written out."""
        ...

    def evict(self) -> None: ...


class Slots:
    """The connections one listener holds, in all and per client address, each from its accept to its
    close (whether its handshake succeeds, fails or times out); and the bytes they read, counted for the
    tests and the benchmark. Used on one event loop, or under one lock: no lock of its own.

    When the listener is full, a connection from an address holding fewer connections than the address that
    holds the most takes the place of that address's oldest connection that is not being answered and not the
    API server's (`Slot.evictable`): a few addresses cannot fill the listener against everyone else (the
    kubelet's probes, the API server, Prometheus), and who holds the most pays first. Among many addresses
    holding one each, a newcomer takes the oldest one's place: a probe, the newest and answered within its
    first read, is the last to be chosen, and once its request is in it cannot be."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = 0
        self.per_peer: collections.Counter[str] = collections.Counter()
        self.handshakes: set[asyncio.Task[None]] = set()  # held here: the loop keeps only weak references
        self.open: dict[Held, None] = {}  # held connections, oldest first
        self.bytes_received = 0  # every byte the listener's connections handed the parser
        self.body_bytes = 0  # of those, request body bytes
        self.evicted = 0
        self.accepted = 0  # connections counted in, ever
        self.on_idle: Callable[[], None] | None = None  # once no connection is held (`ListenerServer`: a trim)

    def take(self, peer: str) -> Full | None:
        """Count a connection from `peer`, making room as the class doc says; or why it does not fit
        (nothing counted). The caller then holds it (`hold`) or gives it back (`release`)."""
        if self.per_peer[peer] >= self.limits.max_connections_per_peer:
            return Full.PEER
        if self.total >= self.limits.max_connections and not self._make_room(peer):
            return Full.LISTENER
        self.total += 1
        self.per_peer[peer] += 1
        self.accepted += 1
        return None

    def _make_room(self, peer: str) -> bool:
        mine = self.per_peer[peer]
        victim: Held | None = None
        most = mine  # only an address holding more than `peer` gives way: ties go to the newcomer's turn
        for slot in self.open:  # oldest first: the first of the heaviest address is its oldest
            held = self.per_peer[slot.peer]
            if held > most and slot.evictable():
                victim, most = slot, held
        if victim is None:
            return False
        self.evicted += 1
        victim.evict()
        return True

    def hold(self, held: Held) -> None:
        """`held`, counted by `take`, may now be evicted (newest last)."""
        self.open[held] = None

    def drop(self, held: Held) -> None:
        """Give `held`'s place back (once: the caller keeps track)."""
        self.open.pop(held, None)
        self.release(held.peer)

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_peer[peer] -= 1
        if not self.per_peer[peer]:
            del self.per_peer[peer]
        if self.on_idle is not None and self.total == 0:
            self.on_idle()


class HandshakePace:
    """A token bucket per client address for starting TLS handshakes: `rate` a second, bursts of `rate`
    (at least one).

    `delay(peer)` reserves the address's next start and says how long its connection waits for it (0: at
    once), or None when that wait would not end within `within_s` (the connection is then closed before its
    handshake). A waiting connection keeps its slot and its handshake timeout runs from the accept, so a
    flood from one address is bounded in connections (`Slots`) and in handshake CPU (here), while other
    addresses, the API server's, start theirs at once."""

    def __init__(self, rate: float, within_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.within_s = within_s
        self.clock = clock
        self._peers: dict[str, tuple[float, float]] = {}  # peer -> (tokens, when counted); tokens may go below 0

    def delay(self, peer: str) -> float | None:
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        burst = max(1.0, self.rate)
        tokens, then = self._peers.get(peer, (burst, now))
        tokens = min(burst, tokens + (now - then) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        if wait >= self.within_s:
            self._peers[peer] = (tokens, now)
            return None
        if len(self._peers) >= _MAX_PACED_PEERS and peer not in self._peers:
            self._forget_rested(now)
        self._peers[peer] = (tokens - 1, now)
        return wait

    def _forget_rested(self, now: float) -> None:
        burst = max(1.0, self.rate)
        rested = [p for p, (t, then) in self._peers.items() if t + (now - then) * self.rate >= burst]
        for p in rested:
            del self._peers[p]


class HandshakeTurns:
    """The TLS handshakes a listener starts, over all addresses: at most `rate` a second (bursts of a tenth of
    a second's worth, at least one), taken round-robin across the addresses waiting; 0: no limit.

    A handshake is CPU on the listener's loop, where the connections already set up (the API server's,
    kept alive) are answered: the pace per address (`HandshakePace`) does not bound a flood from many
    addresses, this does. A connection waiting for its turn keeps its slot and its handshake timeout runs
    from the accept; a new address waits one round of the addresses waiting at most. An address that has
    presented the API server's certificate (`trust`, the last `_MAX_TRUSTED_PEERS`) starts its handshakes
    at once, outside the limit: a flood without that certificate delays only first contacts."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.burst = max(1.0, rate / 10)
        self.tokens = self.burst
        self.counted_at = clock()
        self.waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}  # in round order
        self.pump: asyncio.Task[None] | None = None
        self.trusted: dict[str, None] = {}  # oldest first

    def trust(self, peer: str) -> None:
        self.trusted.pop(peer, None)
        self.trusted[peer] = None
        if len(self.trusted) > _MAX_TRUSTED_PEERS:
            del self.trusted[next(iter(self.trusted))]

    async def turn(self, peer: str) -> None:
        """Return once `peer`'s connection may start its handshake (cancel it to leave the queue)."""
        if self.rate <= 0 or peer in self.trusted or (not self.waiting and self._take()):
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.waiting.setdefault(peer, collections.deque()).append(future)
        if self.pump is None:
            self.pump = loop.create_task(self._pump())
        await future

    def _take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.counted_at) * self.rate)
        self.counted_at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def _next(self) -> asyncio.Future[None] | None:
        """The next address's oldest waiting connection (that address goes to the back of the round)."""
        while self.waiting:
            peer = next(iter(self.waiting))
            queue = self.waiting.pop(peer)
            future = queue.popleft()
            if queue:
                self.waiting[peer] = queue
            if not future.done():  # else it left: evicted, timed out, or the server stopping
                return future
        return None

    async def _pump(self) -> None:
        try:
            while self.waiting:
                if not self._take():
                    await asyncio.sleep((1 - self.tokens) / self.rate)
                    continue
                future = self._next()
                if future is None:
                    self.tokens += 1  # nobody was left to take it
                    break
                future.set_result(None)
        finally:
            self.pump = None


class Slot:
    """One connection's place in `Slots`, given back once, however the connection ends (or is evicted)."""

    def __init__(self, slots: Slots, peer: str) -> None:
        self.slots = slots
        self.peer = peer
        self.held = True
        self.trusted = False  # the API server's client certificate: never evicted
        self.protocol: Released | None = None  # once the connection is set up (after its TLS handshake)
        self.task: asyncio.Task[None] | None = None  # its setup (pace, handshake) until then
        slots.hold(self)

    def evictable(self) -> bool:
        if self.trusted:
            return False
        return self.protocol is None or not self.protocol.answering()

    def evict(self) -> None:
        """Give the place back now (the newcomer takes it) and close the connection."""
        protocol, task = self.protocol, self.task
        self.release()
        if protocol is not None:
            protocol.evict()
        elif task is not None:
            task.cancel()  # `Gate._connect` closes the socket

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slots.drop(self)


class Gate:
    """The accept loop of the webhook or metrics listener: every connection is counted (`Slots`) as it is
    accepted, before any byte is read.

    One that does not fit is closed at once: over plain TCP after `refuse`'s answer (a 503), over TLS before
    the handshake (an answer would cost the very handshake the refusal spares). The others become transports with
    `loop.connect_accepted_socket` (asyncio and uvloop alike), over TLS with the handshake timeout; the
    protocol made by `make()` gives the slot back when the connection ends (`BoundedHttpTools.on_lost`),
    and a handshake that fails or times out gives it back here. A listening socket read by the loop's own
    server would hand a connection over only after its handshake, and the loop would read its ClientHello
    before a `start_tls` could take it."""

    def __init__(
        self,
        slots: Slots,
        make: Callable[[], Released],
        tls: ssl.SSLContext | None = None,
        refuse: Callable[[Full], bytes] | None = None,
    ) -> None:
        self.slots = slots
        self.make = make
        self.tls = tls
        self.refuse = refuse  # the answer a plain TCP connection gets when it does not fit (else none)
        self.task: asyncio.Task[None] | None = None
        limits = slots.limits
        self.pace = HandshakePace(limits.handshakes_per_peer_per_s, limits.handshake_timeout_s)
        self.turns = HandshakeTurns(limits.handshakes_per_s)

    def start(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.task = asyncio.get_running_loop().create_task(self._accept(sock))

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def wait_closed(self) -> None:
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(sock)
            except OSError as e:  # out of open files: let the connections in hand end first
                log.warning("cannot accept a connection", extra={"error": str(e)})
                await asyncio.sleep(0.1)
                continue
            self._admit(conn, address)

    def _admit(self, conn: socket.socket, address: Any) -> None:
        peer = str(address[0]) if isinstance(address, tuple) and address else "?"
        full = self.slots.take(peer)
        if full is not None:
            if self.tls is None and self.refuse is not None:
                with contextlib.suppress(OSError):  # a few hundred bytes: the socket's buffer takes them
                    conn.send(self.refuse(full))
            conn.close()
            return
        wait = self.pace.delay(peer) if self.tls is not None else 0.0
        if wait is None:  # this address starts handshakes faster than its pace for longer than the timeout
            self.slots.release(peer)
            conn.close()
            return
        slot = Slot(self.slots, peer)
        task = slot.task = asyncio.get_running_loop().create_task(self._connect(conn, slot, wait))
        self.slots.handshakes.add(task)
        task.add_done_callback(self.slots.handshakes.discard)

    async def _connect(self, conn: socket.socket, slot: Slot, wait: float = 0.0) -> None:
        def protocol() -> asyncio.BaseProtocol:
            made = self.make()
            made.on_lost = slot.release
            made.slot = slot
            setup.append(made)
            return cast(asyncio.BaseProtocol, made)  # `Released` names only the part the gate sets

        setup: list[Released] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.slots.limits.handshake_timeout_s  # the handshake's, from the accept
        try:
            if wait > 0:  # its address's handshake pace (HandshakePace)
                await asyncio.sleep(wait)
            if self.tls is not None and self.turns.rate > 0:  # the listener's, all addresses (HandshakeTurns)
                await asyncio.wait_for(self.turns.turn(slot.peer), deadline - loop.time())
            timeout = max(0.001, deadline - loop.time()) if self.tls is not None else None
            await loop.connect_accepted_socket(protocol, conn, ssl=self.tls, ssl_handshake_timeout=timeout)
            if slot.held:  # set up: from now on an eviction closes its transport
                slot.protocol, slot.task = setup[0], None
            if slot.trusted:  # the API server's certificate: its address's next handshakes need no turn
                self.turns.trust(slot.peer)
        except BaseException as e:  # timed out, failed, reset, or the server stopping: the slot is free
            conn.close()
            slot.release()
            if not isinstance(e, Exception):
                raise
            log.debug("connection not set up", extra={"peer": slot.peer, "error": repr(e)})
