"""PCs behind emulated home NAT (issue #24): two homes, each a router namespace that masquerades its LAN with
nftables and forwards nothing inbound, every upload shaped with tc tbf (``benchmarks/_natnet.py``).

Home 1 holds a1 and a2, home 2 holds b1; ``open`` is a reachable PC and the broker's PC (``srv``)
relays.  Nothing in the topology says who is behind NAT: the broker's dial-back finds out.  A 2x2 swarm
(open -> a1 | a2 -> b1) trains and averages; ``ravq status`` shows who is behind NAT and which links
are relayed; a1 killed with SIGKILL and started again (as systemd's Restart= does) rejoins: its cluster
pauses and trains again, and every process ends with exit status 0.  Asserted on the broker's events,
not on durations.

Needs root, iproute2, tbf and nft; skipped with the reason otherwise.  The processes run as root in
their namespaces (not through the systemd units as an unprivileged user).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import _natnet

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[1]
RATE_MBIT = 50
PIPELINE, RING, BROKER_PUB, BROKER_ROUTER, RELAY = 27001, 27002, 27101, 27102, 27103


@pytest.fixture
def homes() -> Iterator[dict[str, _natnet.Pc]]:
    if reason := _natnet.unavailable_reason():
        pytest.skip(reason)
    with _natnet.nat_homes(["srv", "open"], [["a1", "a2"], ["b1"]], RATE_MBIT) as pcs:
        yield pcs


def nat_swarm_topology(pcs: dict[str, _natnet.Pc], task: str, training: dict[str, Any]) -> dict[str, Any]:
    """c0 = open -> a1, c1 = a2 -> b1; each node advertises the address others would dial (its router's
    behind NAT, with a port of its own: nothing is forwarded)."""
    nodes = []
    for i, (name, cluster, stage) in enumerate((("open", 0, 0), ("a1", 0, 1), ("a2", 1, 0), ("b1", 1, 1))):
        pc = pcs[name]
        nodes.append({"name": name, "host": pc.public, "bind_host": "0.0.0.0", "pipeline_port": PIPELINE + 10 * i,
                      "ring_port": RING + 10 * i, "cluster": cluster, "stage": stage})
    return {"task": task, "training": training,
            "timeouts": {"heartbeat_interval_s": 1.0, "lost_s": 4.0, "ring_step_s": 10.0, "reach_s": 2.0},
            "broker": {"host": pcs["srv"].address, "bind_host": "0.0.0.0", "pub_port": BROKER_PUB,
                       "router_port": BROKER_ROUTER, "relay_port": RELAY},
            "nodes": nodes}


class NatSwarm:
    def __init__(self, tmp: Path, pcs: dict[str, _natnet.Pc], topology: dict[str, Any]) -> None:
        self.tmp, self.pcs = tmp, pcs
        self.path = tmp / "topology.yaml"
        self.path.write_text(yaml.safe_dump(topology))
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        """Processes the test killed itself (until they are started again)."""
        self.procs["broker"] = self._spawn("srv", ["broker", "--topology", str(self.path)], "broker")
        for node in topology["nodes"]:
            self.start(node["name"])

    def _spawn(self, pc: str, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{log}.log", "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen(["ip", "netns", "exec", self.pcs[pc].netns, sys.executable, "-m", "ravq", *argv],
                                env=self.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, name: str) -> None:
        self.killed.discard(name)
        self.procs[name] = self._spawn(name, ["node", "--topology", str(self.path), "--name", name, "--threads", "1",
                                              "--summary", str(self.tmp / f"summary-{name}.json")], name)

    def status(self) -> dict[str, Any] | None:
        """``ravq status --json`` run on the broker's PC."""
        proc = subprocess.run(["ip", "netns", "exec", self.pcs["srv"].netns, sys.executable, "-m", "ravq", "status",
                               "--topology", str(self.path), "--json", "--timeout", "2"], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def status_text(self) -> str:
        return subprocess.run(["ip", "netns", "exec", self.pcs["srv"].netns, sys.executable, "-m", "ravq", "status",
                               "--topology", str(self.path), "--timeout", "2"], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False).stdout

    def until(self, what: str, check: Callable[[dict[str, Any]], bool], guard_s: float) -> dict[str, Any]:
        """Poll the status until ``check`` holds (``guard_s`` only bounds a hung run)."""
        deadline = time.monotonic() + guard_s
        last = None
        while time.monotonic() < deadline:
            failed = {n: p.returncode for n, p in self.procs.items()
                      if n not in self.killed and p.poll() not in (None, 0)}
            assert not failed, f"{failed} failed while waiting for {what}:\n" + "\n".join(self.log(n) for n in failed)
            last = self.status()
            if last is not None and check(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"no {what}; last status: {last}")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def summary(self, name: str) -> dict[str, Any]:
        return json.loads((self.tmp / f"summary-{name}.json").read_text())

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _cluster(status: dict[str, Any], c: int) -> dict[str, Any]:
    return (status.get("clusters") or [{}, {}])[c]


def _version(status: dict[str, Any], node: str) -> int:
    return int(status.get("members", {}).get(node, {}).get("stats", {}).get("version", 0))


def test_homes_behind_nat_train_average_and_a_restarted_node_rejoins(homes: dict[str, _natnet.Pc],
                                                                      tmp_path: Path) -> None:
    training = {"steps": 600, "micro_batch": 4, "sync_every": 5, "checkpoint_every": 50,
                "checkpoint_dir": str(tmp_path / "ckpt"), "log_every": 100}
    swarm = NatSwarm(tmp_path, homes, nat_swarm_topology(homes, "tests.churn_task", training))
    try:
        status = swarm.until("training with rounds averaged",
                             lambda s: all(_cluster(s, c).get("state") == "training" for c in (0, 1))
                             and all((m.get("stats") or {}).get("allreduce_rounds", 0) >= 2
                                     for m in s.get("members", {}).values()), 300)
        assert status["reach"] == {"open": "reachable", "a1": "behind_nat", "a2": "behind_nat", "b1": "behind_nat"}
        assert "dialled pipeline" in status["reach_tried"]["a1"] and "no handshake" in status["reach_tried"]["a1"]
        text = swarm.status_text()
        assert "reachable: open; behind NAT: a1, a2, b1" in text, text
        assert "relayed pipeline link a2 <-> b1 via broker" in text, text
        assert "relayed ring link a1 <-> b1 via broker" in text, text
        generation = _cluster(status, 0).get("generation", 0)
        swarm.killed.add("a1")
        swarm.procs["a1"].kill()
        swarm.procs["a1"].wait(10)
        swarm.until("cluster 0 to pause", lambda s: _cluster(s, 0).get("generation", 0) > generation, 120)
        swarm.start("a1")  # systemd's Restart=: a new process, new source ports, a new NAT mapping
        swarm.until("a1 measured again and cluster 0 training again",
                    lambda s: s.get("reach", {}).get("a1") == "behind_nat" and _version(s, "a1") > 0
                    and _cluster(s, 0).get("state") == "training"
                    and _cluster(s, 0).get("generation", 0) > generation, 400)
        for name, proc in swarm.procs.items():
            if name != "broker":
                assert proc.wait(900) == 0, swarm.log(name)
    finally:
        swarm.close()
    assert all(swarm.summary(n)["final_round"] for n in ("open", "a1", "a2", "b1"))
    routes = swarm.summary("a1")["routes"]
    assert routes["pipeline"] == {"open": "dial"}
    assert (routes["ring"]["open"], routes["ring"]["b1"]) == ("dial", "relay:broker")
