"""The training recipe without sockets: LR schedules, named-parameter optimizers, mixed precision,
global-norm clipping and training metrics, each against one process (docs/training.md)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ravq.config import TrainingConfig
from ravq.cut.split import build_task_model
from ravq.stage import build
from ravq.stage.lr import ScheduleSpec, lr_lambda
from ravq.stage.recipe import recipe_options
from ravq.stage.types import RecipeOptions
from tests import models_for_tests as skipnet
from tests import recipe_tasks
from tests.pipeline_harness import make_workers, merged_state, run_workers
from tests.recipe_reference import train_one_process_recipe

STEPS = 24
COSINE = ScheduleSpec("cosine", warmup_steps=4, total_steps=STEPS, min_lr_ratio=0.1)
MAX_NORM = 0.5
"""Binds: skipnet's gradient norms stay above 1 over these steps (checked below)."""


def _reference_norms(task, steps: int) -> list[float]:
    """Global gradient norms one process sees with clipping at MAX_NORM (to show that it binds)."""
    seen: list[float] = []
    orig = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **k):
        norm = orig(params, max_norm, *a, **k)
        seen.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = spy
    try:
        train_one_process_recipe(task, RecipeOptions(clip_grad_norm=MAX_NORM), steps=steps)
    finally:
        torch.nn.utils.clip_grad_norm_ = orig
    return seen


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stages", [1, 3])
def test_sync_recipe_equals_one_process(stages: int, precision: str) -> None:
    """max_inflight 1: cosine schedule with warmup, clipping that binds and autocast end with the weights of
    one process running LambdaLR, clip_grad_norm_ and the same autocast.  Tolerance 1e-5 for every
    precision: autocast casts the same float32 master weights to the same bf16/fp16 values on both sides
    and activations cross the cuts in autocast's own dtype, so only float32 accumulation order differs
    (measured: <1e-7); fp16's loss scale is a power of two, so unscaling is exact."""
    recipe = RecipeOptions(precision=precision, lr_lambda=lr_lambda(COSINE), clip_grad_norm=MAX_NORM)
    workers = make_workers(skipnet, stages, steps=STEPS, max_inflight=1, recipe=recipe)
    run_workers(workers)
    want = train_one_process_recipe(skipnet, recipe, steps=STEPS)
    got = merged_state(workers)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    assert min(_reference_norms(skipnet, STEPS)) > MAX_NORM  # the clipping bound every step
    assert all(w.version == STEPS and not w.recipe.unfinished() for w in workers)


def test_recipe_changes_the_weights() -> None:
    """The comparison above can fail: without the recipe the weights differ from the recipe's reference."""
    recipe = RecipeOptions(lr_lambda=lr_lambda(COSINE), clip_grad_norm=MAX_NORM)
    workers = make_workers(skipnet, 3, steps=STEPS, max_inflight=1)
    run_workers(workers)
    want = train_one_process_recipe(skipnet, recipe, steps=STEPS)
    got = merged_state(workers)
    assert max((got[n] - want[n]).abs().max().item() for n in want) > 1e-3


def test_async_clipping_scales_each_step_alike_on_every_stage() -> None:
    """max_inflight 4 on 4 stages: every stage applies every step, each with the factor of that step's
    global norm, the same on all stages; nothing waits (the held steps ride on the staleness bound)."""
    recipe = RecipeOptions(clip_grad_norm=MAX_NORM)
    workers = make_workers(skipnet, 4, steps=40, max_inflight=4, recipe=recipe)
    run_workers(workers)
    assert all(w.version == 40 for w in workers)
    first = list(workers[0].recipe.applied)
    assert len(first) == 40 and any(f < 1.0 for _, f in first)
    for w in workers[1:]:
        assert list(w.recipe.applied) == first
    assert all(w.stats.staleness_max <= 3 for w in workers)


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_0_sends_each_norm_on_at_once_with_micro_batches_in_flight(stages: int) -> None:
    """With 2 in flight, the norm of step v leaves stage 0 on a message of its own right after the step, not
    first on the forward of micro-batch v + 2 (a later stage applied the step as that forward arrived,
    between it and its backward: on the round trip, docs/training.md).  Every stage's arrivals from its
    producer show it: step v's norm comes before micro-batch v + 2, also where a middle stage relays it."""
    steps = 10
    workers = make_workers(skipnet, stages, steps=steps, max_inflight=2, recipe=RecipeOptions(clip_grad_norm=MAX_NORM))
    arrivals: list[list[tuple[str, int, list[int]]]] = [[] for _ in workers]
    for s, w in enumerate(workers[1:], start=1):
        def record(kind, mb, source, tensors, meta=None, s=s, deliver=w.deliver):
            if kind == "fwd" and source == s - 1:
                arrivals[s].append(("tail" if (meta or {}).get("tail") else "fwd", mb[1],
                                    [step for step, _ in (meta or {}).get("norms", [])]))
            return deliver(kind, mb, source, tensors, meta)
        w.deliver = record
    run_workers(workers)
    assert all(w.version == steps for w in workers)
    for s in range(1, stages):
        for v in range(steps - 2):
            first_norm = next(i for i, (_, _, norms) in enumerate(arrivals[s]) if v in norms)
            forward = next(i for i, (kind, index, _) in enumerate(arrivals[s]) if kind == "fwd" and index == v + 2)
            assert first_norm < forward, (s, v, arrivals[s])


