"""What an averaging round costs a node (issue #26): ``ravq profile`` times rounds as a node runs them (two
one-stage copies, each with its own compute thread and ``Averager``, averaging every step over their own
ring sockets), and the planner and simulator charge that per parameter byte, not the bare ring's figure."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from ravq.config import load_topology, resolve_task_module
from ravq.profile import averaging_cost
from ravq.profile.compute import model_param_bytes
from ravq.profile.stage_cost import StageCostConfig
from ravq.profile.store import Measurement, load_profiles, ring_s_per_byte, save_profile
from tests.test_profile import one_node_topology

GIB = 1 << 30


def test_rounds_are_timed_as_a_node_runs_them(tmp_path: Path) -> None:
    topology = one_node_topology(tmp_path, True, {"compress": {"ring": "int8"}, "micro_batch": 4})
    task = resolve_task_module("ravq.tasks.charlm")
    config = StageCostConfig(micro_batches=4, warmup=2)
    # every step's round must finish (it raises otherwise): CURVE, int8 and error feedback, as a node averages
    cpu = averaging_cost.measure_averaging_cpu(topology, "a", task, config)
    # CPU seconds of one member's round of charlm's 1.27 MB: the event loop's and the averager's work, not training
    assert 0 < cpu < 1.0


def test_the_members_are_this_node_on_loopback_averaging_every_step(tmp_path: Path) -> None:
    topology = one_node_topology(tmp_path, False, {"sync_every": 7, "average_optimizer_state": True,
                                                   "max_inflight": 3})
    ring = averaging_cost._ring_topology(topology, "a")
    assert [n.name for n in ring.nodes] == ["a.avg0", "a.avg1"]
    assert {(n.host, n.ring_port, n.device) for n in ring.nodes} == {("127.0.0.1", 0, topology.node("a").device)}
    t = ring.training
    assert (t.sync_every, t.average_optimizer_state, t.overlap_averaging, t.max_inflight) == (1, False, True, 1)
    assert t.micro_batch == 2            # a round costs the same whatever the micro-batch; memory does not


def test_the_planner_charges_rounds_as_a_node_runs_them(tmp_path: Path) -> None:
    both = Measurement(name="a", device="cpu", flops=1e9, matmul_flops=1e9, model_flops=1e9, memory_bytes=GIB,
                       ring_s=[1 << 20, 0.004], averaging_s=[2 << 20, 0.030])
    bare = Measurement(name="b", device="cpu", flops=1e9, matmul_flops=1e9, model_flops=1e9, memory_bytes=GIB,
                       ring_s=[1 << 20, 0.004])
    assert ring_s_per_byte(both) == pytest.approx(0.030 / (2 << 20))
    assert ring_s_per_byte(bare) == pytest.approx(0.004 / (1 << 20))       # profiles made before it
    for m in (both, bare):
        save_profile(m, tmp_path)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"task": "ravq.tasks.charlm", "training": {"micro_batch": 4},
                                    "broker": {"pub_port": 26901, "router_port": 26902},
                                    "nodes": [{"name": "a", "pipeline_port": 27000, "ring_port": 28000},
                                              {"name": "b", "pipeline_port": 27002, "ring_port": 28002}]}))
    a, b = load_profiles(load_topology(path), tmp_path)
    assert a.ring_s_per_byte == pytest.approx(0.030 / (2 << 20)) and b.ring_s_per_byte == pytest.approx(0.004 / (1 << 20))


def test_a_node_that_cannot_time_rounds_is_charged_the_bare_ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from ravq.profile import measure

    topology = one_node_topology(tmp_path, False, {})
    task = resolve_task_module("ravq.tasks.charlm")
    monkeypatch.setattr(measure, "measure_averaging_cpu", lambda *a, **k: 0.012)
    assert measure._averaging_cpu(topology, "a", task, None) == 0.012

    def fails(*args: object, **kwargs: object) -> float:
        raise RuntimeError("only 1 of 15 loopback averaging rounds finished")

    monkeypatch.setattr(measure, "measure_averaging_cpu", fails)
    with caplog.at_level(logging.WARNING, logger="ravq.profile.measure"):
        assert measure._averaging_cpu(topology, "a", task, None) is None
    assert "charging the bare ring" in caplog.text
    monkeypatch.setattr(measure, "usable_memory_bytes", lambda device: 16 * model_param_bytes(task))
    assert measure._averaging_cpu(topology, "a", task, None) is None   # two copies would not fit in half of it


def test_a_compute_thread_counts_time_in_the_averager_once() -> None:
    """An update applies finished rounds within it: the outermost hook counts, the inner one is inside it."""
    import time

    thread = averaging_cost._ThreadCpu()

    def inner() -> None:
        with thread.averaging():
            sum(i * i for i in range(200_000))

    def outer() -> None:
        with thread.averaging():
            inner()
            inner()
    t0 = time.thread_time()
    outer()
    spent = time.thread_time() - t0
    assert 0 < thread.hooks_s <= spent and thread._depth == 0
    inner()
    assert thread.hooks_s > spent * 1.2      # a call on its own counts
