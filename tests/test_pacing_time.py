"""Rate pacing by time (issue #38): round k falls due (k + 1) x ``period_s`` after the epoch's instant, so
clusters whose real rates differ from the plan's still reach each round together.  The clock is the test's."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ravq.average.group_rounds import RoundClock, RoundGroups, epoch_began
from ravq.average.rounds import FINAL_ROUND, ROUNDS_PER_EPOCH
from ravq.average.segments import plan_segments, segments_for
from ravq.config.averaging import AveragingConfig
from ravq.planner import BlockProfile, NodeProfile
from ravq.planner.grouped import Averaging, averaging_config, averaging_of
from ravq.planner.pacing import round_steps
from ravq.planner.problem import Problem
from ravq.simulate import SegmentSpec, Settings, averaging_settings, simulate
from tests.test_group_rounds import GROUPS, NAMES, NUMELS, OWNERS, _plan
from tests.test_simulate import stage, world


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_round_is_due_each_period_and_a_step_spanning_several_runs_the_newest() -> None:
    clock = Clock(100.0)
    rounds = RoundClock(sync_every=10, now=clock)
    ended = []
    for t in (100.0, 104.0, 109.9, 110.0, 113.0, 125.0, 161.0, 162.0):  # epoch 7 is no stamp: from 100
        clock.t = t
        ended.append((rounds.step(7, period=10, period_s=10.0), list(rounds.skipped)))
    assert ended == [(None, []), (None, []), (None, []), (0, []), (None, []), (1, []), (5, [2, 3, 4]),
                     (None, [])]


def test_an_epoch_stamped_by_the_broker_counts_from_its_instant_on_every_node() -> None:
    """Two stages first step in the epoch 3 s and 40 s after the broker stamped it (one built its model
    slower): both end round 1 at their first step after 2 periods of the stamp; rounds already due when a
    stage arrives are not its own (no skip for them)."""
    epoch = 1_790_000_000_000                           # ms: the broker's clock
    began = epoch_began(epoch, epoch / 1000 + 5)
    assert began == epoch / 1000 and epoch_began(7, epoch / 1000) is None
    seen = {}
    for late in (3.0, 40.0):
        clock = Clock(began + late)
        rounds = RoundClock(sync_every=10, now=clock)
        ended = []
        for t in sorted({late, late + 1, late + 20, 41.0, 61.0}):
            clock.t = began + t
            index = rounds.step(epoch, period_s=20.0)
            ended.append((t, index, list(rounds.skipped)))
        seen[late] = [e for e in ended if e[1] is not None or e[2]]
    assert seen[3.0] == [(23.0, 0, []), (41.0, 1, []), (61.0, 2, [])]
    # due at 40: rounds 0 and 1 were due before it came; it tells its peers it skips them, then runs round 2
    assert seen[40.0] == [(40.0, None, [0, 1]), (60.0, 2, [])]


def test_a_node_tells_its_peers_of_the_rounds_a_long_step_passed_over() -> None:
    clock, told = Clock(0.0), []
    config = AveragingConfig(mode="global", pace="rate", rates=[3.0, 3.0, 3.0, 1.0], period_s=10.0)
    plan = _plan().model_copy(update={"averaging": config})
    groups = RoundGroups(GROUPS, 0, 6, skip=lambda round_id, rings: told.append(round_id), now=clock)
    segments = lambda p: segments_for("c0s0", plan_segments(NAMES, NUMELS, OWNERS, p.excluded))
    assert groups.period_s(plan) == 10.0
    got = []
    for t in (0.0, 10.5, 44.0):
        clock.t = t
        got.append(None if (due := groups.step(plan, segments)) is None else due[0] - plan.epoch * ROUNDS_PER_EPOCH)
    assert got == [None, 0, 3] and told == [plan.epoch * ROUNDS_PER_EPOCH + k for k in (1, 2)]
    assert RoundGroups(GROUPS, 0, 6).period_s(_plan()) is None          # no rate pacing: by steps


def test_rounds_by_time_are_rate_pacing_and_reach_the_plan_and_the_simulator() -> None:
    with pytest.raises(ValidationError, match="pace: rate"):
        AveragingConfig(pace="steps", period_s=10.0)
    with pytest.raises(ValidationError):
        AveragingConfig(pace="rate", rates=[1.0, 2.0], period_s=0.0)
    with pytest.raises(ValidationError, match="give rates"):
        AveragingConfig(pace="rate", period_s=10.0)
    chosen = Averaging("groups", 2, "rate", (30.0, 10.0, 30.0), period_s=12.5)
    config = averaging_config(chosen)
    assert config is not None and config.period_s == 12.5
    assert averaging_of(AveragingConfig.model_validate(config.model_dump())) == chosen
    assert averaging_settings(Settings(sync_every=10), config).round_period_s == 12.5
    assert averaging_settings(Settings(sync_every=10), config.model_copy(update={"period_s": None})).round_period_s \
        is None


def test_clusters_slower_than_planned_reach_their_rounds_by_time_without_holding_the_others() -> None:
    """Two clusters the plan says train alike (its shares: 10 steps each); b is really 1.3x slower.  Counted in
    steps, b reaches each round later and a holds back for it: a trains at b's pace.  By time both reach every
    round together (none aborts before a is done), and a trains at its own rate."""
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e6, holders=("a", "b"))
    clusters = [[stage("a", 0.1, 0.1)], [stage("b", 0.13, 0.13)]]
    base = Settings(steps=2000, sync_every=10, averaging_lead=1, round_steps=tuple(round_steps(10, [1.0, 1.0])))
    by_steps, by_time = (simulate(world(clusters, settings, bandwidth=1e8, segments=[segment]))
                         for settings in (base, Settings(**{**_fields(base), "round_period_s": 2.0})))
    a, b = by_steps.clusters
    assert a.samples_per_s < 1.05 * b.samples_per_s                          # held to b's pace
    a, b = by_time.clusters
    assert a.samples_per_s > 1.2 * b.samples_per_s
    assert sum(n.allreduce_aborts for n in by_time.nodes) <= 1       # b's first round after a's end, if any
    assert min(n.allreduce_rounds for n in by_time.nodes) >= 0.95 * a.wall_s / 2.0     # every round till then


def _fields(settings: Settings) -> dict[str, object]:
    return {name: getattr(settings, name) for name in Settings.__dataclass_fields__}


def test_the_planner_counts_shares_in_whole_steps_and_a_cluster_too_slow_for_one_a_period_sets_the_pace() -> None:
    """Rate pacing counts each cluster's share of ``sync_every`` in whole optimizer steps, at least one, as the
    nodes do.  10 steps of 5 micro-batches a round; rates 10 and 0.5 micro-batches/s: the slow one's share
    (0.5 of a step) is one step, 5 micro-batches, which take it 10 s, twice the fast one's round of 5 s: the
    run goes at that pace, 4 x (50 + 5) / 10 = 22 samples/s (counted in micro-batches: 41.6)."""
    from ravq.planner.grouped import paced_samples_per_s, paced_shares

    nodes = [NodeProfile(name=n, flops=1e12, memory_bytes=1 << 32, bandwidth_bytes_per_s={}, latency_s={})
             for n in "ab"]
    block = BlockProfile(name="b0", param_bytes=1 << 20, fwd_flops=1e9, bwd_flops=2e9, act_bytes_out=1 << 10,
                         memory_bytes=1 << 24)
    p = Problem(nodes, [block], micro_batch=4, sync_every=10, update_every=5, overlap_averaging=True)
    assert paced_shares(p, [10.0, 0.5]) == [50, 5]
    assert paced_samples_per_s(p, [10.0, 0.5], 0.0) == pytest.approx(22.0)
    assert paced_samples_per_s(p, [10.0, 5.0], 0.0) == pytest.approx(4 * 75 / 5)     # both keep the period


def test_an_epoch_of_a_run_older_than_a_day_still_counts_from_the_broker_stamp() -> None:
    """The broker stamps a run's first epoch and counts later ones on by one, so two days into a run a new
    epoch still names the run's start.  Two stages entering it 3 s and 15 s after the plan change (one's step is
    long) must end the same rounds at the same instants; counted from each one's own first step they are 12 s
    apart for ever (rounds of 20 s), and with steps longer than a period they would never meet."""
    stamp = 1_790_000_000_000
    epoch = stamp + 3                                      # the run's fourth plan, two days in
    day2 = stamp / 1000 + 2 * 86400
    assert epoch_began(epoch, day2) == epoch / 1000
    assert epoch_began(epoch, stamp / 1000 - 2 * 86400) is None   # a clock far behind the stamp: no stamp
    ended = {}
    for late in (3.0, 15.0):
        clock = Clock(day2 + late)
        rounds = RoundClock(sync_every=10, now=clock)
        ended[late] = []
        for t in sorted({late, 21.0, 24.0, 41.0, 44.0}):
            clock.t = day2 + t
            if (index := rounds.step(epoch, period_s=20.0)) is not None:
                ended[late].append((t, index))
    assert ended[3.0] == ended[15.0] == [(21.0, 8640), (41.0, 8641)]


def test_rounds_by_time_stay_below_the_final_round_even_when_an_epoch_is_entered_that_late() -> None:
    stamp = 1_790_000_000_000
    clock = Clock(stamp / 1000 + 30 * 86400)
    rounds = RoundClock(sync_every=10, now=clock)
    assert rounds.step(stamp, period_s=1.0) is None
    assert rounds.skipped and max(rounds.skipped) < FINAL_ROUND
    clock.t += 5
    assert rounds.step(stamp, period_s=1.0) is None and not rounds.skipped


def test_a_node_whose_clock_is_behind_the_stamp_ends_no_round_before_it() -> None:
    stamp = 1_790_000_000_000
    clock = Clock(stamp / 1000 - 30.0)                     # 30 s behind the broker: rounds of 10 s
    rounds = RoundClock(sync_every=10, now=clock)
    ended = []
    for t in (-30.0, -25.0, -15.0, 5.0, 11.0):
        clock.t = stamp / 1000 + t
        ended.append(rounds.step(stamp, period_s=10.0))
    assert ended == [None, None, None, None, 0]


def test_the_next_round_of_an_epoch_paced_by_time_is_counted_in_rounds_not_steps() -> None:
    """A node leaving an epoch tells its group of the round it will not run (groups mode): by time, the next due
    (none yet: round 0), not its steps over its share."""
    clock = Clock(0.0)
    rounds = RoundClock(sync_every=10, now=clock)
    for t in range(5):
        clock.t = float(t)
        assert rounds.step(7, period=2, period_s=10.0) is None
    assert rounds.ended(2) == 0
    assert RoundClock(sync_every=10).ended(2) == 0


def test_a_step_spanning_many_rounds_tells_its_peers_of_the_newest_few_only() -> None:
    """A stage paused for 20 periods skips 19 rounds; its peers hold at most one running and two queued, so it
    tells them of the newest 3 only (each skip is a RING_ABORT to every peer of every ring)."""
    clock = Clock(0.0)
    rounds = RoundClock(sync_every=10, now=clock)
    assert rounds.step(7, period_s=1.0) is None
    clock.t = 20.5
    assert rounds.step(7, period_s=1.0) == 19 and list(rounds.skipped) == [16, 17, 18]

