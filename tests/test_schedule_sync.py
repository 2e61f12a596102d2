"""``training.schedule: sync``: 1F1B with a flush at every optimizer update, in-process (no sockets).

With a stated batch of several micro-batches per update and several in flight, the split model trains
exactly as one process accumulating the same micro-batches (the correctness anchor test_pipeline.py holds
``max_inflight 1`` to), with the stale-gradient mechanisms at their defaults (nothing is stale, so they do
nothing), with clipping that binds; and the asynchronous schedule with the same settings does not."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from ravq.config import EXTRAPOLATE_GRADIENTS, PREDICT_WEIGHTS, TrainingConfig
from ravq.cut.split import build_task_model
from ravq.stage.recipe import build_optimizer
from ravq.stage.types import RecipeOptions, StageOptions
from tests import models_for_tests as skipnet
from tests import zoo
from tests.pipeline_harness import make_workers, merged_state, run_workers

UPDATE_EVERY, UPDATES, MAX_NORM = 4, 6, 0.5


def one_process(updates: int, update_every: int, clip: float | None,
                task: ModuleType = skipnet) -> dict[str, torch.Tensor]:
    """The unsplit model, each update the mean loss of ``update_every`` micro-batches (clipped if asked)."""
    model = build_task_model(task, 0)
    opt = build_optimizer(task.make_optimizer, dict(model.named_parameters()))
    stream = task.train_batches(4, 0, 1, 0)
    for _ in range(updates):
        opt.zero_grad()
        losses = []
        for _ in range(update_every):
            inputs, targets = next(stream)
            losses.append(task.loss_fn(model(*inputs), targets))
        torch.stack(losses).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def _trained(stages: int, synchronous: bool, clip: float | None,
             task: ModuleType = skipnet) -> dict[str, torch.Tensor]:
    workers = make_workers(task, stages, steps=UPDATES * UPDATE_EVERY, max_inflight=stages,
                           update_every=UPDATE_EVERY, predict_weights=PREDICT_WEIGHTS,
                           extrapolate_gradients=EXTRAPOLATE_GRADIENTS, stale_correction="auto",
                           recipe=RecipeOptions(clip_grad_norm=clip), synchronous=synchronous)
    run_workers(workers)
    assert all(w.version == UPDATES for w in workers)
    if synchronous:
        assert all(w.stats.staleness_max == 0 for w in workers)
    return merged_state(workers)


@pytest.mark.parametrize("clip", [None, MAX_NORM], ids=["plain", "clipped"])
@pytest.mark.parametrize("stages", [2, 3])
def test_sync_schedule_with_several_in_flight_equals_one_process(stages: int, clip: float | None) -> None:
    want = one_process(UPDATES, UPDATE_EVERY, clip)
    got = _trained(stages, True, clip)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_sync_schedule_keeps_weights_tied_across_stages_exact() -> None:
    """A weight read by the first and the last stage (``tests.zoo.tied``): each forward waits until its copy
    took every update before it, so the tied copies train as the one weight of one process."""
    want = one_process(UPDATES, UPDATE_EVERY, None, zoo.tied)
    got = _trained(3, True, None, zoo.tied)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_without_the_flush_the_same_settings_train_stale() -> None:
    """The control: the asynchronous schedule with the same window starts the next update's micro-batches
    at the old weights, so it ends elsewhere (what makes the equality above mean something)."""
    want = one_process(UPDATES, UPDATE_EVERY, None)
    got = _trained(3, False, None)
    assert max(float((got[n] - want[n]).abs().max()) for n in want) > 1e-4


def test_the_schedule_is_checked() -> None:
    assert TrainingConfig(schedule="sync").schedule == "sync"
    assert TrainingConfig().schedule == "async"
    with pytest.raises(ValueError, match="schedule"):
        TrainingConfig(schedule="1f1b")


def test_the_sync_schedule_skips_the_asynchrony_warm_up() -> None:
    """Warm-up keeps one micro-batch in flight against staleness; the synchronous schedule has none, so it
    fills its pipeline from the first update (the flush alone bounds it to the update's micro-batches)."""
    warm = {"steps": 40, "max_inflight": 3, "update_every": 4, "inflight_warmup_steps": 20}
    assert StageOptions(**warm).inflight_limit(0) == 1
    assert StageOptions(**warm, synchronous=True).inflight_limit(0) == 3
