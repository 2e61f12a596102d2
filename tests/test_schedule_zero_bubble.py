"""``training.schedule: zero_bubble``: ``sync``'s flush per update with each backward split (ZB-H1): the
input-gradients go upstream first and the weight pass waits until the stage would idle or its update is due.

In-process (no sockets): at 2 and 3 stages with a stated batch of 4 micro-batches per update it trains
exactly as one process, plain, clipped and with tied weights; the weight passes really run after other
work; and the config refuses fp16 loss scaling with it."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ravq.config import EXTRAPOLATE_GRADIENTS, PREDICT_WEIGHTS, TrainingConfig
from ravq.cut.meta import build_meta_model, to_meta
from ravq.cut.split import candidate_cuts, even_cuts, split_model
from ravq.preflight.memory import MemorySettings, estimate
from ravq.preflight.report import Report
from ravq.stage import stash as stash_module
from ravq.stage.pipeline import StageWorker
from ravq.stage.stash import Stashed
from ravq.stage.types import RecipeOptions
from tests import models_for_tests as skipnet
from tests import zoo
from tests.pipeline_harness import make_workers, merged_state, run_in_order, run_workers
from tests.test_schedule_sync import MAX_NORM, UPDATE_EVERY, UPDATES, one_process


def _workers(stages: int, clip: float | None = None, task: ModuleType = skipnet,
             split: bool = True) -> list[StageWorker]:
    return make_workers(task, stages, steps=UPDATES * UPDATE_EVERY, max_inflight=stages,
                        update_every=UPDATE_EVERY, predict_weights=PREDICT_WEIGHTS,
                        extrapolate_gradients=EXTRAPOLATE_GRADIENTS, stale_correction="auto",
                        recipe=RecipeOptions(clip_grad_norm=clip), synchronous=True, split_backward=split)


def _assert_one_process(workers: list[StageWorker], clip: float | None, task: ModuleType = skipnet) -> None:
    assert all(w.version == UPDATES for w in workers)
    assert all(w.stats.staleness_max == 0 for w in workers)
    assert not any(w.has_deferred() for w in workers)
    want, got = one_process(UPDATES, UPDATE_EVERY, clip, task), merged_state(workers)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("clip", [None, MAX_NORM], ids=["plain", "clipped"])
@pytest.mark.parametrize("stages", [2, 3])
def test_zero_bubble_equals_one_process(stages: int, clip: float | None) -> None:
    workers = _workers(stages, clip)
    run_workers(workers)
    _assert_one_process(workers, clip)


def test_zero_bubble_keeps_weights_tied_across_stages_exact() -> None:
    """Stages holding tied copies run their backward whole (their step goes out before the input-gradients);
    the stage between them splits."""
    workers = _workers(3, task=zoo.tied)
    run_workers(workers)
    _assert_one_process(workers, None, zoo.tied)


def _recorded(workers: list[StageWorker]) -> list[list[tuple[str, Any]]]:
    """Each stage's passes in the order it ran them: F (the last stage: with its backward), B, W."""
    logs: list[list[tuple[str, Any]]] = []
    for w in workers:
        log: list[tuple[str, Any]] = []
        passes = w.passes

        def traced(name: str, fn: Callable[..., Any], log: list[tuple[str, Any]] = log) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                out = fn(*args)
                log.append((name, out if name == "W" else args[0]))
                return out
            return call

        passes.forward = traced("F", passes.forward)  # type: ignore[method-assign]
        passes.backward = traced("B", passes.backward)  # type: ignore[method-assign]
        passes.weights = traced("W", passes.weights)  # type: ignore[method-assign]
        logs.append(log)
    return logs


def _deferred_past_other_work(log: list[tuple[str, Any]]) -> list[Any]:
    """Micro-batches whose weight pass ran after other forwards or backwards that followed their B."""
    found = []
    for j, (kind, mb) in enumerate(log):
        if kind == "W":
            i = log.index(("B", mb))
            if any(k in ("F", "B") for k, _ in log[i + 1: j]):
                found.append(mb)
    return found


@pytest.mark.parametrize("split", [True, False], ids=["zero_bubble", "sync"])
def test_weight_passes_run_after_later_work(split: bool) -> None:
    """Run in one thread, deterministically: the middle of 3 stages sends a micro-batch's input-gradients,
    forwards the next micro-batch stage 0 could start, and only then runs the held weight pass; every
    update still equals one process.  ``sync`` (the control) runs no weight pass apart."""
    workers = _workers(3, split=split)
    logs = _recorded(workers)
    run_in_order(workers)
    _assert_one_process(workers, None)
    if split:
        assert _deferred_past_other_work(logs[1])
        assert [k for k, _ in logs[0]].count("W") == 0  # stage 0 sends no input-gradient: no split
    else:
        assert not any(k == "W" for log in logs for k, _ in log)


def test_the_schedule_is_checked() -> None:
    assert TrainingConfig(schedule="zero_bubble").schedule == "zero_bubble"
    assert TrainingConfig(schedule="zero_bubble", precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match="zero_bubble does not take precision fp16"):
        TrainingConfig(schedule="zero_bubble", precision="fp16")
    with pytest.raises(ValueError, match="schedule"):
        TrainingConfig(schedule="zb-h2")