def test_named_params_groups_lr_lambda_and_resume_are_exact(tmp_path: Path) -> None:
    """A task's make_optimizer(named_params) with decay groups in another order than the module's and the
    task's lr_lambda: sync equals one process, and a run checkpointed at step 10 and resumed ends where
    an uninterrupted run ends (LR factor from the restored version, initial_lr from the optimizer state)."""
    recipe = RecipeOptions(lr_lambda=recipe_tasks.lr_lambda, clip_grad_norm=MAX_NORM)
    whole = make_workers(recipe_tasks, 3, steps=20, max_inflight=1, recipe=recipe)
    run_workers(whole)
    assert len(whole[0].optimizer.param_groups) == 2
    want = train_one_process_recipe(recipe_tasks, recipe, steps=20)
    for name, value in merged_state(whole).items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
    first = make_workers(recipe_tasks, 3, steps=10, max_inflight=1, recipe=recipe)
    run_workers(first)
    nodes = [f"n{i}" for i in range(3)]
    for i, w in enumerate(first):
        build.save(w, str(tmp_path), cluster=0, stage=i, node=nodes[i], run_id="r", cluster_nodes=nodes)
    second = make_workers(recipe_tasks, 3, steps=20, max_inflight=1, recipe=recipe)
    for i, w in enumerate(second):
        assert build.resume(w, str(tmp_path), cluster=0, stage=i, update_every=1, name=nodes[i]) == "r"
    assert second[0].optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * recipe_tasks.lr_lambda(9))
    run_workers(second)
    for name, value in merged_state(whole).items():
        torch.testing.assert_close(merged_state(second)[name], value, rtol=0, atol=0, msg=name)


def test_schedules_shapes() -> None:
    warm = lr_lambda(ScheduleSpec("warmup", warmup_steps=3, total_steps=10))
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = lr_lambda(COSINE)
    assert cos(4) == 1.0 and cos(STEPS) == pytest.approx(0.1) and cos(14) == pytest.approx(0.55)
    lin = lr_lambda(ScheduleSpec("linear", warmup_steps=0, total_steps=10, min_lr_ratio=0.0))
    assert [lin(s) for s in (0, 5, 10, 20)] == [1.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="lr_lambda"):
        lr_lambda(ScheduleSpec("task"))


def test_recipe_options_from_the_topology() -> None:
    training = TrainingConfig(steps=100, update_every=2, precision="bf16", clip_grad_norm=1.0,
                              lr_schedule={"kind": "cosine", "warmup_steps": 5})
    opts = recipe_options(recipe_tasks, training)
    assert opts.precision == "bf16" and opts.clip_grad_norm == 1.0 and opts.metrics_fn is recipe_tasks.metrics_fn
    assert opts.lr_lambda is not None and opts.lr_lambda(50) == pytest.approx(0.0)  # total: 100 / 2 steps
    with pytest.raises(ValueError, match="warmup_steps"):
        recipe_options(skipnet, TrainingConfig(steps=10, lr_schedule={"kind": "warmup", "warmup_steps": 10}))
    with pytest.raises(ValueError, match="lr_lambda"):
        recipe_options(skipnet, TrainingConfig(lr_schedule={"kind": "task"}))
    with pytest.raises(ValueError, match="clip_grad_norm"):
        TrainingConfig(clip_grad_norm=0)


