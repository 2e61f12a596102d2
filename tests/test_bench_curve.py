"""benchmarks/bench_curve.py's arithmetic: a round's time is its slowest process's, steady is the median
over repeats, CURVE's throughput is plaintext's steady time over its own (no processes started here)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import bench_curve


def _report(scale: float) -> dict[str, object]:
    """One process's report: every set's first round at ``scale`` s, its repeats at 1, 2, 3 x ``scale``
    (CURVE sets twice as slow), 0.5 CPU-s each."""
    out: dict[str, object] = {}
    for name in ("gloo", *bench_curve.TIMED):
        slow = 2.0 if "curve" in name else 1.0
        out[f"first_{name}"] = (scale * slow, 0.5)
        out[name] = [(k * scale * slow, 0.5) for k in (1, 2, 3)]
        out[f"diff_{name}"] = 0.0
    for name in bench_curve.COLD:
        out[f"first_{name}"] = (4 * scale, 0.5)
    return out


def test_summary_takes_the_slowest_process_and_the_median_repeat() -> None:
    args = argparse.Namespace(mb=100.0, repeats=3, link_mbit=None, piece_mb=4.0, small_piece_kb=256.0)
    summary = bench_curve.summarize({0: _report(1.0), 1: _report(1.5), 2: _report(0.5), 3: _report(1.0)}, args)
    assert summary["plain_first_s"] == 1.5 and summary["plain_steady_s"] == 3.0  # slowest: 1.5, 3.0, 4.5
    assert summary["plain_first_over_steady"] == pytest.approx(0.5)
    assert summary["curve_over_plain_throughput"] == pytest.approx(0.5)
    assert summary["cold_plain_first_over_steady"] == pytest.approx(2.0)  # 6.0 over plain's steady 3.0
    assert summary["gloo_cpu_s_per_gb"] == pytest.approx(2.0 / 0.1)  # 4 x 0.5 CPU-s for 0.1 GB
