"""Rounds paced by rate (issue #38): each cluster's steps per round, the samples-weighted mix, and what the
simulator makes of a cluster three times slower than the others."""

from __future__ import annotations

import pytest
import torch

from ravq.average.group_rounds import RoundGroups
from ravq.average.rounds import ROUNDS_PER_EPOCH
from ravq.average.segments import plan_segments, segments_for
from ravq.config import Plan
from ravq.config.averaging import AveragingConfig
from ravq.planner.grouped import Averaging, averaging_config, averaging_of
from ravq.planner.pacing import effective_clusters, mix_weights, round_steps, send_scale
from ravq.simulate import SegmentSpec, Settings, averaging_settings, simulate
from tests.test_allreduce import MemoryNet
from tests.test_group_rounds import CLUSTERS, GROUPS, NAMES, NODES, NUMELS, OWNERS, _plan, _round, _start
from tests.test_simulate import stage, world


def test_the_fastest_cluster_takes_sync_every_steps_a_round_and_slower_ones_their_share() -> None:
    assert round_steps(10, [30.0, 10.0, 30.0, 14.9]) == [10, 3, 10, 5]
    assert round_steps(10, [1.0, 0.01]) == [10, 1]            # never fewer than one step


def test_without_rates_every_cluster_keeps_sync_every() -> None:
    assert round_steps(7, [0.0, 0.0]) == [7, 7]
    assert round_steps(7, [2.0, 0.0]) == [7, 7]                # no rate: nobody can pace that cluster
    assert round_steps(7, []) == []


def test_a_round_mixes_each_cluster_by_the_samples_it_trained_since_its_last_mix() -> None:
    steps = [10, 3, 10, 5]
    assert mix_weights((1, 3), steps) == {1: pytest.approx(3 / 8), 3: pytest.approx(5 / 8)}
    # scaled so that a ring's plain mean of m members is the weighted average
    x = {1: 2.0, 3: 10.0}
    ring_mean = sum(x[c] * send_scale(c, (1, 3), steps) for c in x) / 2
    assert ring_mean == pytest.approx((3 * 2.0 + 5 * 10.0) / 8)
    assert send_scale(0, (0, 2), steps) == 1.0                 # equal shares: the plain mean


def test_rate_pacing_frees_the_fast_clusters_of_a_slow_one_in_the_simulator() -> None:
    """Four clusters, d three times slower, averaging every 10 steps.  Paced by steps every cluster trains at
    d's pace (global rings and groups of two alike); paced by rate the others train at three times that, d at
    its own, and every cluster still runs every round."""
    names = "abcd"
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e6, holders=tuple(names))
    clusters = [[stage(n, 0.03 if n == "d" else 0.01, 0.03 if n == "d" else 0.01)] for n in names]
    paced = tuple(round_steps(10, [1.0, 1.0, 1.0, 1 / 3]))
    for mode in ("global", "groups"):
        held, free = (simulate(world(clusters, Settings(steps=300, sync_every=10, averaging_mode=mode,
                                                          round_steps=pace), bandwidth=1e8, segments=[segment]))
                      for pace in (None, paced))
        fast_held = min(c.samples_per_s for c in held.clusters[:3])
        assert max(c.samples_per_s for c in held.clusters) < 1.05 * held.clusters[3].samples_per_s
        assert min(c.samples_per_s for c in free.clusters[:3]) > 2.5 * fast_held
        assert free.clusters[3].samples_per_s == pytest.approx(held.clusters[3].samples_per_s, rel=0.15)
        assert [n.allreduce_rounds for n in free.nodes] == [30] * 4
        assert [c.samples * 10 for c in free.clusters] == [free.clusters[0].samples * k for k in (10, 10, 10, 3)]


def _paced_plan(mode: str = "global") -> Plan:
    averaging = AveragingConfig(mode=mode, group_size=2, pace="rate", rates=[3.0, 3.0, 3.0, 1.0])
    return _plan().model_copy(update={"averaging": averaging})


@pytest.mark.parametrize("mode", ["global", "groups"])
def test_a_node_ends_its_rounds_after_its_clusters_share_of_steps_with_the_same_round_ids(mode: str) -> None:
    """Rates 3:3:3:1 and sync_every 6: clusters 0-2 end round k at their step 6(k+1), cluster 3 at its step
    2(k+1); every cluster's rings name the same round ids and (groups) the same groups."""
    plan = _paced_plan(mode)
    ended: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    for c in range(CLUSTERS):
        groups = RoundGroups(GROUPS, c, sync_every=6)
        assert groups.round_steps(plan) == [6, 6, 6, 2]
        segments = lambda p, c=c: segments_for(f"c{c}s0", plan_segments(NAMES, NUMELS, OWNERS, p.excluded))
        ended[c] = [(step, due[0], groups.last) for step in range(1, 13)
                    if (due := groups.step(plan, segments)) is not None]
    assert [s for s, _, _ in ended[0]] == [6, 12] and [s for s, _, _ in ended[3]] == [2, 4, 6, 8, 10, 12]
    first = plan.epoch * ROUNDS_PER_EPOCH
    assert [r for _, r, _ in ended[0]] == [first, first + 1] == [r for _, r, _ in ended[3]][:2]
    for c in range(CLUSTERS):
        partners = ended[c][0][2]
        assert all(ended[p][0][2] == partners for p in partners)


