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
