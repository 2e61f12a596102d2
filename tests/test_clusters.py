"""Several clusters: multi-ring averaging across real processes, synchronous equivalence, failures."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests import models_for_tests as skipnet
from tests import sgd_task
from tests.pipeline_harness import train_one_process
from tests.swarm import Swarm, assert_clusters_equal, local_topology, train

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("task,average_state", [(sgd_task, False), (skipnet, True)], ids=["sgd", "momentum"])
def test_uneven_clusters_sync_equal_one_process_on_both_shards(tmp_path: Path, task: Any,
                                                               average_state: bool) -> None:
    """2 stages beside 3 stages (different cut points), max_inflight 1, sync_every 1: every cluster ends
    with the weights of one process training on both clusters' micro-batches (mean loss).  Plain SGD
    needs only the weights averaged; SGD with momentum also needs its optimizer state averaged."""
    ckpt = tmp_path / "ckpt"
    training = {"steps": 20, "micro_batch": 4, "max_inflight": 1, "sync_every": 1, "overlap_averaging": False,
                "checkpoint_dir": str(ckpt), "average_optimizer_state": average_state}
    swarm = train(tmp_path, local_topology(task.__name__, [2, 3], training), timeout_s=240)
    want = train_one_process(task, steps=20, micro_batch=4, shards=2)
    assert_clusters_equal(ckpt, 2, want, tmp_path, same_names=False)
    rounds = [swarm.summary(n)["allreduce_rounds"] for n in swarm.nodes]
    assert all(r == 20 for r in rounds), rounds


def test_ring_bytes_are_bandwidth_optimal(tmp_path: Path) -> None:
    """Through the byte counters: each node sends 2(C-1)/C of its segments' bytes per round (+ headers)."""
    training = {"steps": 40, "micro_batch": 8, "sync_every": 4}
    swarm = Swarm(tmp_path, local_topology("ravq.tasks.charlm", [1, 1, 1], training,
                                           timeouts={"connect_s": 180}))
    try:
        codes = swarm.wait()
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    finally:
        swarm.close()
    for name in swarm.nodes:
        s = swarm.summary(name)
        assert s["allreduce_rounds"] == 10 and s["ring_size"] == 3
        expected = 2 * (3 - 1) / 3 * s["segment_bytes"] * s["allreduce_rounds"]
        assert expected <= s["ring_bytes_sent"] <= expected * 1.02, (name, s["ring_bytes_sent"], expected)


def test_killed_node_mid_round_aborts_round_and_survivors_finish(tmp_path: Path) -> None:
    """A node dies mid-round and stays dead: the round aborts, the other clusters train on and finish,
    and the dead node's pipeline neighbour pauses (it does not exit) until told to stop."""
    training = {"steps": 600, "micro_batch": 4, "sync_every": 2}
    # (the throttled task: the survivors, which never wait for the dead ring member, would otherwise finish
    # before the broker even declares it lost)
    topo = local_topology("tests.churn_task", [1, 1, 2], training,
                          timeouts={"ring_step_s": 2.0, "heartbeat_interval_s": 0.3, "lost_s": 4.0})
    swarm = Swarm(tmp_path, topo, faults={"c2s1": "kill_in_round:10"})
    try:
        codes = swarm.wait(["c0s0", "c1s0"], timeout_s=180)
        assert codes == {"c0s0": 0, "c1s0": 0}, {n: swarm.log(n) for n in codes}
        assert swarm.nodes["c2s1"].wait(5) == -9  # it really died, mid-round
        assert swarm.nodes["c2s0"].poll() is None, swarm.log("c2s0")  # paused, waiting for its neighbour
        assert "cluster 2 paused" in swarm.log("c2s0")
        swarm.nodes["c2s0"].send_signal(signal.SIGTERM)
        assert swarm.wait(["c2s0"], timeout_s=60) == {"c2s0": 0}
    finally:
        swarm.close()
    for name in ("c0s0", "c1s0"):
        s = swarm.summary(name)
        assert s["trained"] == 600, s  # (backwards may count more: work dropped at a pause is redone)
        assert s["allreduce_aborts"] >= 1, s
        # rounds before the kill, and rounds between the two survivors after the broker dropped cluster 2
        assert s["allreduce_rounds"] > 50, s
        assert s["final_round"], s  # a cluster was disrupted: the survivors agree once more at the end
    assert "rings now exclude clusters [2]" in swarm.log("broker")
