"""A Binary Star pair split by the network (issue #37 part 3): the primary broker, the backup and the nodes'
broker clients each in a network namespace of their own on one bridge.

First the link between the two brokers alone is cut (a blackhole route each way) for 8 heartbeat
intervals: each loses the other, but the nodes still hear the primary, so none votes on the backup and
it stays passive.  Then the primary is cut from everyone (its link down): the nodes turn to the backup,
which takes over; when the link comes back the primary hears a newer active term and turns passive.
Never do the nodes see two active brokers (``tests.pair_watcher`` asks both every quarter interval).

Needs root and ``ip netns`` (skipped with the reason otherwise); private 10.x addresses inside the
namespaces it creates, deleted in ``finally``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _netns

pytestmark = [pytest.mark.netns, pytest.mark.alone, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 0.5
CLIENTS = ["c0s0", "c0s1"]


def _topology(path: Path, primary: str, backup: str, nodes: str) -> Path:
    path.write_text(json.dumps({
        "task": "tests.tasks_for_tests", "timeouts": {"heartbeat_interval_s": HEARTBEAT_S, "lost_s": 2.5},
        "broker": {"host": primary, "pub_port": 26201, "router_port": 26202,
                   "backup": {"host": backup, "pub_port": 26203, "router_port": 26204}},
        "nodes": [{"name": n, "host": nodes, "pipeline_port": 26301 + 2 * i, "ring_port": 26302 + 2 * i,
                   "cluster": 0, "stage": i} for i, n in enumerate(CLIENTS)]}))
    return path


def _samples(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]


def _until(out: Path, what: str, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hits = [s for s in _samples(out) if check(s)]
        if hits:
            return float(hits[0]["t"])
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last samples {_samples(out)[-3:]}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def test_a_cut_between_the_brokers_never_makes_two_actives(tmp_path: Path) -> None:
    if reason := _netns.unavailable_reason():
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen[bytes]] = []
    out = tmp_path / "samples.jsonl"
    with _netns.shaped_links(3, 1000, prefix="rqp") as (p, b, n):
        topology = _topology(tmp_path / "topology.yaml", p.address, b.address, n.address)

        def start(link: _netns.Link, name: str, *argv: str) -> None:
            log = (tmp_path / f"{name}.log").open("ab")
            procs.append(subprocess.Popen(["ip", "netns", "exec", link.netns, sys.executable, "-m", *argv],
                                          env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        try:
            start(p, "primary", "ravq", "broker", "--topology", str(topology))
            start(b, "backup", "ravq", "broker", "--topology", str(topology), "--backup")
            start(n, "clients", "tests.pair_watcher", str(topology), str(out), *CLIENTS)
            _until(out, "the pair to serve", lambda s: (s["primary"], s["backup"]) == ("active", "passive")
                   and s["on"] == dict.fromkeys(CLIENTS, 0), 90)
            for here, there in ((p, b), (b, p)):  # the brokers lose each other; the nodes hear the primary
                _ip("-n", here.netns, "route", "add", "blackhole", f"{there.address}/32")
            t_cut = time.time()
            time.sleep(8 * HEARTBEAT_S)
            for here, there in ((p, b), (b, p)):
                _ip("-n", here.netns, "route", "del", "blackhole", f"{there.address}/32")
            time.sleep(2 * HEARTBEAT_S)
            _ip("-n", p.netns, "link", "set", p.ifname, "down")  # the primary's PC loses its line
            t_down = time.time()
            t_over = _until(out, "the backup to take over", lambda s: s["backup"] == "active"
                            and s["on"] == dict.fromkeys(CLIENTS, 1), 15)
            time.sleep(4 * HEARTBEAT_S)
            _ip("-n", p.netns, "link", "set", p.ifname, "up")
            t_up = time.time()
            t_passive = _until(out, "the old primary to turn passive",
                               lambda s: s["t"] > t_up and s["primary"] == "passive", 30)
            time.sleep(2 * HEARTBEAT_S)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    samples = _samples(out)
    during_cut = [s for s in samples if t_cut <= s["t"] <= t_down]
    assert len(during_cut) > 10 and all((s["primary"], s["backup"]) == ("active", "passive")
                                        and s["on"] == dict.fromkeys(CLIENTS, 0) for s in during_cut)
    # the old primary, cut off from everyone, says it is active until it hears the newer term: the nodes
    # never follow it again, and no one sees two actives at any other time
    after = [s for s in samples if s["t"] >= t_over]
    assert after and all(s["on"] == dict.fromkeys(CLIENTS, 1) for s in after)
    assert not [s for s in samples
                if s["primary"] == s["backup"] == "active" and not t_up <= s["t"] <= t_passive]
    assert t_over - t_down <= 2 * HEARTBEAT_S + 2.5, f"took over after {t_over - t_down:.1f}s"
    assert [s for s in samples if s["t"] > t_passive][-1]["backup"] == "active"
    print(f"partition: backup took over {t_over - t_down:.2f}s after the primary's line went down; "
          f"the primary was passive {t_passive - t_up:.2f}s after it came back")
