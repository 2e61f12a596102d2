"""Pacing by rate and link with a cluster slower than one optimizer step a round period (issue #38): the score
(``grouped._linked_score``) and the simulator must count the same training.  Since 8e6f1d5 the score has each
cluster train on at its rate for the fastest's time, but the simulator (8e6f1d5's allotment reverted in
b85dab1) gives a cluster its whole-step share of every round, at least one step, so such a cluster trains on
after the others end, as ``paced_samples_per_s`` still counts it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ravq.config import ClusterPlan, Plan
from ravq.planner.cost import fixed_layout
from ravq.planner.grouped import Averaging, averaging_config, link_every_of, paced, score_with
from ravq.planner.problem import Problem
from ravq.simulate import Settings, averaging_settings, build_world, simulate
from tests.test_planner_groups import SETTINGS, blocks, pcs


@pytest.mark.xfail(strict=True, reason="_linked_score counts time shares, the simulator whole-step shares: "
                                       "6.89 predicted, 4.67 simulated (review R, session 10)")
def test_the_linked_score_of_a_cluster_slower_than_a_step_a_period_matches_the_simulator_within_15_percent(
) -> None:
    """Three one-PC clusters on fast links (a round costs ~0.1 s of a 12 s period); c's optimizer step takes 1.5
    periods, so its k is 2.  Simulated, c trains 40 micro-batches in 720 s while a and b end at 480 s."""
    names = ["a", "b", "c"]
    nodes = pcs(names, 1e9)
    nodes[2] = replace(nodes[2], flops=nodes[2].flops / 15)  # a step of 1.5 periods
    p = Problem(nodes, blocks(), **SETTINGS)
    layouts = [fixed_layout(p, (i,), (0, 4)) for i in range(3)]
    linked = link_every_of(p, layouts, Averaging(pace="rate"))
    assert linked is not None and linked.every == (1, 1, 2)
    averaging = paced(p, layouts, linked)
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=[n], cuts=[]) for n in names],
                averaging=averaging_config(averaging))
    settings = averaging_settings(Settings(steps=400, micro_batch=4, sync_every=10), plan.averaging)
    simulated = simulate(build_world(plan, nodes, blocks(), settings)).samples_per_s
    assert score_with(p, layouts, averaging) == pytest.approx(simulated, rel=0.15)
