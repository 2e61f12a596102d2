"""A standby without a plan file (issue #27): the topology fixes the clusters of the training nodes and
marks a spare ``standby: true``; the broker runs without ``--plan``.  Real processes: kill -9 a stage for
good; after lost_s + replace_s the standby takes its stage and its cluster trains again."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravq.cli.main import plan_for
from ravq.config import ConfigError, load_topology, parse_topology
from tests.swarm import Swarm
from tests.test_churn import LOST_S, Watch, _topology, _training, _version

pytestmark = [pytest.mark.multiprocess, pytest.mark.fault]


def _with_standby(tmp_path: Path) -> dict[str, Any]:
    topo = _topology([2, 2, 1], 100_000, tmp_path / "ckpt", replace_s=2.0)
    spare = topo["nodes"][-1]  # the third "cluster" of one node: the spare
    spare.update(name="spare", standby=True)
    del spare["cluster"], spare["stage"]
    return topo


def test_a_standby_needs_no_cluster_and_refuses_one(tmp_path: Path) -> None:
    topo = _with_standby(tmp_path)
    assert parse_topology(topo, resolve_task=False).node("spare").standby
    topo["nodes"][-1]["cluster"] = 0
    with pytest.raises(ConfigError, match=r"nodes\[4\]: a standby is in no cluster"):
        parse_topology(topo, resolve_task=False)
    topo["nodes"][-1].update(standby=False)
    del topo["nodes"][-1]["cluster"]
    with pytest.raises(ConfigError, match=r"nodes\[4\]\.cluster: missing.*'standby: true' on a spare"):
        parse_topology(topo, resolve_task=False)


def test_the_broker_without_a_plan_leaves_the_standby_out(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(_with_standby(tmp_path)))
    plan = plan_for(load_topology(tmp_path / "t.yaml"), None)
    assert [c.nodes for c in plan.clusters] == [["c0s0", "c0s1"], ["c1s0", "c1s1"]]


def test_a_standby_without_a_plan_file_takes_over_a_lost_stage(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, _with_standby(tmp_path))  # the broker gets no --plan
    watch = Watch(swarm)
    try:
        trained = [n for n in swarm.nodes if n != "spare"]
        watch.until("training, the spare standing by",
                    lambda s: all(_version(s, n) > 10 for n in trained)
                    and s["members"].get("spare", {}).get("phase") == "standby", 180, list(swarm.nodes))
        swarm.nodes["c1s1"].send_signal(signal.SIGKILL)
        swarm.nodes["c1s1"].wait(10)
        others = [n for n in swarm.nodes if n != "c1s1"]
        watch.until("the standby to take over", lambda s: "spare" in s["plan"]["clusters"][1]["nodes"],
                    LOST_S + 2.0 + 60, others)
        watch.until("cluster 1 to train again with the standby",
                    lambda s: _training(s, 1, 1) and _version(s, "spare") > 0, 120, others)
        before = _version(watch.samples[-1][1], "c0s0")
        watch.until("cluster 0 to keep training", lambda s: _version(s, "c0s0") > before, 30, others)
    finally:
        swarm.close()
    assert "standby spare takes over the stage of c1s1" in swarm.log("broker")
