"""Group averaging's rounds in one process: every node derives its round's group and runs its rings over
that group's holders (ravq.average.group_rounds over the real rings and mailboxes); a plan change aborts
only the groups it touches.  4 clusters of 2 stages, cut alike, in groups of 2."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravq.average.group_rounds import RoundClock, RoundGroups, live_clusters
from ravq.average.rounds import ROUNDS_PER_EPOCH, RoundResult, average_segments
from ravq.average.segments import Segment, plan_segments, segments_for
from ravq.config import ClusterPlan, Plan
from ravq.config.averaging import AveragingConfig
from tests.test_allreduce import MemoryNet
from tests.virtual_time import now, run_virtual

NAMES, NUMELS = ["a.w", "b.w"], [6, 4]
CLUSTERS = 4
TIMEOUT_S = 30.0
GROUPS = AveragingConfig(mode="groups", group_size=2)


def _plan(epoch: int = 1, excluded: tuple[int, ...] = ()) -> Plan:
    return Plan(epoch=epoch, excluded=list(excluded),
                clusters=[ClusterPlan(nodes=[f"c{c}s0", f"c{c}s1"], cuts=["b"]) for c in range(CLUSTERS)])


OWNERS = [{"a.w": f"c{c}s0", "b.w": f"c{c}s1"} for c in range(CLUSTERS)]
NODES = [n for c in range(CLUSTERS) for n in (f"c{c}s0", f"c{c}s1")]


def _segments(node: str, plan: Plan, groups: RoundGroups, round_index: int) -> list[Segment]:
    return groups.rings(segments_for(node, plan_segments(NAMES, NUMELS, OWNERS, plan.excluded)), plan,
                           round_index)


def _round(net: MemoryNet, values: dict[str, dict[int, torch.Tensor]], plan: Plan, round_index: int,
           config: AveragingConfig = GROUPS) -> dict[str, RoundResult]:
    async def main() -> dict[str, RoundResult]:
        async def one(node: str) -> RoundResult:
            segs = _segments(node, plan, RoundGroups(config, int(node[1]), 1), round_index)
            return await average_segments(values[node], segs, me=node, round_id=plan.epoch * ROUNDS_PER_EPOCH
                                          + round_index, link=net.link(node), mailbox=net.boxes[node],
                                          piece_bytes=8, timeout_s=TIMEOUT_S)
        results = await asyncio.gather(*[one(n) for n in NODES])
        return dict(zip(NODES, results))
    return run_virtual(main())


def _start() -> dict[str, dict[int, torch.Tensor]]:
    """Node -> ring id -> its flat segment: cluster c holds c everywhere."""
    segs = plan_segments(NAMES, NUMELS, OWNERS)
    return {n: {s.ring_id: torch.full((s.numel,), float(n[1])) for s in segments_for(n, segs)} for n in NODES}


def test_each_group_runs_its_own_rings_and_the_grid_reaches_the_exact_average_in_two_rounds() -> None:
    net, values, plan = MemoryNet(NODES), _start(), _plan()
    for r in range(2):
        results = _round(net, values, plan, r)
        for node, result in results.items():
            assert not result.aborted
            group = RoundGroups(GROUPS, int(node[1]), 1).group(plan, r)
            seg = _segments(node, plan, RoundGroups(GROUPS, int(node[1]), 1), r)
            assert len(group) == 2 and all(s.ring == tuple(f"c{c}{node[2:]}" for c in group) for s in seg)
            if r == 0:  # the group's mean, not every cluster's
                assert {v[0].item() for v in result.averaged.values()} == {sum(group) / 2}
            values[node] = {ring: result.averaged[ring] for ring in values[node]}
    for node in NODES:  # after d = 2 rounds every cluster holds the mean of 0, 1, 2, 3
        for flat in values[node].values():
            torch.testing.assert_close(flat, torch.full_like(flat, 1.5))
    assert net.sent["c0s0"] == 2 * 6 * 4  # a group of 2 sends the whole segment once per round, in float32


def test_global_mode_rings_run_over_every_live_cluster() -> None:
    net, values, plan = MemoryNet(NODES), _start(), _plan()
    results = _round(net, values, plan, 0, AveragingConfig())
    for result in results.values():
        for flat in result.averaged.values():
            torch.testing.assert_close(flat, torch.full_like(flat, 1.5))


def test_a_membership_change_aborts_only_the_groups_it_touches() -> None:
    """Cluster 3 dies mid-round (silent); the broker excludes it.  Every node aborts the open rounds of
    the groups reaching cluster 3 at once; the other group's round, already open, finishes."""
    net, values, plan = MemoryNet(NODES, latency_s=0.3), _start(), _plan()  # rounds take 0.6 s
    group_of = {c: RoundGroups(GROUPS, c, 1).group(plan, 0) for c in range(CLUSTERS)}
    partner = next(c for c in group_of[3] if c != 3)
    net.silent.update({"c3s0", "c3s1"})
    live = [n for n in NODES if not n.startswith("c3")]
    groups = {n: RoundGroups(GROUPS, int(n[1]), 1) for n in live}
    for g in groups.values():
        assert g.touched(plan) is None  # the first plan a node sees: nothing to compare with

    async def main() -> tuple[dict[str, RoundResult], float]:
        t0 = now()
        rounds = asyncio.gather(*[average_segments(
            values[n], _segments(n, plan, groups[n], 0), me=n, round_id=plan.epoch * ROUNDS_PER_EPOCH,
            link=net.link(n), mailbox=net.boxes[n], piece_bytes=8, timeout_s=TIMEOUT_S) for n in live])
        await asyncio.sleep(0.5)
        dropped = _plan(epoch=2, excluded=(3,))
        for n in live:
            net.boxes[n].abort_open("plan_changed", groups[n].touched(dropped))
        return dict(zip(live, await rounds)), now() - t0

    results, seconds = run_virtual(main())
    assert seconds == pytest.approx(0.6)  # the aborted rounds at once, no timeout waited for
    for node, result in results.items():
        if int(node[1]) == partner:
            assert {e.reason for e in result.aborted.values()} == {"plan_changed"} and not result.averaged
        else:
            assert not result.aborted and result.averaged
    assert net.aborts_sent == dict.fromkeys(NODES, 0)


