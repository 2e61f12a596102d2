"""Ring rounds under churn, in one process: a round that cannot finish ends at once, not after timeout_s."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravq.average.mailbox import RingAborted
from ravq.average.ring import ring_allreduce
from tests.test_allreduce import MemoryNet, run_ring
from tests.virtual_time import now, run_virtual

TIMEOUT_S = 30.0  # what ring_step_s would be: no test below may come near it


def test_a_plan_change_abandons_open_rounds_at_once_without_telling_anyone() -> None:
    """A member is declared lost: every node sees the plan change and aborts its open rounds itself."""
    members = ["a", "b", "c"]
    net = MemoryNet(members)
    net.silent.add("c")  # c died: it neither sends nor receives

    async def main() -> tuple[list[object], float]:
        t0 = now()
        rounds = asyncio.gather(*[
            ring_allreduce(torch.ones(12), ring_id=0, round_id=7, members=members, me=m, link=net.link(m),
                           mailbox=net.boxes[m], piece_bytes=16, timeout_s=TIMEOUT_S) for m in ("a", "b")],
            return_exceptions=True)
        await asyncio.sleep(0.2)
        assert net.boxes["a"].abort_open("plan_changed") == 1 and net.boxes["b"].abort_open("plan_changed") == 1
        return await rounds, now() - t0

    outcomes, seconds = run_virtual(main())
    assert seconds == pytest.approx(0.2)  # at once: on a virtual clock, no timer but the test's own ran
    assert all(isinstance(o, RingAborted) and o.reason == "plan_changed" for o in outcomes), outcomes
    assert net.aborts_sent == {"a": 0, "b": 0, "c": 0}  # everyone saw the plan: nobody is told


def test_a_member_that_moved_on_to_a_newer_round_ends_the_older_one_at_once() -> None:
    """b skipped round 5 (it was away, or its queue was full) and runs round 6: a, waiting in round 5
    for b's pieces, sees a piece of round 6 from b and gives round 5 up; round 6 then completes."""
    members = ["a", "b"]
    net = MemoryNet(members)

    async def a_side() -> tuple[object, torch.Tensor]:
        try:
            await ring_allreduce(torch.ones(8), ring_id=0, round_id=5, members=members, me="a", link=net.link("a"),
                                 mailbox=net.boxes["a"], piece_bytes=16, timeout_s=TIMEOUT_S)
            first: object = None
        except RingAborted as err:
            first = err
        return first, await ring_allreduce(torch.ones(8), ring_id=0, round_id=6, members=members, me="a",
                                           link=net.link("a"), mailbox=net.boxes["a"], piece_bytes=16,
                                           timeout_s=TIMEOUT_S)

    async def b_side() -> torch.Tensor:
        await asyncio.sleep(0.1)
        return await ring_allreduce(torch.full((8,), 3.0), ring_id=0, round_id=6, members=members, me="b",
                                    link=net.link("b"), mailbox=net.boxes["b"], piece_bytes=16, timeout_s=TIMEOUT_S)

    async def main() -> tuple[object, list[torch.Tensor], float]:
        t0 = now()
        (first, a6), b6 = await asyncio.gather(a_side(), b_side())
        return first, [a6, b6], now() - t0

    first, results, seconds = run_virtual(main())
    assert isinstance(first, RingAborted) and first.reason == "peer_moved_on"
    assert seconds == pytest.approx(0.1)  # at once: on a virtual clock, no timer but b's start ran
    for r in results:
        torch.testing.assert_close(r, torch.full((8,), 2.0))


@pytest.mark.parametrize("members", [2, 3])
def test_rounds_finished_in_order_are_never_taken_for_moved_on(members: int) -> None:
    """Pieces of the next round arriving while this one still has pieces queued (not yet taken) do not
    end it: a link's pieces arrive in order, so everything of this round is already there."""
    names = [f"m{i}" for i in range(members)]
    net = MemoryNet(names)

    async def main() -> list[list[torch.Tensor]]:
        out = []
        for round_id in range(5):
            flats = [torch.full((50,), float(i + round_id)) for i in range(members)]
            out.append(await run_ring(net, flats, names, piece_bytes=8, timeout_s=TIMEOUT_S, round_id=round_id))
        return out

    for round_id, results in enumerate(asyncio.run(main())):
        want = torch.full((50,), sum(float(i + round_id) for i in range(members)) / members)
        for r in results:
            torch.testing.assert_close(r, want)
