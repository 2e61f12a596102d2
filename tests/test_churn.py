"""Churn with real processes: kill -9, SIGSTOP, broker restarts; the swarm recovers by itself.

Each test runs one swarm through several faults in a row (to keep the suite short) and checks after
each: the loss is detected within ``lost_s`` (plus one broker check period and one status poll); no
other process exited; the other cluster never stalled for more than two heartbeats; the hit cluster
trains again within 30 s of the restart.  At the end: every process exited 0, all clusters' weights
agree after the final averaging round, every checkpoint loads, and no micro-batch was trained twice
or skipped by a stage 0 that survived.  The task is throttled (``tests.churn_task``) so that a run outlasts
its faults on a loaded machine; once the last fault is over the throttle is lifted and the rest of the
steps train at full speed.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ravq.persist import checkpoint
from tests.swarm import Swarm, export, local_topology

pytestmark = [pytest.mark.multiprocess, pytest.mark.fault]

HEARTBEAT_S = 1.0
LOST_S = 4.0
RESTART_AFTER_S = 3.0
BACK_WITHIN_S = 30.0
PAUSE_S = 0.05
STEPS = 1800
"""While its faults go on a swarm trains at most 1 / PAUSE_S = 20 micro-batches/s (``tests.churn_task``'s
loss sleeps), so STEPS last at least 90 s: the faults take 30-45 s on a quiet 2-core machine, and a loaded
one only trains slower.  Once they are over the throttle is lifted and the rest of the steps train as fast
as the machine can (65-180/s here): the budget is sized for a slow machine, not waited out."""
UNTHROTTLED = "unthrottled"
"""The file (in a test's directory) whose existence lifts the throttle."""


def throttled_swarm(tmp: Path, topology: dict[str, Any], **kwargs: Any) -> Swarm:
    """A swarm of ``tests.churn_task`` throttled to 1 / PAUSE_S micro-batches/s until ``unthrottle``, on every
    node (restarts included)."""
    env = {"CHURN_TASK_PAUSE_S": str(PAUSE_S), "CHURN_TASK_UNTHROTTLED_IF": str(tmp / UNTHROTTLED)}
    return Swarm(tmp, topology, env={node["name"]: dict(env) for node in topology["nodes"]}, **kwargs)


def unthrottle(swarm: Swarm) -> None:
    """The faults are over: the rest of the steps only have to be trained, as fast as the machine can."""
    (swarm.tmp / UNTHROTTLED).touch()


@dataclass
class Watch:
    """Polls the broker's status and remembers what it saw."""

    swarm: Swarm
    samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def poll(self) -> dict[str, Any] | None:
        status = self.swarm.status()
        if status is not None:
            self.samples.append((time.time(), status))
        return status

    def until(self, what: str, check: Any, timeout_s: float, alive: list[str]) -> float:
        """Poll until ``check(status)``; returns the wall time it first held.  Fails if a process in
        ``alive`` exited meanwhile (no node but the hit one may exit)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            exited = {n: self.swarm.nodes[n].poll() for n in alive if self.swarm.nodes[n].poll() is not None}
            assert not exited, f"{exited} exited while waiting for {what}:\n" + "\n".join(
                self.swarm.log(n) for n in exited)
            status = self.poll()
            if status is not None and check(status):
                return time.time()
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status: {self.samples[-1:] or None}")


def _cluster(status: dict[str, Any], c: int) -> dict[str, Any]:
    clusters = status.get("clusters") or []
    return clusters[c] if c < len(clusters) else {}


def _version(status: dict[str, Any], node: str) -> int:
    return int(status.get("members", {}).get(node, {}).get("stats", {}).get("version", 0))


def _reboot_with_the_broker(swarm: Swarm, node: str) -> None:
    """The broker's PC loses power with ``node`` on it: both killed, then started again."""
    for proc in (swarm.broker, swarm.nodes[node]):
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    swarm.restart_broker()
    swarm.start(node)


def _stats(status: dict[str, Any], node: str) -> dict[str, Any]:
    return dict(status.get("members", {}).get(node, {}).get("stats", {}))


def _training(status: dict[str, Any], c: int, generation: int) -> bool:
    cs = _cluster(status, c)
    return cs.get("state") == "training" and cs.get("generation", 0) >= generation


def _kill_and_restart(swarm: Swarm, watch: Watch, victim: str, hit: int, how: str = "kill") -> dict[str, float]:
    """Kill (or freeze) ``victim`` of cluster ``hit``, bring it back, wait until its cluster trains
    again; returns the times of each phase."""
    others = [n for n in swarm.nodes if n != victim]
    before = watch.poll() or {}
    generation = _cluster(before, hit).get("generation", 0)
    t_fault = time.time()
    if how == "kill":
        swarm.nodes[victim].send_signal(signal.SIGKILL)
        swarm.nodes[victim].wait(10)
    else:
        swarm.nodes[victim].send_signal(signal.SIGSTOP)
    t_detect = watch.until(f"cluster {hit} to pause", lambda s: _cluster(s, hit).get("generation", 0) > generation,
                           LOST_S + 3 * HEARTBEAT_S + 5, others)
    assert t_detect - t_fault <= LOST_S + 2 * HEARTBEAT_S, f"loss of {victim} seen after {t_detect - t_fault:.1f}s"
    hold = RESTART_AFTER_S if how == "kill" else float(how.split(":")[1])
    time.sleep(max(0.0, t_fault + hold - time.time()))
    t_back_start = time.time()
    if how == "kill":
        swarm.start(victim)
    else:
        swarm.nodes[victim].send_signal(signal.SIGCONT)
    version = _version(watch.poll() or {}, victim) if how != "kill" else 0
    t_trains = watch.until(f"cluster {hit} to train again",
                           lambda s: _training(s, hit, generation + 1) and _version(s, victim) > version,
                           BACK_WITHIN_S + 30, others)
    assert t_trains - t_back_start <= BACK_WITHIN_S, f"{victim}'s cluster trained again only after " \
                                                     f"{t_trains - t_back_start:.1f}s"
    return {"fault": t_fault, "detect": t_detect, "back": t_back_start, "trains": t_trains}


def _max_gap(times: list[float], start: float, end: float) -> float:
    inside = [t for t in times if start <= t <= end]
    if not inside:
        return math.inf
    points = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(points))