def test_training_metrics_are_averaged_per_step() -> None:
    recipe = RecipeOptions(metrics_fn=recipe_tasks.metrics_fn)
    workers = make_workers(recipe_tasks, 2, steps=12, max_inflight=1, update_every=3, recipe=recipe)
    run_workers(workers)
    acc = workers[-1].recipe.train_metrics["accuracy"]
    assert 0.0 <= acc <= 1.0 and acc * 12 == pytest.approx(round(acc * 12))  # a mean over 3 x 4 samples
    assert workers[0].recipe.train_metrics == {}


def test_malformed_norms_are_refused_before_torch() -> None:
    workers = make_workers(skipnet, 2, steps=1, max_inflight=1, recipe=RecipeOptions(clip_grad_norm=1.0))
    x = torch.zeros(4, 8)
    assert workers[1].deliver("fwd", (0, 0), 0, {"o0": x}, {"norms": [["a", 1.0]]}) == "bad_meta"
    assert workers[0].deliver("bwd", (0, 0), 1, {}, {"sq": {"7": 1.0}}) == "bad_meta"
    assert workers[0].deliver("bwd", (0, 0), 1, {}, {"ls": -1}) == "bad_meta"


def test_fp16_overflow_skips_the_step_on_every_stage_and_halves_the_scale() -> None:
    """A loss scale so large that fp16 gradients overflow: every stage skips the same steps (weights
    unchanged) until the last stage's scale has come down, then trains."""
    workers = make_workers(skipnet, 3, steps=30, max_inflight=1, recipe=RecipeOptions(precision="fp16"))
    workers[-1].recipe.loss_scale.scale = 2.0 ** 40
    start = merged_state(workers)
    start = {k: v.clone() for k, v in start.items()}
    run_workers(workers)
    skipped = workers[-1].recipe.loss_scale.skipped
    assert skipped > 0 and workers[-1].recipe.loss_scale.scale < 2.0 ** 40
    factors = [list(w.recipe.applied) for w in workers]
    assert factors[0] == factors[1] == factors[2]
    assert any(not math.isclose((merged_state(workers)[k] - start[k]).abs().max().item(), 0) for k in start)


def _one_process_eval(task, state: dict[str, torch.Tensor], count: int, micro_batch: int = 4) -> float:
    model = build_task_model(task, 0)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        losses = [float(task.loss_fn(model(*x), y)) for x, y in itertools.islice(task.eval_batches(micro_batch, 0), count)]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("stages", [1, 3])
def test_eval_loss_equals_the_exported_model_in_one_process(stages: int) -> None:
    """Dropout and BatchNorm in every stage; sync mode: the round at the last step evaluates exactly the final
    weights and running statistics in eval mode (1e-5), and the round at step 6 those of step 6."""
    recipe = RecipeOptions(eval_every=6, eval_count=3, eval_batches=recipe_tasks.dropout_bn.eval_batches,
                           metrics_fn=recipe_tasks.metrics_fn)
    torch.manual_seed(0)  # dropout masks: the 6-step run below must draw the same ones
    workers = make_workers(recipe_tasks.dropout_bn, stages, steps=12, max_inflight=1, recipe=recipe)
    run_workers(workers)
    ev = workers[-1].recipe.evaluator
    assert [v for v, _ in ev.history] == [6, 12] and all(w.recipe.evaluator.rounds_done == 2 for w in workers)
    state = merged_state(workers)
    assert ev.history[-1][1] == pytest.approx(_one_process_eval(recipe_tasks.dropout_bn, state, 3), abs=1e-5)
    assert 0.0 <= ev.metrics["accuracy"] <= 1.0
    assert workers[-1].stats.snapshot()["eval_loss"] == ev.history[-1][1]
    torch.manual_seed(0)
    six = make_workers(recipe_tasks.dropout_bn, stages, steps=6, max_inflight=1)
    run_workers(six)
    assert ev.history[0][1] == pytest.approx(_one_process_eval(recipe_tasks.dropout_bn, merged_state(six), 3), abs=1e-5)


