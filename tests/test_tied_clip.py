"""Clipping by global norm and fp16's overflow check with weights tied across stages, in one process.

The global norm counts a tied weight once, by its summed gradient (the lowest holder adds it), and each tied
step is scaled by its step's clipping factor, or skipped on an overflow, like every stage's own step
(``ravq.stage.tied_step``).  Before this, the copies' gradients left the norm and their tied step ran
unclipped: 0.098 off one process on the tied weight (the feature matrix's ``sync + tied + clip``).
"""

from __future__ import annotations

import math

import pytest
import torch

from ravq.cut.tied import TiedGroup
from ravq.stage.clip import Applied
from ravq.stage.lr import ScheduleSpec, lr_lambda
from ravq.stage.tied_step import TiedExchange
from ravq.stage.types import RecipeOptions
from tests import zoo
from tests.pipeline_harness import make_workers, merged_state, run_workers
from tests.recipe_reference import train_one_process_recipe
from tests.test_schedule_sync import one_process
from tests.test_tied import _assert_copies_equal

MAX_NORM = 0.01
"""Binds at every step of ``zoo.tied`` (its global norms are 0.1-1)."""
STEPS = 8


def _norms_of_one_process(steps: int) -> list[float]:
    seen: list[float] = []
    orig = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):  # type: ignore[no-untyped-def]
        norm = orig(params, max_norm, *args, **kwargs)
        seen.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = spy
    try:
        train_one_process_recipe(zoo.tied, RecipeOptions(clip_grad_norm=MAX_NORM), steps=steps)
    finally:
        torch.nn.utils.clip_grad_norm_ = orig
    return seen


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stages", [2, 3])
def test_tied_weights_clipped_like_one_process(stages: int, precision: str) -> None:
    """max_inflight 1, clipping that binds, an LR schedule: every weight equals one process's to 1e-5 (the
    tied weight included) and the copies are bit-identical."""
    cosine = lr_lambda(ScheduleSpec("cosine", 2, STEPS, 0.1))
    recipe = RecipeOptions(precision=precision, lr_lambda=cosine, clip_grad_norm=MAX_NORM)
    workers = make_workers(zoo.tied, stages, steps=STEPS, max_inflight=1, recipe=recipe)
    run_workers(workers)
    _assert_close(merged_state(workers), train_one_process_recipe(zoo.tied, recipe, steps=STEPS))
    _assert_copies_equal(workers)
    assert min(_norms_of_one_process(STEPS)) > MAX_NORM  # the bound binds at every step
    norms = {w.spec.index: w.recipe.grad_norm for w in workers}
    assert len(set(norms.values())) == 1, norms  # every stage clipped its last step by the same norm


def test_the_global_norm_counts_the_tied_weight_once() -> None:
    """The last step's global norm on every stage is one process's, which counts the tied weight's summed
    gradient once (not each copy's, and not none)."""
    recipe = RecipeOptions(clip_grad_norm=MAX_NORM)
    workers = make_workers(zoo.tied, 3, steps=STEPS, max_inflight=1, recipe=recipe)
    run_workers(workers)
    want = _norms_of_one_process(STEPS)[-1]
    for w in workers:
        assert w.recipe.grad_norm == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("stages", [2, 3])
def test_sync_schedule_with_tied_weights_and_clipping_equals_one_process(stages: int) -> None:
    """``training.schedule: sync``, 4 micro-batches per update and several in flight."""
    workers = make_workers(zoo.tied, stages, steps=24, max_inflight=stages, update_every=4,
                           recipe=RecipeOptions(clip_grad_norm=MAX_NORM), synchronous=True)
    run_workers(workers)
    _assert_close(merged_state(workers), one_process(6, 4, MAX_NORM, zoo.tied))
    _assert_copies_equal(workers)


