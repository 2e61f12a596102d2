"""A Binary Star pair of brokers with real processes (issue #37 part 3): the primary killed -9 a second after
a node; the backup takes over, the node's cluster pauses and rejoins under it, training finishes, and the
old primary comes back passive."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from brokers.pair import as_backup
from ravq.cli.demo import free_ports
from ravq.cli.status import status_once
from ravq.config import load_topology
from tests.swarm import Swarm
from tests.test_churn import PAUSE_S, UNTHROTTLED, Watch, _cluster, _topology, _training, _version

pytestmark = [pytest.mark.multiprocess, pytest.mark.fault]

HEARTBEAT_S = 0.5
LOST_S = 2.5
STEPS = 900
"""At 1 / PAUSE_S micro-batches/s while the faults go on (about 20 s here; 45 s at most), then as fast as
the machine can."""


class PairWatch(Watch):
    """Polls one broker of the pair directly (``backup``: the backup), not whichever answers first."""

    def __init__(self, swarm: Swarm, backup: bool) -> None:
        super().__init__(swarm)
        topology = as_backup(load_topology(swarm.path), {}) if backup else load_topology(swarm.path)
        alone = topology.broker.model_copy(update={"backup": None})  # ask this one only
        self.topology = topology.model_copy(update={"broker": alone})

    def poll(self) -> dict[str, Any] | None:
        status = status_once(self.topology, None, timeout_s=0.5)
        if status is not None:
            self.samples.append((time.time(), status))
        return status


def _pair(status: dict[str, Any]) -> dict[str, Any]:
    return status.get("pair") or {}


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


def test_the_backup_takes_over_a_primary_killed_during_churn_and_the_old_primary_returns_passive(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    topo = _topology([2, 2], STEPS, ckpt, heartbeat_interval_s=HEARTBEAT_S, lost_s=LOST_S)
    used = {topo["broker"]["pub_port"], topo["broker"]["router_port"]} | {
        n[k] for n in topo["nodes"] for k in ("pipeline_port", "ring_port")}
    backup_pub, backup_port = next(p for p in iter(lambda: free_ports(2), None) if not used & set(p))
    topo["broker"]["backup"] = {"host": "127.0.0.1", "pub_port": backup_pub, "router_port": backup_port}
    env = {"CHURN_TASK_PAUSE_S": str(PAUSE_S), "CHURN_TASK_UNTHROTTLED_IF": str(tmp_path / UNTHROTTLED)}
    swarm = Swarm(tmp_path, topo, env={node["name"]: dict(env) for node in topo["nodes"]})
    primary, backup = PairWatch(swarm, backup=False), PairWatch(swarm, backup=True)
    try:
        primary.until("training", lambda s: all(_version(s, n) > 10 for n in swarm.nodes), 120,
                      list(swarm.nodes))
        assert _pair(primary.poll() or {}).get("state") == "active"
        assert _pair(backup.poll() or {}).get("state") == "passive"
        swarm.nodes["c1s1"].send_signal(signal.SIGKILL)
        swarm.nodes["c1s1"].wait(10)
        time.sleep(1.0)
        swarm.broker.send_signal(signal.SIGKILL)
        swarm.broker.wait(10)
        t_kill = time.time()
        others = [n for n in swarm.nodes if n != "c1s1"]
        t_active = backup.until("the backup to take over", lambda s: _pair(s).get("state") == "active", 30,
                                others)
        assert t_active - t_kill <= 2 * HEARTBEAT_S + LOST_S, f"took over after {t_active - t_kill:.1f}s"
        backup.until("cluster 1 to pause", lambda s: _cluster(s, 1).get("state") in ("paused", "recovering")
                     and _cluster(s, 1).get("generation", 0) >= 1, 30, others)
        swarm.start("c1s1")
        t_back = time.time()
        swarm.restart_broker()  # the old primary comes back passive and follows the backup
        backup.until("cluster 1 to train again", lambda s: _training(s, 1, 1) and _version(s, "c1s1") > 0, 60,
                     others)
        primary.until("the old primary to be passive", lambda s: _pair(s).get("state") == "passive"
                      and _pair(s).get("peer") == "active", 30, others)
        status = backup.poll() or {}
        assert _pair(status).get("state") == "active" and _pair(status).get("failovers") == 1
        (tmp_path / UNTHROTTLED).touch()
        codes = swarm.wait(timeout_s=120)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    finally:
        swarm.close()
    times = swarm.summary("c0s1")["update_times"]  # the cluster no fault hit, across the failover
    before, during = _rate(times, t_kill - 3, t_kill), _rate(times, t_kill, t_back)
    print(f"failover: backup active {t_active - t_kill:.2f}s after the kill; cluster 0 trained "
          f"{during:.1f}/s during it, {before:.1f}/s before")  # the figures; a rate is asserted alone
