"""What a PC owner does, with real processes under a systemd-style supervisor (issue #27): stop one
node or all of them, a power cut, a holder killed during a catch-up, another run's checkpoints.

Nothing here times wall-clock durations: a leave is recognised by its reason (``left``, never
``lost``), a prompt stop by the node's own account of how it ended (``left``, not the drain limit).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ravq.persist import checkpoint
from ravq.persist.lineage import Point, consistent_choice
from tests.swarm import Swarm, export, local_topology
from tests.test_churn import HEARTBEAT_S, LOST_S, Watch, _cluster, _training, _version

pytestmark = [pytest.mark.multiprocess, pytest.mark.fault]


def _topology(tmp: Path, clusters: list[int], steps: int = 100000, **timeouts: float) -> dict[str, Any]:
    training = {"steps": steps, "micro_batch": 4, "sync_every": 5, "checkpoint_every": 20,
                "checkpoint_dir": str(tmp / "ckpt")}
    topo = local_topology("tests.churn_task", clusters, training,
                          timeouts={"heartbeat_interval_s": HEARTBEAT_S, "lost_s": LOST_S, "ring_step_s": 5.0,
                                    "connect_s": 120.0, "request_s": 3.0, **timeouts})
    return topo  # no broker.state_dir, as a user's first topology: the broker keeps the run next to ckpt/


def _stop(swarm: Swarm, names: list[str]) -> dict[str, float]:
    """SIGTERM ``names`` at once (systemctl stop); every one must exit 0 having *left*; returns each one's
    seconds from the signal to its exit (reported by the benchmark, never asserted here)."""
    t0 = time.monotonic()
    for n in names:
        swarm.nodes[n].send_signal(signal.SIGTERM)
    took = {}
    for n in names:
        code = swarm.nodes[n].wait(120)  # a deadline against hanging, not a measurement
        took[n] = time.monotonic() - t0
        assert code == 0, swarm.log(n)
        assert swarm.summary(n)["ended"] == "left", swarm.summary(n)["ended"]
        assert "stop limit" not in swarm.log(n) and "drain limit" not in swarm.log(n), swarm.log(n)
    return took


def _resumed_at(swarm: Swarm, name: str) -> tuple[int, str]:
    """The version and run of the last "resumed at" line in a node's log (appended across restarts)."""
    text = (swarm.tmp / f"{name}.log").read_text(errors="replace")
    found = re.findall(r"resumed at version (\d+) \(run (\S+)\)", text)
    assert found, swarm.log(name)
    return int(found[-1][0]), found[-1][1]


def _consistent(ckpt: Path, cluster: int, stages: int, run_id: str) -> list[int]:
    """The versions the stages of a cluster must resume from: the newest set that coexisted."""
    metas = [[m for m in checkpoint.stage_metas(ckpt, cluster, s) if m.get("run_id") == run_id] for s in range(stages)]
    choice = consistent_choice([[Point.of(m) for m in ms] for ms in metas])
    assert choice is not None, metas
    return [metas[s][i]["version"] for s, i in enumerate(choice)]


def _all_training(watch: Watch, swarm: Swarm, generation: int, above: dict[str, int]) -> None:
    watch.until("every cluster training", lambda s: all(_training(s, c, generation) for c in (0, 1))
                and all(_version(s, n) > v for n, v in above.items()), 180, list(swarm.nodes))


