"""The asynchronous pipeline without sockets: scheduling, stashing, staleness, sync equivalence."""

from __future__ import annotations

import pytest
import torch

from ravq.config import PREDICT_WEIGHTS
from tests import models_for_tests as skipnet
from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process


@pytest.mark.parametrize("predict_weights", [0.0, PREDICT_WEIGHTS], ids=["plain", "predict-default"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_sync_pipeline_equals_one_process(stages: int, predict_weights: float) -> None:
    """max_inflight=1: the split model must train exactly like the unsplit one (the correctness anchor),
    with weight prediction off and at the configured default (no staleness: nothing to predict)."""
    workers = make_workers(skipnet, stages, steps=25, max_inflight=1, predict_weights=predict_weights)
    run_workers(workers)
    want = train_one_process(skipnet, steps=25)
    got = merged_state(workers)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    assert all(w.stats.staleness_max == 0 for w in workers)


def test_skip_connection_and_multi_input_stages_are_exercised() -> None:
    workers = make_workers(skipnet, 4, steps=1, max_inflight=1)
    # stage 1 reads model input y directly, stage 2 reads stage 0's output across a cut
    assert workers[1].spec.model_inputs == [1]
    assert 0 in workers[2].spec.producer_stages and len(workers[2].spec.inputs) >= 2


def test_async_pipeline_has_staleness_bounded_by_inflight() -> None:
    workers = make_workers(skipnet, 4, steps=40, max_inflight=4)
    run_workers(workers)
    assert all(w.stats.backwards == 40 and w.version == 40 for w in workers)
    assert workers[0].stats.staleness_max > 0  # stage 0 updates while 3 more micro-batches are in flight
    assert all(w.stats.staleness_max <= 3 for w in workers)
    assert workers[-1].stats.staleness_max == 0  # the last stage runs backward right after forward


def test_async_differs_from_sync_but_learns() -> None:
    workers = make_workers(skipnet, 3, steps=60, max_inflight=3)
    run_workers(workers)
    last = workers[-1].stats
    assert last.loss_last is not None and last.loss_first is not None


def test_weight_stashing_gives_gradient_at_forward_weights() -> None:
    """Two forwards at version 0, an update in between, the second backward must use version-0 weights."""
    workers = make_workers(skipnet, 1, steps=2, max_inflight=2)
    (w,) = workers
    batches = skipnet.train_batches(4, 0, 1, 0)
    (x1, y1), t1 = next(batches)
    (x2, y2), t2 = next(batches)
    ref = skipnet.build_model()
    ref.load_state_dict(w.module.state_dict())
    # gradient of micro-batch 2 at the initial weights
    skipnet.loss_fn(ref(x2, y2), t2).backward()
    expected = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out1 = w._forward((0, 0), [x1, y1])
    out2 = w._forward((0, 1), [x2, y2])
    assert out1 and out2
    w.optimizer = torch.optim.SGD(w.params.values(), lr=1.0)  # big step: stale weights would show
    w._backward_from((0, 0), w._stash[(0, 0)], [skipnet.loss_fn(w._stash[(0, 0)].outputs[0], t1)], [None],
                     lambda out: None)
    assert w.version == 1
    captured = {}
    w.optimizer = torch.optim.SGD(w.params.values(), lr=0.0)
    orig_step = w.optimizer.step

    def capture(*a, **k):
        captured.update({n: p.grad.clone() for n, p in w.params.items()})
        return orig_step(*a, **k)

    w.optimizer.step = capture  # type: ignore[method-assign]
    w._backward_from((0, 1), w._stash[(0, 1)], [skipnet.loss_fn(w._stash[(0, 1)].outputs[0], t2)], [None],
                     lambda out: None)
    for n, g in expected.items():
        torch.testing.assert_close(captured[n], g, rtol=1e-6, atol=1e-7, msg=n)
    assert w.stats.staleness_max == 1


def test_update_every_accumulates() -> None:
    workers = make_workers(skipnet, 2, steps=12, max_inflight=1, update_every=3)
    run_workers(workers)
    assert all(w.version == 4 for w in workers)


def test_waiting_is_not_busy_and_is_counted_by_reason() -> None:
    """Honest busy: a stage held back in its update hook (as for an averaging round) waits 0.1 s per
    update; that time is counted as "averaging" waiting and left out of busy_s, and stage 1, starved
    meanwhile, counts "input" waiting while stage 0 at max_inflight counts "credits"."""
    import time

    from ravq.metrics import Metrics

    workers = make_workers(skipnet, 2, steps=6, max_inflight=1)
    metrics = Metrics("s0")
    workers[0].metrics = metrics
    held = 0.1

    def hold(worker) -> None:  # what Averager._hold_back does while a round is unfinished
        t0 = time.monotonic()
        time.sleep(held)
        worker.waited("averaging", time.monotonic() - t0)

    workers[0].on_update = hold
    run_workers(workers)
    s0, s1 = workers[0].stats, workers[1].stats
    assert s0.updates == 6 and s0.wait_s["averaging"] >= 6 * held * 0.95
    assert s0.busy_s < s0.wait_s["averaging"], "hook waits must not count as backward compute"
    assert s0.busy_s == pytest.approx(s0.forward_s + s0.backward_s)
    assert s0.wait_s.get("credits", 0) > 0 and s1.wait_s.get("input", 0) > 0
    snap = s0.snapshot()
    assert snap["wait_s"] == s0.wait_s and snap["busy_fraction"] == pytest.approx(s0.busy_s / snap["wall_s"], rel=0.2)
    exported = {s.labels["reason"]: s.value for m in metrics.registry.collect() if m.name == "ravq_stage_wait_seconds"
                for s in m.samples if s.name.endswith("_total")}
    assert exported["averaging"] == pytest.approx(s0.wait_s["averaging"])
    assert exported["credits"] == pytest.approx(s0.wait_s["credits"])
