"""Nodes behind NAT (issue #24) on one machine: declared ``reachable: false`` makes the links reverse
(the node behind NAT dials out) or go through the broker's relay, with the same wire; training must
give exactly what it gives with open ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ravq.cli.demo import free_ports
from ravq.net.security import keygen
from tests import sgd_task
from tests.pipeline_harness import train_one_process
from tests.swarm import assert_clusters_equal, local_topology, train

pytestmark = pytest.mark.multiprocess

BEHIND_NAT = ("c0s1", "c1s0", "c1s1")
"""c0s0 is the one reachable node: c0s0-c0s1 and c0s0-c1s0 are dialled from behind NAT, c1s0-c1s1
(pipeline) and c0s1-c1s1 (ring) go through the relay."""


def nat_topology(training: dict[str, Any], key_dir: Path | None = None) -> dict[str, Any]:
    """The 2x2 swarm with ``BEHIND_NAT`` declared unreachable and the broker relaying; with ``key_dir``,
    CURVE on every socket (keys made there)."""
    topo = local_topology(sgd_task.__name__, [2, 2], training)
    topo["broker"]["relay_port"] = free_ports(1)[0]
    for node in topo["nodes"]:
        if node["name"] in BEHIND_NAT:
            node["reachable"] = False
    if key_dir is not None:
        topo["security"] = {"curve": True, "key_dir": str(key_dir)}
        topo["broker"]["public_key"] = keygen("broker", key_dir)
        for node in topo["nodes"]:
            node["public_key"] = keygen(node["name"], key_dir)
    return topo


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_behind_nat_sync_training_equals_one_process(tmp_path: Path, curve: bool) -> None:
    """max_inflight 1, sync_every 1: the weights are those of one process on both clusters' data, so
    every message went through, once, intact (under CURVE too: the dialled connections pin the peer's key,
    the relay's both hops are CURVE)."""
    ckpt = tmp_path / "ckpt"
    training = {"steps": 12, "micro_batch": 4, "max_inflight": 1, "sync_every": 1, "overlap_averaging": False,
                "checkpoint_dir": str(ckpt)}
    swarm = train(tmp_path, nat_topology(training, tmp_path / "keys" if curve else None), timeout_s=240)
    want = train_one_process(sgd_task, steps=12, micro_batch=4, shards=2)
    assert_clusters_equal(ckpt, 2, want, tmp_path, same_names=False)
    routes = {n: swarm.summary(n)["routes"] for n in swarm.nodes}
    assert routes["c0s0"]["pipeline"]["c0s1"] == "accept" and routes["c0s1"]["pipeline"]["c0s0"] == "dial"
    assert routes["c1s0"]["pipeline"]["c1s1"] == "relay:broker" == routes["c1s1"]["pipeline"]["c1s0"]
    assert routes["c0s0"]["ring"]["c1s0"] == "accept" and routes["c1s0"]["ring"]["c0s0"] == "dial"
    assert routes["c0s1"]["ring"]["c1s1"] == "relay:broker"
    assert all(swarm.summary(n)["allreduce_rounds"] == 12 for n in swarm.nodes)
    assert all(swarm.summary(n)["bad_messages"] == 0 for n in swarm.nodes)


@pytest.mark.fault
@pytest.mark.timeout(900)
@pytest.mark.parametrize("victim", ["c1s1", "c0s1"], ids=["relayed", "dialling"])
def test_a_node_behind_nat_killed_and_restarted_rejoins(tmp_path: Path, victim: str) -> None:
    """kill -9 of a node behind NAT, then a restart (a new process: new source ports, as a new NAT
    mapping gives): it dials out again (to its peer, or to the relay), nothing waits to dial it; its
    cluster pauses, resumes once it is back, and every process ends training with exit status 0.
    Asserted on the broker's events (generation, state, the node's version), not on durations."""
    from tests.test_churn import (
        HEARTBEAT_S,
        LOST_S,
        Watch,
        _cluster,
        _training,
        _version,
        throttled_swarm,
        unthrottle,
    )

    # throttled to 20 micro-batches/s until the victim is back: the other cluster trains for 30 s or more
    training = {"steps": 600, "micro_batch": 4, "sync_every": 5, "checkpoint_every": 40,
                "checkpoint_dir": str(tmp_path / "ckpt")}
    topo = nat_topology(training)
    topo["task"] = "tests.churn_task"
    topo["timeouts"] = {"heartbeat_interval_s": HEARTBEAT_S, "lost_s": LOST_S, "ring_step_s": 5.0}
    swarm = throttled_swarm(tmp_path, topo)
    hit = int(victim[1])
    others = [n for n in swarm.nodes if n != victim and n[1] == victim[1]]  # the other cluster may finish first
    try:
        watch = Watch(swarm)
        watch.until("training", lambda s: _training(s, hit, 0) and _version(s, victim) > 5, 300, list(swarm.nodes))
        generation = _cluster(watch.poll() or {}, hit).get("generation", 0)
        swarm.nodes[victim].kill()
        swarm.nodes[victim].wait(10)
        watch.until(f"cluster {hit} to pause", lambda s: _cluster(s, hit).get("generation", 0) > generation, 60, others)
        swarm.start(victim)
        watch.until(f"{victim} to be measured again and its cluster to train",
                    lambda s: s.get("reach", {}).get(victim) == "behind_nat" and _training(s, hit, generation + 1)
                    and _version(s, victim) > 0 and s["members"][victim]["state"] == "up", 400, others)
        unthrottle(swarm)  # what follows only has to end well, not take its time
        codes = swarm.wait(timeout_s=600)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    finally:
        swarm.close()
    routes = swarm.summary(victim)["routes"]
    assert routes["pipeline"] == ({"c1s0": "relay:broker"} if victim == "c1s1" else {"c0s0": "dial"})
    assert routes["ring"]["c0s0"] == "dial" and routes["ring"]["c0s1" if victim == "c1s1" else "c1s1"] == "relay:broker"
    assert all(swarm.summary(n)["final_round"] for n in swarm.nodes)
