"""The planner and averaging costs (issue #38 part 3): rounds in groups, the choice of averaging per plan,
and slow links kept off stages holding large segments (``ravq.planner.grouped``)."""

from __future__ import annotations

import pytest

from ravq.config import ClusterPlan, Plan
from ravq.planner import BlockProfile, NodeProfile, evaluate_plan
from ravq.planner.cost import averaging_round_s, fixed_layout
from ravq.planner.grouped import GLOBAL, Averaging, averaging_config, best_averaging, recut, score_with
from ravq.planner.problem import Problem

GIB = 1 << 30
SETTINGS = {"micro_batch": 4, "sync_every": 10, "max_inflight": None, "overlap_averaging": True,
            "averaging_lead": 1, "wire": None}


def blocks(count: int = 4) -> list[BlockProfile]:
    return [BlockProfile(name=f"b{i}", param_bytes=25 << 20, fwd_flops=1e11, bwd_flops=2e11, act_bytes_out=1 << 20,
                         memory_bytes=1 << 28) for i in range(count)]


def pcs(names: list[str], bandwidth: float, slow: dict[str, float] | None = None) -> list[NodeProfile]:
    """PCs able to hold the whole model; ``slow``: PCs whose every link runs at that speed instead."""
    slow = slow or {}
    return [NodeProfile(name=n, flops=1e12, memory_bytes=4 * GIB,
                        bandwidth_bytes_per_s={m: min(slow.get(n, bandwidth), slow.get(m, bandwidth))
                                               for m in names if m != n},
                        latency_s={m: 0.01 for m in names if m != n}) for n in names]


def test_groups_of_two_make_shorter_rounds_and_are_chosen_when_rounds_cost() -> None:
    """Four one-PC clusters on 5 MB/s links: one ring over all sends 2(4-1)/4 = 1.5 x the held bytes a round,
    groups of two 1 x: the planner picks groups of two (everyone mixes within 2 rounds), and the plan it
    describes scores the same in evaluate_plan."""
    names = ["a", "b", "c", "d"]
    nodes = pcs(names, 5e6)
    p = Problem(nodes, blocks(), **SETTINGS)
    layouts = [fixed_layout(p, (i,), (0, 4)) for i in range(4)]
    averaging, value = best_averaging(p, layouts)
    assert averaging == Averaging("groups", 2)
    assert value > score_with(p, layouts, GLOBAL) * 1.05
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=[n], cuts=[]) for n in names],
                averaging=averaging_config(averaging))
    assert evaluate_plan(plan, nodes, blocks(), **SETTINGS).samples_per_s == pytest.approx(value)
    # on fast links a round costs nothing either way: global rings, the simpler, stay
    fast = Problem(pcs(names, 1e12), blocks(), **SETTINGS)
    assert best_averaging(fast, [fixed_layout(fast, (i,), (0, 4)) for i in range(4)])[0] == GLOBAL


def test_a_node_behind_a_slow_link_is_recut_to_hold_a_small_stage() -> None:
    """Two clusters of two stages; a1's links run at 2 MB/s, everyone else's at 100 MB/s.  Cut 1 | 3, a1
    holds three blocks and the round waits 3 x 25 MB over its link; re-cut, a1 holds fewer blocks, the
    round is shorter and the plan scores higher."""
    names = ["a0", "a1", "b0", "b1"]
    p = Problem(pcs(names, 1e8, slow={"a1": 2e6}), blocks(), **SETTINGS)
    before = [fixed_layout(p, (0, 1), (0, 1, 4)), fixed_layout(p, (2, 3), (0, 2, 4))]
    after = recut(p, before, GLOBAL)
    assert after[0].bounds[1] > 1                      # a1 now holds fewer than three blocks
    assert averaging_round_s(p, after) < averaging_round_s(p, before)
    assert score_with(p, after) > score_with(p, before)
    fair = Problem(pcs(names, 1e8), blocks(), **SETTINGS)   # nobody slow: nothing to gain from a re-cut
    even = [fixed_layout(fair, (0, 1), (0, 2, 4)), fixed_layout(fair, (2, 3), (0, 2, 4))]
    assert recut(fair, even, GLOBAL) == even


def test_a_round_counts_what_the_pipeline_leaves_of_a_stages_uplink() -> None:
    """Two clusters of two stages on 10 MB/s uplinks, activations of 1 MiB a micro-batch.  The pipeline's
    traffic takes part of each stage's uplink (the cluster's rate x the activation or gradient it sends), so
    the round lasts the held bytes over what is left, longer than over the whole link; with tiny activations
    nothing changes."""
    from ravq.planner.cost import cluster_rate, pipeline_bytes_per_s, ring_bandwidth

    names = ["a0", "a1", "b0", "b1"]
    p = Problem(pcs(names, 1e7), blocks(), **SETTINGS)
    layouts = [fixed_layout(p, (0, 1), (0, 2, 4)), fixed_layout(p, (2, 3), (0, 2, 4))]
    sent = pipeline_bytes_per_s(p, layouts[0])
    rate = cluster_rate(p, layouts[0])
    assert sent == pytest.approx([rate * (1 << 20)] * 2) and 0 < sent[0] < 1e7
    assert ring_bandwidth(p, layouts[0], [1e7, 1e7]) == pytest.approx([1e7 - s for s in sent])
    assert ring_bandwidth(p, layouts[0], [1e6, 1e6]) == [1e6, 1e6]          # a slower path bounds it first
    held = 2 * (25 << 20)
    whole = p.ring_factor(2) * held / 1e7
    assert averaging_round_s(p, layouts) == pytest.approx(whole * 1e7 / (1e7 - sent[0]))
    tiny = [BlockProfile(name=b.name, param_bytes=b.param_bytes, fwd_flops=b.fwd_flops, bwd_flops=b.bwd_flops,
                         act_bytes_out=1, memory_bytes=b.memory_bytes) for b in blocks()]
    q = Problem(pcs(names, 1e7), tiny, **SETTINGS)
    quiet = [fixed_layout(q, (0, 1), (0, 2, 4)), fixed_layout(q, (2, 3), (0, 2, 4))]
    assert averaging_round_s(q, quiet) == pytest.approx(whole, rel=1e-6)


