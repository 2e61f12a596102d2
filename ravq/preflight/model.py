"""The model at the planned cuts: built and traced on ``meta`` as a node builds it, then described: tied
weights and where each copy lives, weights no stage reads, buffers, and what evaluation mode changes."""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

from torch import nn

from ravq.cut.meta import build_meta_model, to_meta
from ravq.cut.split import SplitError, StageSpec, build_task_model, candidate_cuts, even_cuts, split_model
from ravq.cut.tied import read_names, settle_ties, tie_groups
from ravq.preflight.report import Report

MAX_NAMED = 5
"""Names listed in one finding, at most."""

DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _names(names: list[str]) -> str:
    more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return ", ".join(names[:MAX_NAMED]) + more


def meta_model(task: Any, seed: int, report: Report) -> tuple[nn.Module, bool] | None:
    """The task's model on ``meta`` (True), else with real weights (False), as a node falls back to it."""
    try:
        return build_meta_model(task, seed).model, True
    except Exception as meta_err:  # noqa: BLE001 - user code: the real build says what is wrong, if anything
        try:
            model = build_task_model(task, seed)
        except Exception as err:  # noqa: BLE001
            report.add(
                "error",
                "build",
                f"build_model() failed: {type(err).__name__}: {err}",
                "make build_model() return the model (a torch.nn.Module) without arguments",
            )
            return None
        report.add(
            "warning",
            "build",
            f"the model cannot be built on the meta device ({type(meta_err).__name__}: "
            f"{str(meta_err)[:200]}): every node builds and traces the whole model with real weights",
            "build parameters with torch.nn layers or nn.Parameter (no .numpy(), .item() or data-dependent "
            "code in __init__) so that no PC needs the whole model",
        )
        return model, False


def planned_cuts(model: nn.Module, task: Any, stages: int, report: Report) -> list[str] | None:
    """Cuts spread evenly over the task's candidate cuts, as ``ravq demo`` and an unplanned topology cut."""
    candidates = candidate_cuts(model, task)
    try:
        return even_cuts(candidates, stages)
    except ValueError as err:
        message, _, fix = str(err).partition("; ")
        report.add("error", "split", message, fix)
        return None


def split(
    model: nn.Module, example: tuple[Any, ...], cuts: list[str], report: Report, task: Any, seed: int
) -> list[StageSpec] | None:
    """The stages as a node traces them; None after naming why the model cannot be cut there.  ``task``: a
    model on ``meta`` that cannot be traced there is traced with real weights, as a node falls back to."""
    modules = dict(model.named_modules())
    unknown = [c for c in cuts if c not in modules]
    if unknown:
        report.add(
            "error",
            "split",
            f"cut(s) {_names(unknown)} name no module of the model",
            f"cut at module names the model has, e.g. {_names(candidate_cuts(model))}",
        )
        return None
    dumped = io.StringIO()  # torch.export prints the partial graph of a failed trace to stderr
    try:
        with contextlib.redirect_stderr(dumped):
            specs = split_model(model, example, cuts)
        sys.stderr.write(dumped.getvalue())
        return specs
    except SplitError as err:  # the finding names the cause and the line: the graph dump is left out
        report.add(
            "error",
            "split",
            f"cannot cut the model at {cuts}: {err}",
            "change what the message names, or cut elsewhere (the task's split_points())",
        )
    except Exception as err:  # noqa: BLE001 - user code runs in the trace
        if task is not None:
            report.add(
                "warning",
                "split",
                f"the model cannot be traced on the meta device ({type(err).__name__}: {str(err)[:200]}): "
                "every node traces it with real weights, which needs the whole model in its memory",
                "no Python control flow on tensor values in forward (torch.where, or cut around it)",
            )
            return split(build_task_model(task, seed), example, cuts, report, None, seed)
        report.add(
            "error",
            "split",
            f"tracing the model at {cuts} failed: {type(err).__name__}: {err}",
            "run build_model()(*example_inputs(micro_batch)) in Python first: forward must run on them",
        )
    return None


