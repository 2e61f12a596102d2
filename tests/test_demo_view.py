"""The demo's live samples/s: a rate over the last few seconds, not the average since start-up."""

from __future__ import annotations

import pytest

from ravq.cli.demo_view import RateMeter


def test_first_reading_has_no_rate() -> None:
    assert RateMeter().update(10.0, 500) == 0.0


def test_rate_is_recent_not_diluted_by_start_up() -> None:
    meter = RateMeter(window_s=5.0)
    t, count, rate = 0.0, 0, 0.0
    while t < 6.0:  # processes start, nothing trained yet
        rate = meter.update(t, count)
        t += 0.5
    assert rate == 0.0
    while t < 14.0:  # then 200 samples/s
        count += 100
        rate = meter.update(t, count)
        t += 0.5
    assert rate == pytest.approx(200.0, rel=0.02)  # the average since t=0 would be ~110


def test_rate_follows_a_slowdown_within_the_window() -> None:
    meter = RateMeter(window_s=2.0)
    t, count = 0.0, 0
    for _ in range(20):
        count += 100  # 200/s
        meter.update(t, count)
        t += 0.5
    for _ in range(10):
        count += 25  # 50/s
        rate = meter.update(t, count)
        t += 0.5
    assert rate == pytest.approx(50.0, rel=0.05)


def test_a_count_that_goes_back_starts_over() -> None:
    meter = RateMeter()
    meter.update(0.0, 0)
    meter.update(1.0, 300)
    assert meter.update(2.0, 10) == 0.0  # a node restarted: no negative rate
    assert meter.update(3.0, 110) == pytest.approx(100.0)


def test_summary_survives_a_node_that_failed_at_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node that fails before training writes a summary without statistics: the demo's report is built
    from the others (it used to end in KeyError: 'wall_s'), or is None when no node trained."""
    import json

    from ravq.cli.demo_view import summarize

    trained = {"name": "c0s0", "cluster": 0, "stage": 0, "wall_s": 2.0, "samples": 64, "backwards": 8,
               "loss_initial": 3.0, "loss_recent": 2.0}
    failed = {"name": "c0s1", "cluster": 0, "stage": 1, "failure": "cannot split the model", "version": 0}
    (tmp_path / "summary-c0s0.json").write_text(json.dumps(trained))
    (tmp_path / "summary-c0s1.json").write_text(json.dumps(failed))
    data = {"nodes": [{"name": "c0s0"}, {"name": "c0s1"}]}
    report = summarize(tmp_path, data, 5.0)
    assert report is not None and report["samples"] == 64 and report["steps"] == 8
    (tmp_path / "summary-c0s0.json").unlink()
    assert summarize(tmp_path, data, 5.0) is None
