"""Group averaging across real processes: 4 clusters of 1 stage in groups of 2, one cluster killed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ravq.average.groups import group_of, groups_for
from ravq.average.rounds import ROUNDS_PER_EPOCH
from tests.swarm import Swarm, local_topology

pytestmark = pytest.mark.multiprocess

KILL_ROUND = 10
SURVIVORS = ["c0s0", "c1s0", "c2s0"]


def _aborted_rounds(log: str) -> set[int]:
    return {int(r) for r in re.findall(r"averaging round (\d+) aborted", log)}


def test_a_killed_cluster_stops_only_its_own_groups_round_and_the_others_average_on(tmp_path: Path) -> None:
    """c3 dies (SIGKILL) mid-round, round 10 or later.  The first round a survivor gives up on is one of
    c3's group: only c3's partner in it aborts it (global rings would abort it on all three), the other
    group finishes it; every survivor trains to the end, averaging in groups of at most 2 all along."""
    training = {"steps": 400, "micro_batch": 4, "sync_every": 2}
    topo = local_topology("tests.churn_task", [1, 1, 1, 1], training,
                          averaging={"mode": "groups", "group_size": 2},
                          timeouts={"ring_step_s": 2.0, "heartbeat_interval_s": 0.3, "lost_s": 4.0})
    swarm = Swarm(tmp_path, topo, faults={"c3s0": f"kill_in_round:{KILL_ROUND}"})
    try:
        codes = swarm.wait(SURVIVORS, timeout_s=300)
        assert codes == dict.fromkeys(SURVIVORS, 0), {n: swarm.log(n) for n in codes}
        assert swarm.nodes["c3s0"].wait(5) == -9  # it really died, mid-round
    finally:
        swarm.close()
    aborted = {n: _aborted_rounds((tmp_path / f"{n}.log").read_text()) for n in SURVIVORS}
    first = min(r for rounds in aborted.values() for r in rounds if r % ROUNDS_PER_EPOCH >= KILL_ROUND)
    epoch, index = divmod(first, ROUNDS_PER_EPOCH)
    partner = {f"c{c}s0" for c in group_of(3, groups_for(epoch, index, range(4), "groups", 2)) if c != 3}
    assert {n for n, rounds in aborted.items() if first in rounds} == partner, (first, aborted)
    for name in SURVIVORS:
        s = swarm.summary(name)
        assert s["trained"] == 400, s
        assert s["allreduce_rounds"] > 40 and 1 <= len(s["averaging_group"]) <= 2, s
    assert "rings now exclude clusters [3]" in (tmp_path / "broker.log").read_text()
