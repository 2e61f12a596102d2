"""One micro-batch through the split stages against the unsplit model, on a small materialized copy.

Both are built by ``ravq.cut.split.build_task_model`` (the weights every cluster starts from, whatever the
cut), run forward and backward on the task's first training batch with the same seed, and compared: the
loss and every parameter's gradient (a tied weight's copies summed, as ``ravq.stage.tied_step`` sums them).
With ``eval_batches``, each stage's eval graph is built as a node builds it
(``ravq.stage.evaluate.eval_stage_module``) and the held-out loss compared with the unsplit model's in eval
mode: an eval graph reading other weights than training's fails or scores the wrong model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ravq.cut.materialize import materialize
from ravq.cut.meta import build_meta_model
from ravq.cut.split import StageSpec, build_task_model, model_output, split_model
from ravq.cut.tied import tie_groups
from ravq.preflight.report import Report
from ravq.stage.evaluate import eval_stage_module

TOLERANCE = 1e-3
"""A difference above this, relative to 1 + the largest magnitude compared, is a wrong split."""

FIX = (
    "state kept in Python (a counter, a flag, a list) or control flow on tensor values in forward is frozen "
    "by the tracer at example_inputs: compute it from tensors, or cut elsewhere (split_points())"
)


def _scalar(loss: Any, report: Report) -> torch.Tensor | None:
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        report.add(
            "error",
            "interface",
            f"loss_fn returns {what}",
            "return one floating-point scalar tensor (e.g. the mean over the micro-batch)",
        )
        return None
    if not torch.isfinite(loss):
        report.add(
            "error",
            "numerics",
            f"the loss of the first training batch is {float(loss)}",
            "check the data and the initial weights (init_weights, reset_parameters)",
        )
        return None
    return loss


def _run(specs: list[StageSpec], inputs: tuple[Any, ...]) -> Iterator[tuple[StageSpec, Any, list[Any]]]:
    """Each stage's output on ``inputs``, the stages chained as the pipeline chains them."""
    outputs: dict[int, tuple[Any, ...]] = {}
    for spec in specs:
        args = [inputs[r.index] if r.stage < 0 else outputs[r.stage][r.index] for r in spec.received]
        out = spec.module(*args[: len(spec.inputs)])
        outputs[spec.index] = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        yield spec, out, args


def _split_loss(specs: list[StageSpec], loss_fn: Any, inputs: tuple[Any, ...], targets: Any) -> Any:
    for spec, out, args in _run(specs, inputs):
        if spec.index == len(specs) - 1:
            return loss_fn(model_output(spec, out, args), targets)
    raise AssertionError("no stages")


def _grads(modules: list[nn.Module], key: dict[str, str]) -> dict[str, torch.Tensor]:
    """Gradient per parameter of the unsplit model (by its first name), a tied weight's copies summed."""
    total: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():  # one name per tensor of this module
            if p.grad is not None:
                k = key.get(name, name)
                total[k] = total[k] + p.grad if k in total else p.grad.clone()
    return total


def compare(
    task: Any,
    seed: int,
    example: tuple[Any, ...],
    cuts: list[str],
    batch: tuple[tuple[Any, ...], Any],
    report: Report,
    held_out: tuple[tuple[Any, ...], Any] | None,
) -> None:
    """Sets ``report.largest_difference``; names a wrong loss, a difference, an unused weight, a failing
    eval graph."""
    inputs, targets = batch
    blueprint = build_meta_model(task, seed)  # what build_task_model does, with materialize's report
    made = materialize(blueprint.model, task, seed)
    if made.from_constructor:
        report.add("warning", "init", f"nothing initialises {', '.join(made.from_constructor[:5])} (no "
                   "reset_parameters() on its module, no task init_weights()): every node builds the whole "
                   "model once at start to take the constructor's values", "give the module a "
                   "reset_parameters() that sets it, or the task an init_weights(module, name)")
    torch.manual_seed(seed)
    reference = blueprint.model
    key = {n: group[0] for group in tie_groups(reference) for n in group}
    torch.manual_seed(seed)
    want = _scalar(task.loss_fn(reference(*inputs), targets), report)
    if want is None:
        return
    want.backward()
    unused = [n for n, p in reference.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        report.add(
            "warning",
            "unused",
            f"no gradient reaches {', '.join(unused[:5])}"
            + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            + ": they never train",
            "remove them, use them in forward, or freeze them (requires_grad=False)",
        )
    specs = split_model(build_task_model(task, seed), example, cuts)
    torch.manual_seed(seed)
    got = _scalar(_split_loss(specs, task.loss_fn, inputs, targets), report)
    if got is None:
        return
    got.backward()
    worst, where = abs(float(got.detach()) - float(want.detach())), "the loss"
    scale = abs(float(want.detach()))
    split_grads = _grads([s.module for s in specs], key)
    for name, grad in _grads([reference], key).items():
        other = split_grads.get(name)
        diff = float("inf") if other is None else float((other - grad).abs().max())
        scale = max(scale, float(grad.abs().max()))
        if diff > worst:
            worst, where = diff, f"the gradient of {name}"
    report.largest_difference = worst
    if worst > TOLERANCE * (1 + scale):
        report.add(
            "error",
            "numerics",
            f"the split stages differ from the unsplit model by {worst:.3g} in {where} "
            f"(one micro-batch, cut at {cuts})",
            FIX,
        )
    if held_out is not None:
        _compare_eval(task, seed, example, cuts, specs, reference, held_out, report)


def _compare_eval(
    task: Any,
    seed: int,
    example: tuple[Any, ...],
    cuts: list[str],
    specs: list[StageSpec],
    reference: nn.Module,
    held_out: tuple[tuple[Any, ...], Any],
    report: Report,
) -> None:
    inputs, targets = held_out
    eval_specs = []
    for spec in specs:
        try:
            module = eval_stage_module(task, seed, example, cuts, spec.index, spec.module)
        except Exception as err:  # noqa: BLE001 - what a node would hit at start
            report.add(
                "error",
                "eval",
                f"stage {spec.index}'s eval graph cannot be built as a node builds it "
                f"(ravq.stage.evaluate): {type(err).__name__}: {err}",
                "read the same weights in eval mode "
                "as in training (a tied weight, a module used only in eval), or set training.eval_every: 0",
            )
            return
        eval_specs.append(_with_module(spec, module))
    reference.eval()
    with torch.no_grad():
        want = float(task.loss_fn(reference(*inputs), targets))
        got = float(_split_loss(eval_specs, task.loss_fn, inputs, targets))
    report.eval_difference = abs(got - want)
    if abs(got - want) > TOLERANCE * (1 + abs(want)):
        report.add(
            "error",
            "eval",
            f"the split eval graphs score a held-out batch {got:.6g}, the unsplit model in "
            f"eval mode {want:.6g}: evaluation would not score the trained weights",
            "read the same weights in eval mode as in training",
        )


def _with_module(spec: StageSpec, module: nn.Module) -> StageSpec:
    return replace(spec, module=module)