def test_a_change_to_a_nodes_own_cluster_aborts_all_its_rounds_and_global_mode_aborts_every_round() -> None:
    plan = _plan()
    mine = RoundGroups(GROUPS, 3, 1)
    mine.touched(plan)
    assert mine.touched(_plan(epoch=2, excluded=(3,))) is None
    other = RoundGroups(GROUPS, 0, 1)
    other.touched(plan)
    assert other.touched(_plan(epoch=2, excluded=(3,))) == {"c3s0", "c3s1"}
    every = RoundGroups(AveragingConfig(), 0, 1)
    every.touched(plan)
    assert every.touched(_plan(epoch=2, excluded=(3,))) is None


def test_a_cluster_alone_in_its_group_skips_the_round_and_rounds_count_from_each_epoch() -> None:
    plan = _plan(excluded=(1,))  # 3 live clusters in groups of 2 on a 2 x 2 grid: one place stays empty
    alone = [c for c in live_clusters(plan) if len(RoundGroups(GROUPS, c, 1).group(plan, 0)) == 1]
    assert len(alone) <= 1
    for c in alone:
        assert _segments(f"c{c}s0", plan, RoundGroups(GROUPS, c, 1), 0) == []
    clock = RoundClock(3)
    assert [clock.step(1) for _ in range(7)] == [None, None, 0, None, None, 1, None]
    assert [clock.step(2) for _ in range(3)] == [None, None, 0]


def test_the_nodes_metrics_name_its_newest_rounds_group() -> None:
    from ravq.metrics import Metrics

    metrics, plan = Metrics("c2s0"), _plan()
    groups = RoundGroups(GROUPS, 2, 1, metrics)
    assert groups.step(plan, lambda p: segments_for("c2s0", plan_segments(NAMES, NUMELS, OWNERS))) is not None
    assert metrics.averaging_group.collect()[0].samples[0].value == min(groups.last)
    assert metrics.averaging_group_size.collect()[0].samples[0].value == 2 == len(groups.last)