def _final_checks(tmp_path: Path, swarm: Swarm, ckpt: Path, clusters: list[int], steps: int,
                  events: list[tuple[int, dict[str, float]]], survivors0: list[str]) -> None:
    codes = swarm.wait(timeout_s=240)
    assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    # the other cluster never stalled for more than two heartbeats while one was hit
    for hit, t in events:
        for name in swarm.nodes:
            if not name.startswith(f"c{hit}"):
                times = swarm.summary(name)["update_times"]
                if not times or times[0] > t["fault"]:
                    continue  # this process started later (it was hit itself afterwards)
                gap = _max_gap(times, t["fault"], t["trains"])
                assert gap <= 2 * HEARTBEAT_S, f"{name} stalled {gap:.2f}s while cluster {hit} recovered"
    # every checkpoint loads (a save killed midway cost at most that save) and no temporary file is left:
    # a restarted node removes what its killed save left behind
    left = sorted(p.name for p in ckpt.rglob(".stage*.tmp*"))
    assert not left, left
    exported = []
    for c in range(len(clusters)):
        for s in range(clusters[c]):
            checkpoint.load_stage(ckpt, c, s)
        exported.append(export(ckpt, c, tmp_path / f"c{c}.safetensors"))  # what `ravq export --cluster c` writes
    assert all(swarm.summary(n)["final_round"] for n in swarm.nodes), "a node skipped the final round"
    for name, value in exported[0].items():
        torch.testing.assert_close(exported[1][name], value, rtol=0, atol=1e-5, msg=name)
    # data: a stage 0 that survived trained every micro-batch exactly once
    for name in survivors0:
        done = swarm.summary(name)["completed"]
        assert sorted(done) == list(range(steps)), (name, len(done), len(set(done)))


def _topology(clusters: list[int], steps: int, ckpt: Path, checkpoint_every: int = 40,
              **timeouts: float) -> dict[str, Any]:
    training = {"steps": steps, "micro_batch": 4, "sync_every": 5, "checkpoint_every": checkpoint_every,
                "checkpoint_dir": str(ckpt)}
    topo = local_topology("tests.churn_task", clusters, training,
                          timeouts={"heartbeat_interval_s": HEARTBEAT_S, "lost_s": LOST_S, "ring_step_s": 5.0,
                                    "connect_s": 120.0, **timeouts})
    topo["broker"]["state_dir"] = str(ckpt.parent / "broker")  # a restarted broker continues the run
    return topo


