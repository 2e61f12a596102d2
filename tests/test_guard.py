"""The asynchrony guard (issue #39 part 5): stale and fresh gradients of one micro-batch, compared rarely, and
one warning when they disagree."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ravq.stage.guard import AsynchronyGuard, cosine
from tests import models_for_tests as skipnet
from tests.pipeline_harness import make_workers, run_in_order


def _net() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, list[torch.Tensor | None]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))
    weights = {n: p.detach().clone().requires_grad_() for n, p in net.named_parameters()}
    return net, weights, torch.randn(4, 5), [torch.randn(4, 3)]


def _plain_autocast() -> torch.autocast:
    return torch.autocast("cpu", enabled=False)


def test_cosine_of_gradient_sets() -> None:
    g = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0]), "c": None}
    assert cosine(g, g) == pytest.approx(1.0)
    assert cosine(g, {n: None if v is None else -v for n, v in g.items()}) == pytest.approx(-1.0)
    assert cosine(g, {"a": torch.tensor([2.0, -1.0]), "b": torch.tensor([0.0])}) == pytest.approx(0.0)


def test_agreeing_gradients_stay_quiet_and_disagreeing_ones_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    net, stale, x, out_grads = _net()
    guard = AsynchronyGuard("cluster 0 stage 0", every=1, window=2, threshold=0.5)
    near = {n: w + 1e-4 for n, w in stale.items()}  # a small step later: the gradient still agrees
    for _ in range(3):
        assert guard.sample(net, stale, near, {}, [x], out_grads, _plain_autocast) > 0.99
    assert guard.report() == {"stale_cosine": pytest.approx(1.0, abs=0.01), "asynchrony_warning": False,
                              "asynchrony_reason": None}
    # every weight flipped: tanh flips the hidden layer, so both layers' gradients point the other way
    flipped = {n: -w for n, w in stale.items()}
    with caplog.at_level(logging.WARNING, logger="ravq.stage.guard"):
        assert guard.sample(net, stale, flipped, {}, [x], out_grads, _plain_autocast) == pytest.approx(-1.0)
        assert guard.warned  # the window's mean (1, -1) is 0, below 0.5
        guard.sample(net, stale, flipped, {}, [x], out_grads, _plain_autocast)
        guard.sample(net, stale, flipped, {}, [x], out_grads, _plain_autocast)
    warnings = [r.getMessage() for r in caplog.records if "asynchrony hurts" in r.getMessage()]
    assert len(warnings) == 1 and "max_inflight: 1" in warnings[0] and "training.batch" in warnings[0]
    assert guard.report()["stale_cosine"] == pytest.approx(-1.0) and guard.report()["asynchrony_warning"]


def test_only_stale_backwards_are_counted_and_sampled_rarely() -> None:
    guard = AsynchronyGuard("s", every=3)
    assert [guard.due(s) for s in (0, 1, 0, 1, 1, 0, 1, 1, 1)] == [False, False, False, False, True, False,
                                                                   False, False, True]


def test_the_guard_does_not_touch_the_buffers_or_the_random_stream() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
    weights = {n: p.detach().clone().requires_grad_() for n, p in net.named_parameters()}
    buffers = dict(net.named_buffers())
    before = {n: b.clone() for n, b in buffers.items()}
    guard = AsynchronyGuard("s", every=1)
    x, out_grads = torch.randn(8, 4), torch.randn(8, 2)
    state = torch.random.get_rng_state()
    # the same weights, the same dropout masks: the two gradients are the same
    assert guard.sample(net, weights, weights, buffers, [x], [out_grads], _plain_autocast) == pytest.approx(1.0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(buffers[n], before[n]) for n in buffers)


def test_a_stale_pipeline_stage_samples_its_gradients() -> None:
    workers = make_workers(skipnet, 2, steps=12, max_inflight=2)
    workers[0].passes.guard.every = 1  # sample every stale backward of this short run
    run_in_order(workers)
    snap = workers[0].stats.snapshot()
    assert workers[0].passes.guard.cosines and -1.0 <= snap["stale_cosine"] <= 1.0
    assert snap["staleness_updates"] > 0 and workers[1].stats.snapshot()["staleness_updates"] == 0
    assert "stale_cosine" not in workers[1].stats.snapshot()  # the last stage is never stale: never sampled


def test_status_shows_staleness_in_updates_and_a_guard_warning_with_its_remedy() -> None:
    from ravq.cli.status import format_status

    stats = {"cluster": 0, "stage": 0, "version": 40, "samples": 1280, "busy_fraction": 0.4, "wall_s": 10.0,
             "staleness_mean": 0.3, "staleness_updates": 0.25, "asynchrony_warning": True, "stale_cosine": 0.12}
    text = format_status({"seq": 1, "plan": {"clusters": [{"nodes": ["a"]}]},
                          "members": {"a": {"state": "up", "stats": stats}}})
    row = next(line for line in text.splitlines() if line.startswith("a "))
    assert row.split()[6] == "0.25"  # the recent mean in updates, not the run's mean
    assert "cosine 0.12); set training.max_inflight: 1 or a larger training.batch" in text


def test_the_demo_report_states_the_batch_and_the_accumulation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from ravq.cli.demo_view import summarize

    node = {"name": "c0s0", "cluster": 0, "stage": 0, "wall_s": 2.0, "samples": 64, "backwards": 8,
            "staleness_mean": 0.5, "staleness_updates": 0.75, "asynchrony_warning": False}
    (tmp_path / "summary-c0s0.json").write_text(json.dumps(node))
    report = summarize(tmp_path, {"training": {"micro_batch": 8, "batch": 32}, "nodes": [{"name": "c0s0"}]}, 5.0)
    assert report is not None and (report["batch"], report["update_every"]) == (32, 4)
    assert report["nodes"][0]["staleness_updates"] == 0.75


def _norm_series(guard: AsynchronyGuard, norms: list[float], staleness: int = 1) -> None:
    for n in norms:
        guard.observe_update([torch.full((4,), n / 2.0)], staleness)  # a vector of 4 values n/2 has norm n


def test_a_stale_gradient_spike_warns_once_and_a_fresh_or_smooth_one_does_not(
        caplog: pytest.LogCaptureFixture) -> None:
    smooth = AsynchronyGuard("s")
    _norm_series(smooth, [0.5 * 1.05**k for k in range(60)] + [3.0, 0.4, 5.0])  # growth, noise up to 10x
    assert not smooth.warned
    fresh = AsynchronyGuard("s")
    _norm_series(fresh, [1.0] * 10 + [50.0], staleness=0)  # synchronous: not asynchrony's doing
    assert not fresh.warned
    early = AsynchronyGuard("s")
    _norm_series(early, [1.0] * 5 + [50.0])  # too few updates to judge
    assert not early.warned
    stale = AsynchronyGuard("cluster 0 stage 0")
    with caplog.at_level(logging.WARNING, logger="ravq.stage.guard"):
        _norm_series(stale, [1.0] * 10 + [30.0, 1.0, 40.0])
    warnings = [r.getMessage() for r in caplog.records if "asynchrony hurts" in r.getMessage()]
    assert len(warnings) == 1 and "30x the median" in warnings[0] and "max_inflight: 1" in warnings[0]
    assert stale.report()["asynchrony_warning"] and "30x" in stale.report()["asynchrony_reason"]


def test_the_guard_catches_the_stale_overshoot_that_stalls_a_small_gpt2() -> None:
    """The run of docs/convergence.md that sits at the unigram plateau (2 stages, staleness exactly 1, no
    compensation and no warm-up): its first stage's guard warns; the same run synchronous never is stale."""
    from tests import zoo_markov

    torch.set_num_threads(1)
    workers = make_workers(zoo_markov.gpt2, 2, steps=40, max_inflight=2, micro_batch=8, seed=1,
                           predict_weights=2.0)
    run_in_order(workers)
    assert workers[0].passes.guard.warned and "gradient norm" in str(workers[0].passes.guard.reason)
    assert workers[0].stats.snapshot()["asynchrony_warning"]
