"""A busy ring peer is not a dead one (issue #38): one link carries all of a node's rings in order, so on a
slow uplink a ring's piece can queue behind other rings' pieces for longer than ``ring_step_s``.  A step
waits on while its predecessor still delivers, in the nodes (``Mailbox.take``, on a virtual clock) and in
the simulator (``Ring._watch``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravq.average import mailbox
from ravq.average.mailbox import Mailbox, RingAborted
from ravq.simulate import SegmentSpec, Settings, simulate
from ravq.simulate import rings as sim_rings
from tests.test_simulate import stage, world
from tests.virtual_time import now, run_virtual


def _piece(ring: int, step: int = 0, piece: int = 0) -> dict[str, int]:
    return {"ring": ring, "round": 3, "step": step, "piece": piece}


def _take_while(deliveries: list[tuple[float, int]], timeout_s: float = 1.0) -> tuple[float, str]:
    """Ring 0 takes its first piece from p (timeout 1 s) while p delivers ``deliveries`` (time, ring): when
    it got it, or when and why it gave up."""
    box = Mailbox()
    rounds = {r: box.open(r, 3, members=["p", "me"], me="me", pieces_per_step=[60, 60]) for r in range(2)}

    async def feed() -> None:
        for at, ring in deliveries:
            await asyncio.sleep(at - now())
            box.deliver("p", _piece(ring, piece=sum(1 for _, r in deliveries[:deliveries.index((at, ring))]
                                                     if r == ring)), torch.zeros(2))

    async def main() -> tuple[float, str]:
        feeder = asyncio.create_task(feed())
        try:
            await box.take(rounds[0], 0, 0, timeout_s)
            return now(), "got it"
        except RingAborted as err:
            return now(), err.reason
        finally:
            feeder.cancel()

    return run_virtual(main())


def test_a_step_waits_while_its_predecessor_delivers_other_rings_pieces() -> None:
    busy = [(0.5 * k, 1) for k in range(1, 8)] + [(3.8, 0)]   # ring 1's pieces every 0.5 s, then ring 0's
    assert _take_while(busy) == (3.8, "got it")


def test_a_predecessor_busy_with_a_newer_round_has_moved_on_and_the_step_aborts_after_ring_step_s() -> None:
    """p sends pieces of round 4 (another ring, buffered until it opens) while ring 0 waits on round 3's: p
    ran or dropped round 3 already, so ours will not come; the step gives up after one window, as before the
    busy wait (a standby's takeover in tests/test_matrix.py once hung a node for minutes on such waits)."""
    box = Mailbox()
    waiting = box.open(0, 3, members=["p", "me"], me="me", pieces_per_step=[1, 1])

    async def feed() -> None:
        for k in range(1, 10):
            await asyncio.sleep(0.5)
            box.deliver("p", {"ring": 5, "round": 4, "step": 0, "piece": k}, torch.zeros(2))

    async def main() -> tuple[float, str]:
        feeder = asyncio.create_task(feed())
        try:
            await box.take(waiting, 0, 0, 1.0)
            return now(), "got it"
        except RingAborted as err:
            return now(), err.reason
        finally:
            feeder.cancel()

    assert run_virtual(main()) == (1.0, "timeout")


def test_a_silent_predecessor_still_aborts_the_step_after_ring_step_s() -> None:
    assert _take_while([]) == (1.0, "timeout")
    assert _take_while([(0.2, 1)]) == (2.0, "timeout")          # heard at 0.2, then silent: the next window


def test_a_predecessor_busy_for_ever_elsewhere_aborts_after_busy_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mailbox, "BUSY_WAITS", 3)
    busy = [(0.5 * k, 1) for k in range(1, 40)]
    assert _take_while(busy) == (4.0, "timeout")                 # 1 window, then 3 more


def test_the_simulator_waits_as_the_nodes_do_for_rings_queued_on_one_slow_link() -> None:
    """Two one-node clusters holding 8 segments of 40 MB, 4 MB/s between them, ring steps of 5 s: each step's
    pieces of all 8 rings queue on one link (8 x 20 MB: 40 s), longer than a step may wait for its own.
    Waiting while the peer delivers, every round runs; waiting on progress alone, rings abort."""
    segments = [SegmentSpec(blocks=(i, i + 1), nbytes=40e6, holders=("a", "b")) for i in range(8)]
    clusters = [[stage("a", 0.1, 0.1)], [stage("b", 0.1, 0.1)]]
    settings = Settings(steps=400, sync_every=100, ring_timeout_s=5.0)
    busy = simulate(world(clusters, settings, bandwidth=4e6, segments=segments))
    assert sum(n.allreduce_aborts for n in busy.nodes) == 0
    assert [n.allreduce_rounds for n in busy.nodes] == [4, 4]
    assert sim_rings.BUSY_WAITS == mailbox.BUSY_WAITS


def test_without_the_wait_the_same_rings_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_rings, "BUSY_WAITS", 0)
    segments = [SegmentSpec(blocks=(i, i + 1), nbytes=40e6, holders=("a", "b")) for i in range(8)]
    clusters = [[stage("a", 0.1, 0.1)], [stage("b", 0.1, 0.1)]]
    result = simulate(world(clusters, Settings(steps=400, sync_every=100, ring_timeout_s=5.0), bandwidth=4e6,
                            segments=segments))
    assert sum(n.allreduce_aborts for n in result.nodes) > 0


def test_a_piece_arriving_as_the_window_closes_is_taken_not_lost() -> None:
    """The piece lands in the waiter in the same turn of the loop as the window's timeout: the timeout's
    cancellation must not throw it away (the step would then wait for a piece already delivered, for as long as
    the predecessor stays busy)."""
    box = Mailbox()
    rnd = box.open(0, 3, members=["p", "me"], me="me", pieces_per_step=[2, 2])

    async def main() -> tuple[float, str]:
        asyncio.get_running_loop().call_at(1.0 - 1e-12, box.deliver, "p", _piece(0), torch.ones(2))
        try:
            got = await box.take(rnd, 0, 0, 1.0)
            assert isinstance(got, torch.Tensor) and got.sum().item() == 2.0
            return now(), "got it"
        except RingAborted as err:
            return now(), err.reason

    assert run_virtual(main()) == (pytest.approx(1.0), "got it")