def test_kill_first_middle_and_last_stage_and_restart(tmp_path: Path) -> None:
    """2 clusters x 3 stages: kill -9 the first stage of cluster 1, the middle one of cluster 0 and the
    last one of cluster 1 in turn, each restarted 3 s later (as systemd would).  Every stage saves a
    checkpoint every 2 steps (several times a second), so kills also land in checkpoint saves."""
    ckpt = tmp_path / "ckpt"
    steps = STEPS
    swarm = throttled_swarm(tmp_path, _topology([3, 3], steps, ckpt, checkpoint_every=2))
    watch = Watch(swarm)
    events = []
    try:
        watch.until("training", lambda s: all(_version(s, n) > 20 for n in swarm.nodes), 120, list(swarm.nodes))
        for victim in ("c1s0", "c0s1", "c1s2"):
            hit = int(victim[1])
            events.append((hit, _kill_and_restart(swarm, watch, victim, hit)))
        unthrottle(swarm)
        _final_checks(tmp_path, swarm, ckpt, [3, 3], steps, events, survivors0=["c0s0"])
    finally:
        swarm.close()
    assert "restarted" in swarm.log("broker")


def test_freeze_broker_restart_and_a_kill_while_the_broker_is_down(tmp_path: Path) -> None:
    """2 clusters x 2 stages: SIGSTOP a stage for 20 s (longer than ring_step_s) then SIGCONT; then kill
    the broker, kill -9 a node while it is down, restart the broker after 3 s and the node after 5 s."""
    ckpt = tmp_path / "ckpt"
    steps = STEPS
    swarm = throttled_swarm(tmp_path, _topology([2, 2], steps, ckpt))
    watch = Watch(swarm)
    events = []
    try:
        watch.until("training", lambda s: all(_version(s, n) > 20 for n in swarm.nodes), 120, list(swarm.nodes))
        events.append((1, _kill_and_restart(swarm, watch, "c1s1", 1, how="freeze:20")))
        # the broker goes; training goes on; a node dies meanwhile
        swarm.broker.send_signal(signal.SIGKILL)
        swarm.broker.wait(10)
        t_fault = time.time()
        time.sleep(1.0)
        swarm.nodes["c0s1"].send_signal(signal.SIGKILL)
        swarm.nodes["c0s1"].wait(10)
        time.sleep(2.0)
        swarm.restart_broker()
        others = [n for n in swarm.nodes if n != "c0s1"]
        # timed from when the new broker answers: how long a Python process takes to start is the
        # machine's load (18.5 s after the fault once, beside another test suite), not ravq's detection
        t_up = watch.until("the new broker to answer", lambda s: True, 60, others)
        t_detect = watch.until("the new broker to see cluster 0 paused",
                               lambda s: _cluster(s, 0).get("state") in ("paused", "recovering"), 60, others)
        time.sleep(max(0.0, t_fault + 5.0 - time.time()))
        t_back = time.time()
        swarm.start("c0s1")
        t_trains = watch.until("cluster 0 to train again",
                               lambda s: _training(s, 0, 1) and _version(s, "c0s1") > 0, 60, others)
        assert t_trains - t_back <= BACK_WITHIN_S
        assert t_detect - t_up <= LOST_S + 2 * HEARTBEAT_S + 3, f"seen {t_detect - t_up:.1f}s after the broker was up"
        events.append((0, {"fault": t_fault, "detect": t_detect, "back": t_back, "trains": t_trains}))
        unthrottle(swarm)
        _final_checks(tmp_path, swarm, ckpt, [2, 2], steps, events, survivors0=["c0s0", "c1s0"])
    finally:
        swarm.close()
    assert os.path.exists(tmp_path / "broker.log")


def test_a_node_that_registers_with_a_restarted_broker_before_its_live_peer_rejoins(tmp_path: Path) -> None:
    """The broker's PC reboots: the broker and that PC's node (stage 0) killed and started together while
    stage 1 lives on.  The node registers with the new broker before stage 1's first heartbeat reaches it
    (stage 1 frozen meanwhile, so that it does every time): the new broker, which knows nothing yet,
    answers that the cluster is starting, then rebuilds it from that heartbeat (paused, then recovering:
    the node restarted while it was down).  The node must join through that recovery, not wait as at a
    first start for reachability verdicts and registrations the live member never sends again (it stayed
    ``starting`` until connect_s, and its cluster ``recovering``)."""
    ckpt = tmp_path / "ckpt"
    swarm = throttled_swarm(tmp_path, _topology([2], STEPS, ckpt, checkpoint_every=5))
    watch = Watch(swarm)
    try:
        watch.until("training", lambda s: all(_version(s, n) > 10 for n in swarm.nodes), 120, list(swarm.nodes))
        swarm.nodes["c0s1"].send_signal(signal.SIGSTOP)  # its heartbeats reach the new broker only later
        before = _version(watch.poll() or {}, "c0s0")
        _reboot_with_the_broker(swarm, "c0s0")
        watch.until("c0s0 to register with the new broker",
                    lambda s: s.get("members", {}).get("c0s0", {}).get("state") == "up", 60, ["c0s0"])
        swarm.nodes["c0s1"].send_signal(signal.SIGCONT)
        watch.until("cluster 0 to train again", lambda s: _training(s, 0, 1) and _version(s, "c0s0") > before,
                    BACK_WITHIN_S + 15, list(swarm.nodes))
    finally:
        swarm.close()
    assert "restarted while the broker was down" in swarm.log("broker")
    assert "rejoining" in swarm.log("c0s0")


