"""``ravq.tasks.text`` on the shipped example with real processes: it trains and evaluates, survives a kill -9
of stage 0, and the restarted stage 0 opens its data at its checkpoint's position (issue #41)."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from tests.swarm import Swarm, local_topology

pytestmark = [pytest.mark.multiprocess, pytest.mark.fault]

STEPS = 120
SMALL = {"layers": 2, "hidden": 32, "heads": 2, "context": 32}
"""A smaller GPT-2 than the task's default: this checks the data path, not learning."""


def test_text_task_survives_a_kill_of_stage_0_and_resumes_at_its_data_position(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    training = {"steps": STEPS, "micro_batch": 4, "checkpoint_every": 5, "checkpoint_dir": str(ckpt),
                "eval_every": 5, "eval_batches": 2, "compress": {"pipeline": "none", "ring": "none"}}
    topo = local_topology("ravq.tasks.text", [2], training, task_options=SMALL,
                          timeouts={"heartbeat_interval_s": 1.0, "lost_s": 4.0, "connect_s": 120.0})
    swarm = Swarm(tmp_path, topo)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # past a few checkpoints, far from the end
            stats = ((swarm.status() or {}).get("members", {}).get("c0s0") or {}).get("stats", {})
            # a checkpoint is written off the compute thread: on a loaded machine version 15 can come first
            if stats.get("version", 0) >= 15 and (ckpt / "cluster0" / "stage0.json").exists():
                break
            assert swarm.nodes["c0s0"].poll() is None, swarm.log("c0s0")
            time.sleep(0.2)
        else:
            pytest.fail("stage 0 never reached version 15:\n" + swarm.log("c0s0"))
        swarm.nodes["c0s0"].send_signal(signal.SIGKILL)
        swarm.nodes["c0s0"].wait(10)
        killed_at = json.loads((ckpt / "cluster0" / "stage0.json").read_text())["data_position"]
        assert 0 < killed_at < STEPS
        swarm.start("c0s0")
        codes = swarm.wait(timeout_s=240)
        assert codes == {"c0s0": 0, "c0s1": 0}, {n: swarm.log(n) for n in codes}
    finally:
        swarm.close()
    log = (tmp_path / "c0s0.log").read_text(errors="replace")
    opened = [int(n) for n in re.findall(r"data opened at micro-batch (\d+)", log)]
    assert opened[0] == 0 and opened[-1] >= killed_at, opened  # the restart opened it at its checkpoint's
    resumed_at = opened[-1]
    assert "replayed" not in log
    assert swarm.summary("c0s0")["completed"] == list(range(resumed_at, STEPS))
    assert json.loads((ckpt / "cluster0" / "stage0.json").read_text())["data_position"] == STEPS
    last = swarm.summary("c0s1")
    rounds = [version for version, _ in last["eval_history"]]
    # once each, to the end; but stage 1 lives on, so a round it ran past stage 0's checkpoint (before the
    # kill) runs again once the cluster has retrained from that checkpoint (resumed at 20, killed past 25)
    again = [v for v in set(rounds) if rounds.count(v) > 1]
    assert all(resumed_at < v and rounds.count(v) == 2 for v in again), (resumed_at, rounds)
    assert rounds[-1] == STEPS, rounds
    assert [v for i, v in enumerate(rounds) if v not in rounds[:i]] == sorted(set(rounds)), rounds
    assert len(set(rounds)) >= STEPS // 5 - 1, rounds  # all but a round the kill cut short
    assert last["eval_loss"] < last["eval_loss_first"] and last["loss"] < last["loss_first"], last