@pytest.mark.parametrize("update_every", [1, 2])
def test_asynchronous_tied_and_clipped_copies_end_identical(update_every: int) -> None:
    """Several in flight: the lowest holder waits for the other holder's part of each step, tied steps wait
    for their step's norm; nothing deadlocks, every step applies, and the copies end bit-identical."""
    workers = make_workers(zoo.tied, 3, steps=24, max_inflight=3, update_every=update_every,
                           recipe=RecipeOptions(clip_grad_norm=MAX_NORM))
    run_workers(workers)
    _assert_copies_equal(workers)
    assert all(w.version == 24 // update_every for w in workers)
    factors = [dict(w.recipe.applied) for w in workers]
    assert all(f == factors[0] for f in factors) and all(c < 1.0 for c in factors[0].values())


# ----------------------------------------------------------------- the exchange alone (no pipeline)
def _exchange(stage: int) -> tuple[TiedExchange, torch.nn.Parameter, torch.optim.Optimizer]:
    weight = torch.nn.Parameter(torch.ones(2, 2))
    group = TiedGroup("w", ("w",), (0, 1))
    return TiedExchange(stage, [group], {"w": weight}, 1), weight, torch.optim.SGD([weight], lr=1.0)


def test_a_tied_step_waits_for_its_factor_and_is_scaled_by_it() -> None:
    tied, weight, opt = _exchange(0)
    weight.grad = torch.full((2, 2), 2.0)
    tied.contribute(lambda *_: None, name=7)
    tied.receive(1, 1, {"g:w": torch.full((2, 2), 1.0)})
    assert tied.counted == tied.groups and tied.counted_in(1)
    assert tied.counted_norm(1) == pytest.approx(4 * 3.0**2)  # the sum's norm, not each part's
    factors: dict[int, Applied] = {}
    assert not tied.apply_ready(opt, {"w": weight}, lambda: None, factors.get)
    assert torch.equal(weight.detach(), torch.ones(2, 2)) and tied.applied == {"w": 0}  # norm unknown
    factors[7] = Applied(0.5, True, (1.0,))
    assert tied.apply_ready(opt, {"w": weight}, lambda: None, factors.get)
    assert torch.equal(weight.detach(), torch.full((2, 2), 1 - 1.5)) and tied.applied == {"w": 1}


def test_a_tied_step_whose_norm_overflowed_is_skipped_but_counted() -> None:
    tied, weight, opt = _exchange(1)
    assert tied.counted == []  # stage 0 counts the group
    weight.grad = torch.full((2, 2), math.inf)
    tied.contribute(lambda *_: None, name=3)
    tied.receive(0, 1, {"g:w": torch.ones(2, 2)})
    tied.apply_ready(opt, {"w": weight}, lambda: None, {3: Applied(1.0, False)}.get)
    assert torch.equal(weight.detach(), torch.ones(2, 2)) and tied.applied == {"w": 1} and tied.settled()


def test_a_last_partial_step_is_not_held_for_a_norm() -> None:
    """A step contributed without a name (the run's last, partial update) applies unscaled."""
    tied, weight, opt = _exchange(0)
    weight.grad = torch.ones(2, 2)
    tied.contribute(lambda *_: None)
    tied.receive(1, 1, {"g:w": torch.ones(2, 2)})
    assert tied.apply_ready(opt, {"w": weight}, lambda: None, {}.get)
    assert torch.equal(weight.detach(), torch.full((2, 2), -1.0))


@pytest.mark.parametrize("stages", [2, 3])
def test_asynchronous_tied_copies_take_each_step_at_its_scheduled_rate(stages: int) -> None:
    """No clipping, an LR schedule, 2 in flight: a holder's tied step j may run after its own step j + 1 set
    the next rate; it runs at step j's, so the copies end bit-identical (they drifted apart before)."""
    cosine = lr_lambda(ScheduleSpec("cosine", 2, 30, 0.1))
    workers = make_workers(zoo.tied, stages, steps=30, max_inflight=2, recipe=RecipeOptions(lr_lambda=cosine))
    run_workers(workers)
    _assert_copies_equal(workers)
    assert all(w.version == 30 for w in workers)


def test_a_pause_forgets_how_steps_were_applied() -> None:
    """After a pause's reset a re-queued micro-batch names a new step as an old one was named; the new count's
    tied step must wait for the new step, not take the old one's factor and rates."""
    workers = make_workers(zoo.tied, 2, steps=6, max_inflight=2, recipe=RecipeOptions(clip_grad_norm=MAX_NORM))
    run_workers(workers)
    last = workers[-1]
    named = [step for step, _ in last.recipe.applied]
    assert named and last.recipe.step_applied(named[-1]) is not None
    last.reset(generation=1)
    assert all(last.recipe.step_applied(step) is None for step in named)