def test_a_node_that_sees_a_new_epoch_first_tells_its_old_group_it_skips_the_next_round() -> None:
    """3 steps a round: after 4 steps of epoch 1 the node is part-way to round 1; at epoch 2 it will never
    run it, so it tells round 1's group (whose members a step ahead may have started it).  Global mode
    does not need to: every node drops every round of the old epoch."""
    told: list[tuple[int, list[Segment]]] = []
    groups = RoundGroups(GROUPS, 0, 3, skip=lambda round_id, rings: told.append((round_id, rings)))
    mine = lambda p: segments_for("c0s0", plan_segments(NAMES, NUMELS, OWNERS, p.excluded))
    first, second = _plan(epoch=1), _plan(epoch=2, excluded=(3,))
    due = [groups.step(first, mine) for _ in range(4)]
    assert [d is not None for d in due] == [False, False, True, False] and due[2][0] == ROUNDS_PER_EPOCH
    assert groups.step(second, mine) is None and len(told) == 1
    round_id, rings = told[0]
    partner = next(c for c in groups.group(first, 1) if c != 0)
    assert round_id == ROUNDS_PER_EPOCH + 1 and [s.ring for s in rings] == [("c0s0", f"c{partner}s0")]
    everyone = RoundGroups(AveragingConfig(), 0, 3, skip=lambda round_id, rings: told.append((round_id, rings)))
    for plan in (first, first, first, first, second):
        everyone.step(plan, mine)
    assert len(told) == 1


def test_queued_rounds_of_the_replaced_epoch_still_run_in_groups_the_change_did_not_touch() -> None:
    groups, plan = RoundGroups(GROUPS, 0, 1), _plan(epoch=5)
    groups.touched(plan)
    assert groups.touched(_plan(epoch=6, excluded=(3,))) == {"c3s0", "c3s1"}
    untouched = [Segment(0, ("a.w",), 6, ("c0s0", "c1s0"))]
    touched = [Segment(0, ("a.w",), 6, ("c0s0", "c3s0"))]
    assert groups.spared(5 * ROUNDS_PER_EPOCH + 7, untouched)
    assert not groups.spared(5 * ROUNDS_PER_EPOCH + 7, touched)
    assert not groups.spared(4 * ROUNDS_PER_EPOCH + 7, untouched)  # two epochs back: not
    every = RoundGroups(AveragingConfig(), 0, 1)
    every.touched(plan)
    every.touched(_plan(epoch=6, excluded=(3,)))
    assert not every.spared(5 * ROUNDS_PER_EPOCH + 7, untouched)


@pytest.mark.parametrize(("spared", "told"), [(False, 1), (None, 0)])
def test_a_dropped_queued_round_of_the_old_epoch_is_told_to_its_group_not_in_global_mode(
        spared: bool | None, told: int) -> None:
    """Groups mode (spared False): a peer of the round's group may have started it, so it is told at once;
    global rings (None): every peer drops it too, as before."""
    import concurrent.futures

    from ravq.average.round_queue import RoundQueue
    from ravq.metrics import Metrics

    net = MemoryNet(["c0s0", "c1s0"])
    ring = [Segment(0, ("a.w",), 6, ("c0s0", "c1s0"))]
    queue = RoundQueue(me="c0s0", plan=lambda: _plan(epoch=2), mailbox=net.boxes["c0s0"], link=net.link("c0s0"),
                       metrics=Metrics("c0s0"), piece_bytes=8, timeout_s=TIMEOUT_S, notify_s=1.0, compression=None,
                       spared=lambda round_id, rings: spared)
    done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()

    async def main() -> None:
        queue.enqueue((ROUNDS_PER_EPOCH + 3, {0: torch.ones(6)}, ring, done))
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(queue.run()), tg.create_task(queue.send_skips())]
            await asyncio.sleep(1.0)
            for task in tasks:
                task.cancel()

    run_virtual(main())
    assert {e.reason for e in done.result().aborted.values()} == {"plan_changed"}
    assert net.aborts_sent["c0s0"] == told


def test_a_plans_own_averaging_wins_over_the_topologys() -> None:
    """The planner picks the mode per plan (Plan.averaging); the topology's applies when the plan names none."""
    segs = segments_for("c0s0", plan_segments(NAMES, NUMELS, OWNERS))
    grouped = _plan().model_copy(update={"averaging": GROUPS})
    assert [len(s.ring) for s in RoundGroups(AveragingConfig(), 0, 1).rings(segs, grouped, 0)] == [2]
    assert [len(s.ring) for s in RoundGroups(AveragingConfig(), 0, 1).rings(segs, _plan(), 0)] == [4]
    every = _plan().model_copy(update={"averaging": AveragingConfig()})
    assert [len(s.ring) for s in RoundGroups(GROUPS, 0, 1).rings(segs, every, 0)] == [4]