def test_a_paced_rounds_rings_move_every_cluster_to_the_samples_weighted_average() -> None:
    """Cluster c holds c; steps per round 6, 6, 6, 2: each sends its snapshot scaled (RoundGroups.weighed), the
    real rings take the plain mean, and the result is (6 * (0 + 1 + 2) + 2 * 3) / 20 = 1.2, not the mean 1.5."""
    plan, net, values = _paced_plan(), MemoryNet(NODES), _start()
    sent = {n: RoundGroups(GROUPS, int(n[1]), 6).weighed(plan, plan.epoch * ROUNDS_PER_EPOCH, values[n])
            for n in NODES}
    assert sent["c3s0"] is not values["c3s0"]                                  # a scaled copy
    assert all(torch.equal(flat, torch.full_like(flat, 3.0)) for flat in values["c3s0"].values())
    results = _round(net, sent, plan, 0, AveragingConfig())
    for result in results.values():
        assert not result.aborted
        for flat in result.averaged.values():
            assert torch.allclose(flat, torch.full_like(flat, 1.2))
    steps_paced = RoundGroups(AveragingConfig(pace="rate"), 0, 6)   # no rates: paced by steps, sent as it is
    assert steps_paced.weighed(_plan(), 0, values["c0s0"]) is values["c0s0"]


def test_a_plans_rate_pacing_reaches_the_simulator_and_survives_the_plans_keys() -> None:
    """The planner's choice (Averaging) goes into Plan.averaging and back unchanged; the simulator paces each
    cluster by it (ravq simulate and project_scale), and without rates as before."""
    chosen = Averaging("groups", 2, "rate", (30.0, 10.0, 30.0))
    config = averaging_config(chosen)
    assert config is not None and config.pace == "rate" and config.rates == [30.0, 10.0, 30.0]
    assert averaging_of(AveragingConfig.model_validate(config.model_dump())) == chosen
    assert averaging_config(Averaging()) is None                       # global rings paced by steps: the default
    assert averaging_config(Averaging(pace="rate")) is None            # no rates: nothing to pace by
    settings = averaging_settings(Settings(sync_every=10), config)
    assert (settings.averaging_mode, settings.group_size, settings.round_steps) == ("groups", 2, (10, 3, 10))
    assert averaging_settings(settings, AveragingConfig(mode="groups")).round_steps is None


def test_groups_mixed_by_samples_keep_the_samples_weighted_mean_of_every_cluster() -> None:
    """Groups of 2 paced 6:6:6:2, two rounds of real rings: each cluster's value changes, and the samples-weighted
    mean over all four, 1.2, stays where it was after each round.  That mean is the groups' consensus, so
    ClusterAdam counts the noise every live cluster's steps average away, not only the round's group's."""
    plan, net, values = _paced_plan("groups"), MemoryNet(NODES), _start()
    steps = RoundGroups(GROUPS, 0, 6).round_steps(plan)

    def value(node: str) -> float:
        (flat,) = values[node].values()                   # each node holds one ring: a.w on s0, b.w on s1
        return float(flat[0])

    def weighted_mean() -> float:
        return sum(steps[int(n[1])] * value(n) for n in NODES if n.endswith("s0")) / sum(steps)

    assert weighted_mean() == pytest.approx(1.2)
    for k in range(2):
        sent = {n: RoundGroups(GROUPS, int(n[1]), 6).weighed(plan, plan.epoch * ROUNDS_PER_EPOCH + k, values[n])
                for n in NODES}
        before = {n: value(n) for n in NODES}
        values = {n: r.averaged for n, r in _round(net, sent, plan, k, AveragingConfig()).items()}
        assert all(value(n) != before[n] for n in NODES)
        assert all(value(f"c{c}s1") == pytest.approx(value(f"c{c}s0")) for c in range(CLUSTERS))
        assert weighted_mean() == pytest.approx(1.2)


@pytest.mark.parametrize("steps", [(3, 3, 3, 1), (4, 2, 2), (6, 1), (2, 2, 2)])
def test_a_mix_by_samples_averages_away_the_noise_of_its_effective_clusters(steps: tuple[int, ...]) -> None:
    """Monte Carlo: cluster c trains steps[c] unit steps of gradient 1 + N(0, 1) and counts steps[c] / S in the
    mix.  The mix moves T = sum(s^2) / S steps with the noise of T steps on b clusters' batches, b =
    effective_clusters(steps); equal shares are worth every cluster, unequal ones less (3:3:3:1 is not 4)."""
    gen = torch.Generator().manual_seed(0)
    trials, total = 40_000, sum(steps)
    mixed = sum((s / total) * (1.0 + torch.randn(trials, s, generator=gen, dtype=torch.float64)).sum(dim=1)
                for s in steps)
    t = sum(s * s for s in steps) / total
    assert float(mixed.mean()) == pytest.approx(t, rel=0.01)
    measured = t / float(mixed.var())          # T steps of variance 1 / b each
    assert measured == pytest.approx(effective_clusters(steps), rel=0.04)
    if len(set(steps)) == 1:
        assert effective_clusters(steps) == len(steps)
    else:
        assert measured < 0.92 * len(steps)
    assert effective_clusters([5]) == 1.0