def describe(model: nn.Module, specs: list[StageSpec], report: Report) -> None:
    """Ties, weights nothing reads, buffers and evaluation mode, as findings."""
    seen: set[str] = set()
    for spec in specs:
        for group in spec.tied:
            if group.key in seen:
                continue
            seen.add(group.key)
            every = {n for s in specs for g in s.tied if g.key == group.key for n in g.names}
            names = sorted(every - {group.key})  # the tensor's other names
            report.add(
                "info",
                "tied",
                f"{group.key} (= {_names(names)}) is one tensor read by stages "
                f"{list(group.holders)}: each holds a copy, kept equal after every step; stage "
                f"{group.primary} averages it",
            )
    for group in tie_groups(model):
        if group[0] not in seen:
            report.add("info", "tied", f"{group[0]} (= {_names(group[1:])}) is one tensor, held by one stage")
    if len(specs) > 1:
        read = set().union(*(read_names(s.module) for s in specs))
        unread = [n for n, p in model.named_parameters() if n not in read and p.requires_grad]
        if unread:
            report.add(
                "warning",
                "unused",
                f"no stage reads parameter(s) {_names(unread)}: they never get a "
                "gradient; stage 0 keeps them unchanged (and checkpoints and exports them)",
                "remove them from the model, use them in forward, or freeze them (requires_grad=False)",
            )
    _buffers(model, report)
    _eval_mode(model, report)


def _buffers(model: nn.Module, report: Report) -> None:
    persistent = set(model.state_dict())
    buffers = [n for n, _ in model.named_buffers()]
    if not buffers:
        return
    kept = [n for n in buffers if n in persistent]
    constant = [n for n in buffers if n not in persistent]
    if kept:
        report.add(
            "info",
            "buffers",
            f"{len(kept)} persistent buffer(s) ({_names(kept)}): each lives in the "
            "stage that reads it, saved in its checkpoints and averaged across clusters",
        )
    if constant:
        report.add(
            "info",
            "buffers",
            f"{len(constant)} non-persistent buffer(s) ({_names(constant)}): "
            "constants, never saved nor averaged",
        )


def _eval_mode(model: nn.Module, report: Report) -> None:
    dropout = [n for n, m in model.named_modules() if isinstance(m, DROPOUTS) and m.p > 0]
    norms = [n for n, m in model.named_modules() if isinstance(m, BATCH_NORMS)]
    changes = []
    if dropout:
        changes.append(f"dropout is off in {len(dropout)} module(s) ({_names(dropout)})")
    if norms:
        changes.append(
            f"BatchNorm uses its running statistics in {len(norms)} module(s) ({_names(norms)}) where "
            "training uses each micro-batch's"
        )
    config = getattr(model, "config", None)
    functional = [
        k
        for k in (
            "attention_dropout",
            "attn_pdrop",
            "resid_pdrop",
            "embd_pdrop",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "dropout_rate",
            "dropout",
        )
        if isinstance(getattr(config, k, None), float) and getattr(config, k) > 0
    ]
    if functional:
        changes.append(f"the config's {_names(functional)} stop dropping")
    report.add(
        "info",
        "eval",
        "evaluation mode (a second graph per stage, traced in eval mode): "
        + ("; ".join(changes) if changes else "changes nothing (no dropout, no BatchNorm)"),
    )


def eval_graph_on_meta(
    task: Any, seed: int, example: tuple[Any, ...], cuts: list[str], specs: list[StageSpec], report: Report
) -> None:
    """For a model too large to materialize: each stage's eval-mode graph traced on ``meta`` reads only
    what its training stage holds (the rule ``ravq.stage.evaluate.eval_stage_module`` asserts at a node's
    start)."""
    if not cuts:
        return
    from ravq.cut.trace import split_pipe

    model = build_meta_model(task, seed).model
    model.eval()
    groups = tie_groups(model)
    try:
        pipe = split_pipe(model, to_meta(example), cuts)
    except Exception as err:  # noqa: BLE001 - user code runs in the trace
        report.add(
            "error",
            "eval",
            f"the model cannot be traced in eval mode at {cuts}: {type(err).__name__}: {str(err)[:300]}",
            "make forward traceable in eval mode too (model.eval())",
        )
        return
    modules = [pipe.get_stage_module(s) for s in range(len(cuts) + 1)]
    settle_ties(model, modules, groups)
    for spec, module in zip(specs, modules):
        have = {
            n
            for n, _ in [
                *spec.module.named_parameters(remove_duplicate=False),
                *spec.module.named_buffers(remove_duplicate=False),
            ]
        }
        lacking = [
            n
            for n, _ in [
                *module.named_parameters(remove_duplicate=False),
                *module.named_buffers(remove_duplicate=False),
            ]
            if n not in have
        ]
        if lacking:
            report.add(
                "error",
                "eval",
                f"stage {spec.index}'s eval graph reads {_names(lacking)}, which its training "
                "stage lacks: a node with training.eval_every fails at start",
                "read the same weights in eval mode as in training, or set training.eval_every: 0",
            )
