"""The prediction benchmark runs end to end in quick mode (profile, plan, broker and real node processes)
and keeps its --json contract.  Its accuracy is the benchmark's business, not this test's: timing on a
shared machine does not belong in a pass/fail check."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.bench, pytest.mark.multiprocess, pytest.mark.timeout(200)]


def positive(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_bench_prediction_quick_json(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_prediction.py"), "--quick", "--json",
                           "--work-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "prediction" and result["quick"] is True
    assert result["task"] == "ravq.tasks.charlm" and result["nodes"] == 3
    assert positive(result["predicted_samples_per_s"]) and positive(result["measured_samples_per_s"])
    assert result["ratio"] == pytest.approx(result["measured_samples_per_s"] / result["predicted_samples_per_s"])
    assert result["target"] == [0.75, 1.25] and isinstance(result["met"], bool)
    assert positive(result["alone_flops"])

    (run,) = result["runs"]
    assert run["layout"] == "planner"
    planned = [n for cluster in run["clusters"] for n in cluster]
    assert len(planned) == len(set(planned)) == run["processes"]
    assert set(planned) | set(run["idle"]) == {"n0", "n1", "n2"}
    assert [len(c) for c in run["cuts"]] == [len(c) - 1 for c in run["clusters"]]
    assert run["samples"] > 0 and positive(run["train_wall_s"])
    assert 0 < run["busy_fraction_mean"] <= 1
    assert positive(run["flops_per_node"]) and set(run["flops_per_process"]) == set(planned)
    assert positive(run["naive_predicted_samples_per_s"]) and positive(run["naive_ratio"])
    for key in ("cores_available_profiling", "cores_available_training", "load_adjusted_ratio"):
        assert run[key] is None or positive(run[key]), key

    # the human-readable part comes first: the planner's explanation and the comparison table
    assert "predicted:" in proc.stdout and "measured/predicted" in proc.stdout
    for name in planned:   # only planned nodes were started, and each wrote its summary
        assert (tmp_path / "run-planner" / f"summary-{name}.json").exists()
    assert (tmp_path / "run-planner" / "plan.yaml").exists()
