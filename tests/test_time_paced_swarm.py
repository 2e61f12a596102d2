"""Rounds paced by time across real processes (issue #38): three one-stage clusters the plan says train alike,
one of them really at half speed.  Counted in steps it would hold the other two to its pace; by time
(``averaging.period_s``) each trains at its own, and every round falls due on all three together from the
broker's stamp of the plan epoch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.swarm import Swarm, local_topology

pytestmark = pytest.mark.multiprocess

NODES = ["c0s0", "c1s0", "c2s0"]
STEPS = 400
PERIOD_S = 1.0


def test_clusters_paced_by_time_average_together_each_at_its_own_rate(tmp_path: Path) -> None:
    training = {"steps": STEPS, "micro_batch": 4, "sync_every": 40}
    averaging = {"mode": "global", "pace": "rate", "rates": [1.0, 1.0, 1.0], "period_s": PERIOD_S}
    topo = local_topology("tests.churn_task", [1, 1, 1], training, averaging=averaging,
                          timeouts={"ring_step_s": 5.0, "heartbeat_interval_s": 0.3, "lost_s": 4.0})
    swarm = Swarm(tmp_path, topo, env={"c2s0": {"CHURN_TASK_PAUSE_S": str(1 / 30)}})
    try:
        codes = swarm.wait(NODES, timeout_s=300)
        assert codes == dict.fromkeys(NODES, 0), {n: swarm.log(n) for n in codes}
    finally:
        swarm.close()
    s = {n: swarm.summary(n) for n in NODES}
    assert all(s[n]["trained"] == STEPS for n in NODES), s
    # not held to c2's pace (counted in steps all three end within 2% of each other); a fast cluster may wait
    # up to ring_step_s at its end for a round the other fast one, done, never ran
    fast = min(s[n]["wall_s"] for n in NODES[:2])
    assert fast < 0.6 * s["c2s0"]["wall_s"], {n: s[n]["wall_s"] for n in NODES}
    for n in NODES[:2]:  # a round each period while they train, a couple lost to start-up and the end at most
        assert s[n]["allreduce_rounds"] >= 0.6 * fast / PERIOD_S - 2, s[n]
        assert s[n]["allreduce_aborts"] <= 3, s[n]
