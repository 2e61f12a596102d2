"""``ravq check`` under a synchronous schedule (``training.schedule: sync`` or ``zero_bubble``): no gradient is
stale, so the stages keep neither weight prediction's nor delay compensation's copies, and a stage without tied
copies steps with nothing in flight, so its forwards' snapshot is the live weights; the estimate counts none of
them (it counted ``max_inflight - 1`` snapshots, prediction's and compensation's: 5x a stage's weights at a
window of 4).  In-process, no sockets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _task() -> SimpleNamespace:
    from benchmarks.zoo_tasks import TASKS

    task = SimpleNamespace(**vars(TASKS["mlp_sgd"]))
    task.make_optimizer = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)
    return task


@pytest.mark.parametrize(("split", "tied"), [(False, False), (True, False), (False, True)])
def test_a_synchronous_stage_keeps_no_copy_of_its_weights_or_gradients(split: bool, tied: bool) -> None:
    """Also a model whose first and last stages hold copies of a tied weight (``tests.zoo.tied``, threads)."""
    from ravq.stage.stash import WeightStash
    from tests import zoo
    from tests.pipeline_harness import make_workers, run_in_order, run_workers

    copied: list[bool] = []
    before_change = WeightStash.before_change

    def spy(self: WeightStash, in_flight: bool) -> None:
        copied.append(self.snapshot is not None and self.aliased and in_flight)  # the live weights move away
        before_change(self, in_flight)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WeightStash, "before_change", spy)
        workers = make_workers(zoo.tied if tied else _task(), 3 if tied else 2, steps=24, max_inflight=4,
                               update_every=4, predict_weights=2.0, extrapolate_gradients=2.0,
                               stale_correction="auto", synchronous=True, split_backward=split)
        (run_workers if tied else run_in_order)(workers)
    assert not tied or workers[0].tied is not None
    assert len(copied) >= 6 and not any(copied)
    for worker in workers:
        assert worker.forward_weights.last_update is None and not worker.forward_weights.extrapolation.previous


def test_ravq_check_counts_no_stashed_copy_under_a_synchronous_schedule() -> None:
    from ravq.cut.meta import build_meta_model, to_meta
    from ravq.cut.split import candidate_cuts, even_cuts, split_model
    from ravq.preflight.memory import MemorySettings, estimate
    from ravq.preflight.report import Report

    task = _task()
    model = build_meta_model(task, 0).model
    example = to_meta(task.example_inputs(4))
    specs = split_model(model, example, even_cuts(candidate_cuts(model, task), 2))
    _, targets = next(task.train_batches(4, 0, 1, 0))

    def first(synchronous: bool) -> tuple[int, int]:
        settings = MemorySettings(micro_batch=4, max_inflight=4, predict_weights=2.0, extrapolate_gradients=2.0,
                                  update_every=4, stale_correction="auto", inflight_warmup_steps=20,
                                  synchronous=synchronous)
        report = Report(task="", cuts=[], stages=2, micro_batch=4, max_inflight=4)
        stage = estimate(specs, example, targets, task, settings, report, ["", ""])[0]
        return stage.stash, stage.grads

    stash, grads = first(False)
    assert stash == 5 * grads  # 3 snapshots, prediction's, compensation's
    assert first(True) == (0, grads)


def test_ravq_check_passes_the_schedule_on() -> None:
    import argparse

    from ravq.cli.check import _training_settings
    from ravq.config import TrainingConfig

    args = argparse.Namespace(micro_batch=None, max_inflight=None, meta_only=False)
    for schedule, synchronous in (("async", False), ("sync", True), ("zero_bubble", True)):
        assert _training_settings(TrainingConfig(schedule=schedule), args, 0).synchronous is synchronous
