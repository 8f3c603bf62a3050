"""`HandshakeTurns` (gputopo/listenguard/acceptgate.py): the TLS handshakes a listener starts over all addresses
are given out round-robin across the addresses waiting, a connection that left the queue takes no turn, an
address that presented the API server's certificate starts at once, and a listener without a limit starts
every handshake at once. Order is checked, never timing; every wait is
bounded by WAIT_S."""

from __future__ import annotations

import asyncio

import pytest

from gputopo.listenguard.acceptgate import HandshakeTurns

WAIT_S = 10.0
RATE = 40.0  # bursts of 4, then one every 25 ms: the queue drains in well under WAIT_S


async def _turns(rate: float, arrivals: list[str], leaving: set[int]) -> list[str]:
    """The burst is spent first and "api" is trusted; then `arrivals` (addresses) queue in order, those at
    `leaving` leave before their turn; the order in which the others start."""
    turns = HandshakeTurns(rate)
    turns.trust("api")
    for _ in range(int(turns.burst)):
        await turns.turn("burst")
    started: list[str] = []

    async def one(peer: str) -> None:
        await turns.turn(peer)
        started.append(peer)

    tasks = [asyncio.create_task(one(peer)) for peer in arrivals]
    await asyncio.sleep(0)  # all of them queued
    for i in leaving:
        tasks[i].cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    return started


@pytest.mark.parametrize(
    ("rate", "arrivals", "leaving", "expected"),
    [
        pytest.param(RATE, ["a", "a", "a", "b"], set(), ["a", "b", "a", "a"], id="a newcomer waits one round"),
        pytest.param(
            RATE, ["a", "a", "b", "b", "c"], set(), ["a", "b", "c", "a", "b"], id="round-robin across addresses"
        ),
        pytest.param(RATE, ["a", "a", "b"], {1}, ["a", "b"], id="one that left takes no turn"),
        pytest.param(RATE, ["a", "b"], {0, 1}, [], id="all left: the queue empties"),
        pytest.param(RATE, ["a", "a", "api", "b"], set(), ["api", "a", "b", "a"], id="a trusted address: at once"),
        pytest.param(0.0, ["a", "a", "a", "b"], set(), ["a", "a", "a", "b"], id="no limit: all at once, in order"),
    ],
)
def test_handshakes_start_round_robin_across_the_addresses_waiting(
    rate: float, arrivals: list[str], leaving: set[int], expected: list[str]
) -> None:
    assert asyncio.run(_turns(rate, arrivals, leaving)) == expected