def test_ravq_check_counts_the_graphs_kept_for_weight_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ravq check``'s estimate: a split stage (the last here) may hold an update's graphs, 4 where 1F1B
    holds 1, and for each the gradients its input pass kept for the weight pass, as many bytes as a real
    stage's input pass keeps; stage 0 runs its backward whole and holds what it did."""
    model = build_meta_model(skipnet, 0).model  # as ravq check builds it
    example = to_meta(skipnet.example_inputs(4))
    specs = split_model(model, example, even_cuts(candidate_cuts(model, skipnet), 2))
    _, targets = next(skipnet.train_batches(4, 0, 1, 0))

    def activations(split: int) -> list[int]:
        settings = MemorySettings(micro_batch=4, max_inflight=2, split_graphs=split)
        report = Report(task="", cuts=[], stages=2, micro_batch=4, max_inflight=2)
        return [m.activations for m in estimate(specs, example, targets, skipnet, settings, report, ["", ""])]

    kept: list[int] = []
    input_gradients = Stashed.input_gradients

    def recorded(stash: Stashed, *args: Any, **kwargs: Any) -> Any:
        grad_of, weight_pass = input_gradients(stash, *args, **kwargs)
        kept.append(weight_pass.nbytes)
        return grad_of, weight_pass

    monkeypatch.setattr(Stashed, "input_gradients", recorded)
    run_workers(_workers(2))
    whole, split = activations(0), activations(UPDATE_EVERY)
    assert kept and kept[0] > 0
    assert split[0] == whole[0] and split[1] == UPDATE_EVERY * (whole[1] + kept[0]) and whole[1] > 0


class _Counted(torch.autograd.Function):
    """A parameter-free activation that counts its backwards."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Counted.calls += 1
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2)


class _Stage(torch.nn.Module):
    """A middle stage: linear, counted activation, norm, linear; a second output only a weight reaches; the
    first linear applied again after the activation (``weight_used_twice``), or the first two layers under
    ``torch.utils.checkpoint`` (``checkpointed``: recomputed on the input pass, saved for the weight pass)."""

    def __init__(self, way: str) -> None:
        super().__init__()
        self.a, self.b, self.norm = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3), torch.nn.LayerNorm(6)
        self.bias, self.way = torch.nn.Parameter(torch.ones(3)), way

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return _Counted.apply(self.a(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = checkpoint(self.first, x, use_reentrant=False) if self.way == "checkpointed" else self.first(x)
        h = self.a(h) if self.way == "weight_used_twice" else h
        return self.b(self.norm(h)), self.bias * 2


def _stashed(module: torch.nn.Module) -> tuple[Stashed, list[torch.Tensor], list[torch.Tensor]]:
    weights = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3)).requires_grad_()
    outputs = functional_call(module, weights, (x,))
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(4)) for o in outputs]
    return Stashed(0, weights, [x], outputs), list(outputs), grads


@pytest.mark.parametrize("way", ["chain", "weight_used_twice", "checkpointed"])
def test_the_weight_pass_reuses_the_input_pass(way: str) -> None:
    """The split backward gives the whole one's gradients, and the activation's backward runs once in it, not
    twice (the weight pass starts where the weights' side leaves the inputs'), checkpointed too; a weight used
    at two places falls back to a walk from the outputs for the weight pass, still exact."""
    torch.manual_seed(0)
    module = _Stage(way)
    sums = {n: torch.nn.Parameter(torch.zeros_like(p)) for n, p in module.named_parameters()}
    stash, roots, grads = _stashed(module)
    want_inputs = stash.gradients_into(roots, grads, sums)
    want = {n: p.grad.clone() for n, p in sums.items() if p.grad is not None}
    assert set(want) == set(sums)
    for p in sums.values():
        p.grad = None
    stash, roots, grads = _stashed(module)
    _Counted.calls = 0
    got_inputs, weight_pass = stash.input_gradients(roots, grads)
    assert (weight_pass.fallback is not None) == (way == "weight_used_twice")
    stash.weights_into(weight_pass, sums)
    assert _Counted.calls == (2 if way == "weight_used_twice" else 1)
    for (_, got), (_, expect) in zip(got_inputs.items(), want_inputs.items()):
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(sums[name].grad, g, rtol=0, atol=1e-6, msg=name)


class _Twice(torch.nn.Module):
    """A gate computed once from a weight and used twice (as T5 shares its position bias): a graph that
    reaches that weight from two split nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.gate = torch.nn.Linear(16, 16), torch.nn.Parameter(torch.linspace(-1, 1, 16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate)
        return torch.tanh(self.layer(h) * gate) * gate


class _MidTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.head = torch.nn.Linear(zoo.FEATURES, 16), _Twice(), torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(torch.relu(self.inp(x))))


def test_a_stage_sharing_a_weight_stops_looking_for_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The middle of 3 stages applies a layer twice: its first input pass finds the shared weight and every
    later one skips the analysis (``reuse`` off); the last stage keeps reusing; all equal one process."""
    task = SimpleNamespace(build_model=_MidTwice, example_inputs=lambda mb: (torch.zeros(mb, zoo.FEATURES),),
                           loss_fn=zoo.batchnorm.loss_fn, train_batches=zoo.batchnorm.train_batches,
                           make_optimizer=zoo.batchnorm.make_optimizer, split_points=lambda: ["mid", "head"])
    calls: list[tuple[int, bool]] = []
    real = stash_module.input_pass

    def recorded(roots: Any, root_grads: Any, inputs: Any, weights: Any, *, reuse: bool = True) -> Any:
        calls.append((len(weights), reuse))
        return real(roots, root_grads, inputs, weights, reuse=reuse)

    monkeypatch.setattr(stash_module, "input_pass", recorded)
    workers = _workers(3, task=task)  # type: ignore[arg-type]
    run_workers(workers)
    _assert_one_process(workers, None, task)  # type: ignore[arg-type]
    middle, last = [r for n, r in calls if n == 3], [r for n, r in calls if n == 2]
    assert middle[0] and len(middle) > 1 and not any(middle[1:])
    assert last and all(last)