def _heavy(act: int) -> list[BlockProfile]:
    return [BlockProfile(name=b.name, param_bytes=b.param_bytes, fwd_flops=b.fwd_flops, bwd_flops=b.bwd_flops,
                         act_bytes_out=act, memory_bytes=b.memory_bytes) for b in blocks()]


def test_a_stage_whose_pipeline_fills_its_uplink_still_averages_at_a_fair_share() -> None:
    """Three stages on 1 MB/s uplinks with 8 MiB activations: the pipeline alone would fill every uplink (it is
    link-bound), so 'what the pipeline leaves' is nothing and such a cluster never averaged in the cost model.
    TCP (and the simulator's water-filling) gives the ring's stream its share beside the pipeline's streams
    out of the node: a half at an end stage (one pipeline stream), a third in the middle (two)."""
    from ravq.planner.cost import pipeline_bytes_per_s, ring_bandwidth

    names = ["a0", "a1", "a2", "b0", "b1", "b2"]
    p = Problem(pcs(names, 1e6), _heavy(8 << 20), **SETTINGS)
    lay = fixed_layout(p, (0, 1, 2), (0, 1, 3, 4))
    sent = pipeline_bytes_per_s(p, lay)
    assert 1e6 - sent[1] < 1e6 / 3  # the middle stage's two streams leave it less than a fair share
    assert ring_bandwidth(p, lay, [1e6] * 3) == pytest.approx(
        [max(1e6 - sent[0], 1e6 / 2), 1e6 / 3, max(1e6 - sent[2], 1e6 / 2)])
    other = fixed_layout(p, (3, 4, 5), (0, 1, 3, 4))
    assert averaging_round_s(p, [lay, other]) < float("inf")


def test_rings_slow_a_link_bound_pipeline_by_the_bytes_they_take_of_its_uplinks() -> None:
    """``shared_rate``: a stage's uplink carries its pipeline's bytes and its rings' bytes a period; what the
    rings take, the pipeline loses.  Nothing lost where the pipeline leaves enough room."""
    from ravq.planner.cost import cluster_rate, shared_rate

    names = ["a0", "a1"]
    p = Problem(pcs(names, 1e6), _heavy(4 << 20), **SETTINGS)
    lay = fixed_layout(p, (0, 1), (0, 2, 4))
    rate = cluster_rate(p, lay)
    per_mb = 4 << 20  # each stage sends one activation or one gradient a micro-batch
    assert 0.3e6 < rate * per_mb < 1e6
    ring = [60e6, 60e6]  # 0.6 MB/s of each uplink over 100 s: the pipeline keeps 0.4 MB/s
    assert shared_rate(p, lay, rate, ring, 100.0) == pytest.approx(0.4e6 / per_mb)
    assert shared_rate(p, lay, rate, [1e6, 1e6], 100.0) == rate  # room enough: nothing lost
    assert shared_rate(p, lay, rate, ring, 0.0) == rate  # no period: nothing shared
    q = Problem(pcs(names, 1e9), _heavy(4 << 20), **SETTINGS)
    fast = fixed_layout(q, (0, 1), (0, 2, 4))
    assert shared_rate(q, fast, cluster_rate(q, fast), ring, 100.0) == cluster_rate(q, fast)


def test_a_cluster_slower_than_a_step_a_period_takes_part_every_few_rounds_and_a_far_slower_one_is_not_kept(
) -> None:
    """Rounds by time: a cluster whose optimizer step outlasts the round period takes part when a step of it
    ends (its k covers the step), not every round with the others waiting; one whose step outlasts
    ``STEP_PERIODS`` periods is not planned with pacing by link.  Before, a step longer than the period set
    every cluster's period (``_longest_share_s``)."""
    from dataclasses import replace

    from ravq.planner.cost import cluster_rate
    from ravq.planner.grouped import STEP_PERIODS, link_every_of

    names = ["a", "b", "c"]
    nodes = pcs(names, 1e9)
    p = Problem(nodes, blocks(), **SETTINGS)
    lays = [fixed_layout(p, (i,), (0, 4)) for i in range(3)]
    rate = cluster_rate(p, lays[0])
    period = p.sync_every / rate
    for slowdown, expect in ((1.5, 2), (STEP_PERIODS * p.sync_every * 1.1, None)):  # step = slowdown periods
        slow = replace(nodes[2], flops=nodes[2].flops / (slowdown * p.sync_every / p.update_every))
        q = Problem([*nodes[:2], slow], blocks(), **SETTINGS)
        qlays = [fixed_layout(q, (i,), (0, 4)) for i in range(3)]
        step_s = q.update_every / cluster_rate(q, qlays[2])
        assert step_s == pytest.approx(slowdown * period * p.update_every / p.sync_every * p.sync_every
                                       / p.update_every, rel=0.05)
        got = link_every_of(q, qlays, Averaging(pace="rate"))
        if expect is None:
            assert got is None
        else:
            assert got is not None and got.every[2] >= expect and got.every[:2] == (1, 1)
