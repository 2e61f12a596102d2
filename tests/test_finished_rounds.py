"""A node whose training ended runs no more averaging rounds: a peer still training (group averaging lets a
cluster finish well ahead of its partners) is told at once, not left waiting ``ring_step_s`` for pieces that
will never come.  Mailbox and round queue, without sockets."""

from __future__ import annotations

import asyncio

import torch

from ravq.average.mailbox import Mailbox, RingAborted
from ravq.average.round_queue import RoundQueue
from ravq.config import ClusterPlan, Plan
from ravq.metrics import Metrics


def _piece(mailbox: Mailbox, sender: str, ring: int, round_id: int, step: int = 0) -> None:
    mailbox.deliver(sender, {"ring": ring, "round": round_id, "step": step, "piece": 0}, torch.zeros(4))


def test_a_finished_node_refuses_each_round_a_peer_sends_once_including_those_it_had_buffered() -> None:
    refused: list[tuple[str, int, int]] = []
    box = Mailbox(refuse=lambda *abort: refused.append(abort))
    _piece(box, "c1s0", 0, 7)                      # a partner ahead: its round 7 waits for this node's
    assert refused == [] and box.future_messages == 1
    box.finish()
    assert refused == [("c1s0", 0, 7)] and box.future_messages == box.future_bytes == 0
    _piece(box, "c1s0", 0, 7, step=1)             # the rest of round 7: refused already
    _piece(box, "c1s0", 0, 8)
    _piece(box, "c2s0", 0, 8)
    _piece(box, "c1s0", 0, 6)                      # older than one refused: nothing to say
    assert refused == [("c1s0", 0, 7), ("c1s0", 0, 8), ("c2s0", 0, 8)]


def test_the_peer_ends_the_round_at_the_refusal_not_at_its_timeout() -> None:
    async def main() -> None:
        box = Mailbox()
        rnd = box.open(0, 7, members=["c0s0", "c1s0"], me="c0s0", pieces_per_step=[1, 1])
        box.deliver_abort("c1s0", 0, 7, "finished")
        try:
            await box.take(rnd, 0, 0, timeout_s=3600)
        except RingAborted as err:
            assert err.reason == "finished" and err.from_peer
        else:
            raise AssertionError("the refused round went on")

    asyncio.run(asyncio.wait_for(main(), 5))


class _Link:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, int, int, str]] = []

    async def send(self, peer: str, meta: dict[str, int], piece: object) -> None:
        raise AssertionError("a refusal sends no piece")

    async def send_abort(self, peer: str, ring_id: int, round_id: int, reason: str) -> None:
        self.aborts.append((peer, ring_id, round_id, reason))


def test_the_round_queue_sends_each_refusal_as_a_ring_abort() -> None:
    async def main() -> list[tuple[str, int, int, str]]:
        link = _Link()
        plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=["c0s0"], cuts=[])])
        queue = RoundQueue(me="c0s0", plan=lambda: plan, mailbox=Mailbox(), link=link, metrics=Metrics(),
                           piece_bytes=1 << 20, timeout_s=30.0, notify_s=1.0, compression=None)
        box = Mailbox(refuse=queue.refuse)
        box.finish()
        _piece(box, "c1s0", 3, 12)
        sender = asyncio.create_task(queue.send_skips())
        while not link.aborts:
            await asyncio.sleep(0)
        sender.cancel()
        return link.aborts

    assert asyncio.run(asyncio.wait_for(main(), 5)) == [("c1s0", 3, 12, "finished")]