@pytest.mark.parametrize("stages", [1, 3])
def test_a_short_held_out_set_ends_each_round_with_what_it_gave(stages: int) -> None:
    """eval_batches yields 2 micro-batches where a round takes up to 4: every stage ends each round after 2
    (it hung waiting for the other 2), and the loss is their mean on the final weights."""
    def two(micro_batch: int, seed: int):
        return itertools.islice(recipe_tasks.dropout_bn.eval_batches(micro_batch, seed), 2)

    recipe = RecipeOptions(eval_every=3, eval_count=4, eval_batches=two)
    workers = make_workers(recipe_tasks.dropout_bn, stages, steps=6, max_inflight=1, recipe=recipe)
    run_workers(workers, timeout_s=20)
    ev = workers[-1].recipe.evaluator
    assert [v for v, _ in ev.history] == [3, 6] and all(w.recipe.evaluator.rounds_done == 2 for w in workers)
    assert ev.history[-1][1] == pytest.approx(_one_process_eval(recipe_tasks.dropout_bn, merged_state(workers), 2),
                                              abs=1e-5)
    if stages > 1:  # a round's size is 1 to eval_count micro-batches
        assert workers[1].deliver("fwd", (0, 9), 0, {}, {"eval": 2, "of": 5}) == "bad_meta"


def test_a_held_out_set_without_a_micro_batch_is_refused_at_start() -> None:
    recipe = RecipeOptions(eval_every=3, eval_count=4, eval_batches=lambda micro_batch, seed: iter(()))
    with pytest.raises(ValueError, match="eval_batches.*yields no micro-batch"):
        make_workers(recipe_tasks.dropout_bn, 2, steps=6, max_inflight=1, recipe=recipe)


def test_traced_stages_ignore_eval_mode_so_a_second_graph_is_needed() -> None:
    """The issue's finding, kept true: module.eval() on a training-mode traced stage changes nothing
    (dropout stays on), while the eval-mode graph is deterministic and matches model.eval()."""
    workers = make_workers(recipe_tasks.dropout_bn, 3, steps=1, max_inflight=1,
                           recipe=RecipeOptions(eval_every=1, eval_batches=recipe_tasks.dropout_bn.eval_batches))
    run_workers(workers)  # running statistics move: the eval graph must read the stage's own
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    mods = [w.module for w in workers]
    for m in mods:
        m.eval()
    with torch.no_grad():
        runs = [mods[2](mods[1](mods[0](x))) for _ in range(2)]
        evs = [w.recipe.evaluator.module for w in workers]
        eval_runs = [evs[2](evs[1](evs[0](x))) for _ in range(2)]
    assert (runs[0] - runs[1]).abs().max() > 1e-3
    torch.testing.assert_close(eval_runs[0], eval_runs[1], rtol=0, atol=0)
    model = build_task_model(recipe_tasks.dropout_bn, 0)
    model.load_state_dict(merged_state(workers))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(eval_runs[0], model(x), rtol=0, atol=1e-5)


def test_an_eval_round_larger_than_the_queue_reaches_the_last_stage_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 sends a round's targets straight to the last stage, all at once: with 3 stages and a round
    of 24 where 8 micro-batches may wait, the last stage must still take every one (it refused the 9th
    half-arrived one, and the round never ended)."""
    recipe = RecipeOptions(eval_every=1, eval_count=24, eval_batches=recipe_tasks.dropout_bn.eval_batches)
    workers = make_workers(recipe_tasks.dropout_bn, 3, steps=2, max_inflight=1, recipe=recipe)
    held: list[tuple[Any, ...]] = []
    deliver = workers[1].deliver

    def hold_a_round(kind: str, *rest: Any) -> str | None:
        """Stage 1 takes each round only once stage 0 has sent all of it: the last stage has the targets of
        the whole round waiting before a forward comes (the order a slow stage 1 gives)."""
        if kind != "eval":
            return deliver(kind, *rest)
        held.append((kind, *rest))
        if len(held) < 24:
            return None
        refused = [deliver(*args) for args in held]
        held.clear()
        return next((r for r in refused if r is not None), None)

    monkeypatch.setattr(workers[1], "deliver", hold_a_round)
    run_workers(workers, timeout_s=30)
    assert [v for v, _ in workers[-1].recipe.evaluator.history] == [1, 2]
    assert all(w.recipe.evaluator.rounds_done == 2 for w in workers)


def test_eval_rounds_run_between_micro_batches_in_flight() -> None:
    recipe = RecipeOptions(eval_every=5, eval_count=2, eval_batches=recipe_tasks.dropout_bn.eval_batches,
                           clip_grad_norm=1.0)
    workers = make_workers(recipe_tasks.dropout_bn, 3, steps=20, max_inflight=3, recipe=recipe)
    run_workers(workers)
    assert [v for v, _ in workers[-1].recipe.evaluator.history] == [5, 10, 15, 20]
    assert all(w.version == 20 for w in workers)