def test_stop_all_then_a_power_cut_resume_the_same_run(tmp_path: Path) -> None:
    """2x2: systemctl stop of every node (each leaves with a final checkpoint, none waits for drain_s),
    start them again (each resumes from its checkpoint); then a power cut (kill -9 of the broker and
    every node) and a restart of all: the same run goes on from the newest consistent checkpoints, and
    the model exported after the cut is exactly what those checkpoints hold.  The topology names no
    broker.state_dir (issue #41: every node refused the new run the restarted broker started)."""
    swarm = Swarm(tmp_path, _topology(tmp_path, [2, 2]))
    watch = Watch(swarm)
    ckpt = tmp_path / "ckpt"
    try:
        _all_training(watch, swarm, 0, {n: 40 for n in swarm.nodes})
        run_id = (watch.poll() or {})["run_id"]
        took = _stop(swarm, list(swarm.nodes))
        (tmp_path / "stop-all.json").write_text(json.dumps(took))
        stopped = {n: json.loads((ckpt / f"cluster{n[1]}" / f"stage{n[3]}.json").read_text()) for n in swarm.nodes}
        assert all(m["run_id"] == run_id for m in stopped.values())
        for n in swarm.nodes:
            swarm.start(n)
        _all_training(watch, swarm, 1, {n: m["version"] for n, m in stopped.items()})
        for n, meta in stopped.items():
            assert _resumed_at(swarm, n) == (meta["version"], run_id)
        # the power cut
        for proc in [swarm.broker, *swarm.nodes.values()]:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        want = {c: _consistent(ckpt, c, 2, run_id) for c in (0, 1)}
        for c in (0, 1):
            exported = export(ckpt, c, tmp_path / f"cut{c}.safetensors")  # what `ravq export --cluster c` writes
            held = {k: v for s in (0, 1) for k, v in checkpoint.load_stage(ckpt, c, s, run_id, want[c][s]).model.items()}
            assert exported.keys() == held.keys()
            for name, value in held.items():
                assert torch.equal(exported[name], value), name
        swarm.restart_broker()
        for n in swarm.nodes:
            swarm.start(n)
        first: dict[str, int] = {}

        def resumed(status: dict[str, Any]) -> bool:
            for n, m in status.get("members", {}).items():
                if n not in first and m.get("state") == "up" and m.get("stats"):
                    first[n] = _version(status, n)  # what the node reported first after its restart
            return len(first) == len(swarm.nodes)

        watch.until("every node reporting", resumed, 180, list(swarm.nodes))
        _all_training(watch, swarm, 0, {n: want[int(n[1])][int(n[3])] for n in swarm.nodes})
        assert (watch.poll() or {})["run_id"] == run_id, "a power cut started a new run"
        for n in swarm.nodes:
            version = want[int(n[1])][int(n[3])]
            assert _resumed_at(swarm, n) == (version, run_id)
            assert first[n] >= version, (n, first[n], version)  # never 0 after a restart
        _stop(swarm, list(swarm.nodes))
    finally:
        swarm.close()


def test_a_clean_stop_pauses_the_cluster_at_once_and_a_standby_takes_the_stage(tmp_path: Path) -> None:
    """2x2 and a standby: SIGTERM one node: its cluster pauses because it *left* (not after lost_s), the
    standby takes its stage and the cluster trains again; the node, started again, stands by and takes
    the stage of the next node that leaves."""
    from ravq.cli.main import plan_for
    from ravq.config import load_topology

    topo = _topology(tmp_path, [3, 2], replace_s=2.0)
    topo["nodes"][2]["name"] = "spare"
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "t.yaml").write_text(json.dumps({**topo, "nodes": [n for n in topo["nodes"]
                                                                              if n["name"] != "spare"]}))
    plan = plan_for(load_topology(tmp_path / "probe" / "t.yaml"), None).model_dump()
    swarm = Swarm(tmp_path, topo, plan=plan)
    watch = Watch(swarm)
    try:
        trained = [n for n in swarm.nodes if n != "spare"]
        watch.until("training", lambda s: all(_version(s, n) > 20 for n in trained), 120, list(swarm.nodes))
        _stop(swarm, ["c0s1"])
        others = [n for n in swarm.nodes if n != "c0s1"]
        watch.until("the standby to take c0s1's stage", lambda s: "spare" in s["plan"]["clusters"][0]["nodes"],
                    LOST_S + 60, others)
        watch.until("cluster 0 to train with the standby", lambda s: _training(s, 0, 1) and _version(s, "spare") > 0,
                    120, others)
        broker = swarm.log("broker")
        assert "cluster 0 paused (generation 1): c0s1 left" in (tmp_path / "broker.log").read_text()
        assert "c0s1 silent" not in (tmp_path / "broker.log").read_text(), broker
        swarm.start("c0s1")  # back after its upgrade: its stage is taken, so it stands by
        watch.until("c0s1 standing by", lambda s: s["members"].get("c0s1", {}).get("phase") == "standby", 120,
                    list(swarm.nodes))
        _stop(swarm, ["c1s1"])
        rest = [n for n in swarm.nodes if n != "c1s1"]
        watch.until("c0s1 to take c1s1's stage", lambda s: "c0s1" in s["plan"]["clusters"][1]["nodes"], 60, rest)
        watch.until("cluster 1 to train with it", lambda s: _training(s, 1, 1) and _version(s, "c0s1") > 0, 120, rest)
        assert "cluster 1 paused (generation 1): c1s1 left" in (tmp_path / "broker.log").read_text()
        _stop(swarm, rest)
    finally:
        swarm.close()