def test_a_whole_cluster_restarted_with_the_broker_trains_again(tmp_path: Path) -> None:
    """A site's power cut: the broker and all of cluster 0 killed and started together while cluster 1 lives
    on.  The new broker knows nothing of cluster 0 (no live member to rebuild it from), so its node starts
    as at a first start and waits for a reachability verdict on every member of the rings; cluster 1's
    node had one from the old broker and, asking again only at its own start, never sent the new one its
    request (cluster 0 stayed ``starting`` until connect_s).  A node now asks again while the broker's
    state has no verdict on it."""
    ckpt = tmp_path / "ckpt"
    swarm = throttled_swarm(tmp_path, _topology([1, 1], STEPS, ckpt, checkpoint_every=5))
    watch = Watch(swarm)
    try:
        watch.until("training", lambda s: all(_version(s, n) > 10 for n in swarm.nodes), 120, list(swarm.nodes))
        before = _version(watch.poll() or {}, "c0s0")
        _reboot_with_the_broker(swarm, "c0s0")
        watch.until("the new broker to hear cluster 1's verdict",
                    lambda s: s.get("reach", {}).get("c1s0") == "reachable", 60, list(swarm.nodes))
        watch.until("cluster 0 to train again", lambda s: _cluster(s, 0).get("state") == "training"
                    and _version(s, "c0s0") > before, BACK_WITHIN_S + 15, list(swarm.nodes))
        now = watch.poll() or {}
        watch.until("both clusters to train on, averaging together",
                    lambda s: all(_version(s, n) > _version(now, n) + 10 for n in swarm.nodes)
                    and all(_stats(s, n).get("allreduce_rounds", 0) > _stats(now, n).get("allreduce_rounds", 0)
                            for n in swarm.nodes), 60, list(swarm.nodes))
    finally:
        swarm.close()


def test_a_standby_takes_over_a_node_that_does_not_come_back(tmp_path: Path) -> None:
    """2 clusters x 2 stages and one node the plan leaves idle: kill -9 a stage for good; after
    lost_s + replace_s the standby takes its stage, catches up from the other cluster, and its cluster
    trains to the end; the clusters' weights agree after the final round."""
    from ravq.cli.main import plan_for
    from ravq.config import load_topology

    ckpt = tmp_path / "ckpt"
    steps = STEPS
    topo = _topology([3, 2], steps, ckpt, replace_s=2.0)
    topo["nodes"][2]["name"] = "spare"  # cluster 0's third node: idle in the plan below
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "t.yaml").write_text(yaml.safe_dump(
        {**topo, "nodes": [n for n in topo["nodes"] if n["name"] != "spare"]}))
    plan = plan_for(load_topology(tmp_path / "probe" / "t.yaml"), None).model_dump()
    swarm = throttled_swarm(tmp_path, topo, plan=plan)
    watch = Watch(swarm)
    try:
        trained = [n for n in swarm.nodes if n != "spare"]
        watch.until("training", lambda s: all(_version(s, n) > 20 for n in trained), 120, list(swarm.nodes))
        t_fault = time.time()
        swarm.nodes["c1s1"].send_signal(signal.SIGKILL)
        swarm.nodes["c1s1"].wait(10)
        others = [n for n in swarm.nodes if n != "c1s1"]
        watch.until("the standby to take over", lambda s: "spare" in s["plan"]["clusters"][1]["nodes"],
                    LOST_S + 2.0 + 30, others)
        t_trains = watch.until("cluster 1 to train again with the standby",
                               lambda s: _training(s, 1, 1) and _version(s, "spare") > 0, 60, others)
        unthrottle(swarm)
        codes = swarm.wait(others, timeout_s=240)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
        for name in ("c0s0", "c0s1"):
            times = swarm.summary(name)["update_times"]
            assert _max_gap(times, t_fault, t_trains) <= 2 * HEARTBEAT_S, name
        exported = []
        for c in (0, 1):
            exported.append(export(ckpt, c, tmp_path / f"c{c}.safetensors"))
        for name, value in exported[0].items():
            torch.testing.assert_close(exported[1][name], value, rtol=0, atol=1e-5, msg=name)
        assert sorted(swarm.summary("c1s0")["completed"]) == list(range(steps))
    finally:
        swarm.close()
    assert "standby spare takes over the stage of c1s1" in swarm.log("broker")
