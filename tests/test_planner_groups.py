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