def test_a_holder_killed_during_a_catch_up_never_sends_weights_backwards(tmp_path: Path) -> None:
    """2x2: c0s1 is armed to die when asked for a catch-up; c1s1 restarts from nothing (its disk lost)
    and asks it: the catch-up fails, c1s1 keeps what it has and its cluster trains on (slowly).  Then
    c0s1 comes back with its checkpoint, far newer than c1s1's weights: it keeps its own, and cluster
    0's status says so.  No stage of any cluster ends at an older version than it had."""
    swarm = Swarm(tmp_path, _topology(tmp_path, [2, 2]))
    watch = Watch(swarm)
    ckpt = tmp_path / "ckpt"
    try:
        _all_training(watch, swarm, 0, {n: 300 for n in swarm.nodes})
        swarm.nodes["c0s1"].send_signal(signal.SIGKILL)
        swarm.nodes["c0s1"].wait(10)
        swarm.faults["c0s1"] = "kill_in_catchup"
        swarm.start("c0s1")
        watch.until("cluster 0 back", lambda s: _training(s, 0, 1) and _version(s, "c0s1") > 300, 180,
                    list(swarm.nodes))
        watch.until("a checkpoint of c0s1 past 300", lambda s: checkpoint.load_stage(ckpt, 0, 1).meta["version"] > 300,
                    60, list(swarm.nodes))
        swarm.nodes["c1s1"].send_signal(signal.SIGKILL)
        swarm.nodes["c1s1"].wait(10)
        for p in (ckpt / "cluster1").glob("stage1*"):
            p.unlink()
        swarm.env["c1s1"] = {"CHURN_TASK_PAUSE_S": "0.5"}  # cluster 1 trains at 2 steps/s from now on
        swarm.start("c1s1")
        swarm.nodes["c0s1"].wait(180)  # the holder died in the middle of c1s1's catch-up
        survivors = ["c0s0", "c1s0", "c1s1"]
        watch.until("cluster 1 to train again", lambda s: _training(s, 1, 1) and _version(s, "c1s1") > 0, 120,
                    ["c0s0", "c1s0"])
        assert "catch-up from peers failed" in swarm.log("c1s1")
        watch.until("cluster 0 paused (c0s1 died)", lambda s: _cluster(s, 0).get("state") == "paused", 60, survivors)
        generation = _cluster(watch.samples[-1][1], 0)["generation"]
        swarm.faults.pop("c0s1")
        swarm.start("c0s1")
        watch.until("cluster 0 to train again", lambda s: _training(s, 0, generation) and _version(s, "c0s1") > 0,
                    180, survivors)
        resumed, _ = _resumed_at(swarm, "c0s1")
        status = watch.poll() or {}
        assert resumed > 300 and _version(status, "c0s1") >= resumed, (resumed, _version(status, "c0s1"))
        assert f"c0s1 kept its own weights (version {resumed})" in _cluster(status, 0).get("note", ""), status
        # survivors' versions never went down, whatever their cluster caught up from
        for name in ("c0s0", "c1s0"):
            seen = [_version(s, name) for _, s in watch.samples if name in s.get("members", {})]
            assert seen == sorted(seen), (name, seen)
        _stop(swarm, list(swarm.nodes))
    finally:
        swarm.close()


def test_a_checkpoint_directory_of_another_run_is_refused_in_one_line(tmp_path: Path) -> None:
    """1x2: train a little under run A; a broker with a new state directory (run B) over the same
    checkpoints: every node refuses to start, in one line, and nothing is overwritten; `--new-run`
    then sets run A's checkpoints aside and trains run B."""
    topo = _topology(tmp_path, [2])
    (tmp_path / "a").mkdir()
    swarm = Swarm(tmp_path / "a", topo)
    watch = Watch(swarm)
    ckpt = tmp_path / "ckpt"
    try:
        watch.until("run A saves", lambda s: all(_version(s, n) > 40 for n in swarm.nodes), 120, list(swarm.nodes))
        run_a = (watch.poll() or {})["run_id"]
        _stop(swarm, list(swarm.nodes))
    finally:
        swarm.close()
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    topo["broker"]["state_dir"] = str(tmp_path / "other-broker")
    (tmp_path / "b").mkdir()
    swarm = Swarm(tmp_path / "b", topo)
    try:
        codes = swarm.wait(timeout_s=180)
        assert codes == {"c0s0": 2, "c0s1": 2}, codes
        for n in swarm.nodes:
            last = swarm.log(n).strip().splitlines()[-1]
            assert last.startswith(f"ravq node: {n}: ") and f"checkpoints of run {run_a}, but the broker runs" in last
            assert "Traceback" not in swarm.log(n)
        assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    finally:
        swarm.close()
    (tmp_path / "c").mkdir()
    swarm = Swarm(tmp_path / "c", topo, broker_args=["--new-run"])
    try:
        watch = Watch(swarm)
        watch.until("run B trains", lambda s: all(_version(s, n) > 0 for n in swarm.nodes), 180, list(swarm.nodes))
        run_b = (watch.poll() or {})["run_id"]
        assert run_b != run_a
        assert (ckpt / "cluster0" / f"run-{run_a}" / "stage0.json").exists()
        assert "set aside" in swarm.log("c0s0")
    finally:
        swarm.close()
