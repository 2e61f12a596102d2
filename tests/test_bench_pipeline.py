"""The pipeline benchmark's smoke run: ravq (broker + 4 node processes) and torch's schedules (4 gloo
ranks) on the quick synthetic task, about 45-60 s on 2 cores.  Checks the report's shape and that
every figure is sane, not that a target is met (that needs the full run and a quiet machine)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_pipeline.py"
STAGES = 4
BUSY_SLACK = 0.02
"""A window's busy fraction may exceed 1 by a little: heartbeats count an operation's time when it
ends, so one that straddles the window's first heartbeat is counted whole."""


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(170)
def test_bench_pipeline_quick_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", "--run-dir", str(tmp_path / "run")],
                          check=False, capture_output=True, text=True, timeout=160, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    assert {"cores", "stages", "micro_batch", "micro_batches", "busy_fraction_window", "busy_fraction_whole_run",
            "busy_fraction_window_min", "busy_target_met", "ravq_samples_per_s", "ravq_samples_per_s_window",
            "torch_1f1b_samples_per_s", "torch_1f1b_samples_per_s_window", "ratio_ravq_over_1f1b",
            "ratio_ravq_over_1f1b_window", "torch_gpipe_samples_per_s", "ratio_ravq_over_gpipe",
            "ravq_other_cores_window", "torch_1f1b_other_cores_window"} <= set(report)
    assert report["stages"] == STAGES and report["cores"] >= 1 and report["micro_batches"] > 0
    for key in ("busy_fraction_window", "busy_fraction_whole_run"):
        fractions = report[key]
        assert len(fractions) == STAGES, key
        assert all(_positive(f) and f <= 1.0 + BUSY_SLACK for f in fractions), (key, fractions)
    assert report["busy_fraction_window_min"] == min(report["busy_fraction_window"])
    assert isinstance(report["busy_target_met"], bool)
    for key in ("ravq_samples_per_s", "ravq_samples_per_s_window", "torch_1f1b_samples_per_s",
                "torch_1f1b_samples_per_s_window", "torch_gpipe_samples_per_s", "ratio_ravq_over_1f1b",
                "ratio_ravq_over_1f1b_window", "ratio_ravq_over_gpipe"):
        assert _positive(report[key]), (key, report[key])
    assert report["ratio_ravq_over_1f1b"] == pytest.approx(
        report["ravq_samples_per_s"] / report["torch_1f1b_samples_per_s"])
    # The same samples on both sides: a rate far off the other side's means one run was cut short.
    assert 0.1 < report["ratio_ravq_over_1f1b"] < 10


def test_simulated_device_time_is_an_identity_that_splits_like_any_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``device`` preset's op waits off the CPU (its sleeps recorded here, not timed) and leaves values
    and gradients as they are, and torch.export keeps it as one node, so ravq's splitter cuts the model
    as it cuts the CPU preset."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks import synthetic_task
    from ravq.cut.split import split_model

    slept: list[float] = []
    monkeypatch.setattr(synthetic_task, "time", SimpleNamespace(sleep=slept.append))
    x = torch.randn(3, 5, requires_grad=True)
    y = torch.ops.ravqbench.device_time(x, 0.02)
    y.backward(torch.full_like(y, 2.0))
    assert slept == [0.02, 0.04]  # 20 ms forward, 40 ms backward
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full_like(x, 2.0))

    task = synthetic_task.SyntheticTask(width=8, layers=1, device_ms=1.0)
    torch.manual_seed(0)
    whole = task.build_model()
    torch.manual_seed(0)
    stages = split_model(task.build_model(), task.example_inputs(4), task.split_points())
    assert len(stages) == synthetic_task.BLOCKS
    inputs = torch.randn(4, 8)
    out = inputs
    for spec in stages:
        out = spec.module(out)
    assert torch.allclose(out, whole(inputs), atol=1e-6)


def test_steady_window_with_too_few_heartbeats_inside_uses_the_nearest_around_it() -> None:
    """A short, loaded run may leave one heartbeat or none inside the 25%..85% window; the benchmark then
    measures between the heartbeats just around it and says so, rather than reporting nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_pipeline

    def beat(backwards: int, wall_s: float, busy_s: float) -> dict[str, float]:
        return {"backwards": backwards, "wall_s": wall_s, "busy_s": busy_s, "samples": 4 * backwards,
                "polled_at": wall_s}

    dense = [beat(b, b / 10, 0.09 * b / 10) for b in range(0, 101, 5)]
    steady = bench_pipeline._steady(dense, 100)
    assert steady is not None and not steady["widened"]
    assert (steady["from_micro_batch"], steady["to_micro_batch"]) == (25, 85)
    assert steady["busy_fraction"] == pytest.approx(0.09)

    sparse = [beat(10, 1.0, 0.5), beat(50, 5.0, 4.5), beat(95, 9.5, 8.55)]  # one heartbeat inside
    steady = bench_pipeline._steady(sparse, 100)
    assert steady is not None and steady["widened"]
    assert (steady["from_micro_batch"], steady["to_micro_batch"]) == (10, 95)
    assert steady["busy_fraction"] == pytest.approx((8.55 - 0.5) / 8.5)
    assert bench_pipeline._steady([beat(50, 5.0, 4.5)], 100) is None  # one heartbeat: no interval at all
