"""The task interface, function by function: signatures, a first batch of ``train_batches`` and
``eval_batches``, and their shapes against ``example_inputs`` (which the stages are traced at)."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch

from ravq.preflight.report import Report

SIGNATURES: dict[str, tuple[tuple[str, ...], str]] = {
    "build_model": ((), "build_model() -> torch.nn.Module"),
    "example_inputs": (("micro_batch",), "example_inputs(micro_batch) -> tuple of tensors"),
    "loss_fn": (("outputs", "targets"), "loss_fn(outputs, targets) -> scalar tensor"),
    "train_batches": (
        ("micro_batch", "shard", "num_shards", "seed"),
        "train_batches(micro_batch, shard, num_shards, seed[, start]) -> iterator of (inputs, targets)",
    ),
    "make_optimizer": (("params",), "make_optimizer(params) or make_optimizer(named_params=...)"),
    "eval_batches": (
        ("micro_batch", "seed"),
        "eval_batches(micro_batch, seed) -> iterator of (inputs, targets)",
    ),
    "metrics_fn": (("outputs", "targets"), "metrics_fn(outputs, targets) -> dict of name -> scalar"),
    "split_points": ((), "split_points() -> list of module names"),
    "init_weights": (("module", "name"), "init_weights(module, name)"),
    "lr_lambda": (("step",), "lr_lambda(step) -> factor"),
}
"""Each interface function, the arguments ravq passes it and its documented form (docs/tasks.md)."""

START_AT = 2
"""A ``train_batches`` with ``start`` is asked for its batch at this position and compared with the same
position reached from the start."""


def check_signatures(task: Any, report: Report) -> None:
    """Each function the task offers takes the arguments ravq passes it."""
    for name, (args, form) in SIGNATURES.items():
        fn = getattr(task, name, None)
        if fn is None:
            continue
        if not callable(fn):
            report.add(
                "error", "interface", f"{name} is a {type(fn).__name__}, not a function", f"define {form}"
            )
            continue
        if name == "make_optimizer" and _accepts(fn, (), {"named_params": []}):
            continue
        if not _accepts(fn, tuple(range(len(args))), {}):
            report.add(
                "error",
                "interface",
                f"{name}{_signature(fn)} cannot be called as {name}({', '.join(args)})",
                f"define {form}",
            )


def _accepts(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: it will tell at the call
        return True
    return True


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def takes_start(fn: Callable[..., Any]) -> bool:
    """Whether ``train_batches`` takes the data position ``start`` (issue #41), beside the four arguments."""
    try:
        return "start" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def as_inputs(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def first_batch(batches: Any, where: str, report: Report) -> tuple[tuple[Any, ...], Any] | None:
    """The first (inputs, targets) of an iterable of batches, or None after naming what is wrong (``batches``
    None: the call that should have returned them raised, already named)."""
    if batches is None:
        return None
    form = "(inputs, targets): inputs a tensor or tuple of tensors, targets what loss_fn takes"
    try:
        item = next(iter(batches))
    except StopIteration:
        report.add("error", "interface", f"{where} yields nothing", f"yield {form}, forever or for the run")
        return None
    except Exception as err:  # noqa: BLE001 - user code: any failure is the user's to fix
        report.add("error", "interface", f"{where} raised {type(err).__name__}: {err}", "fix the data code")
        return None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        report.add(
            "error",
            "interface",
            f"{where} yields a {type(item).__name__}"
            + (f" of {len(item)}" if isinstance(item, (tuple, list)) else ""),
            f"yield {form}",
        )
        return None
    inputs, targets = as_inputs(item[0]), item[1]
    if not all(isinstance(x, torch.Tensor) for x in inputs):
        report.add(
            "error",
            "interface",
            f"{where}'s inputs are {[_describe(x) for x in inputs]}, not tensors",
            "yield inputs as a tensor or a tuple of tensors (stages send tensors only)",
        )
        return None
    return inputs, targets


Batch = tuple[tuple[Any, ...], Any]


def check_batches(
    task: Any, micro_batch: int, seed: int, report: Report
) -> tuple[tuple[Any, ...], Batch, Batch | None] | None:
    """``example_inputs``, the first training and held-out batches, checked against each other: the example
    inputs as the tracer takes them, the first training batch and the first held-out one (None without
    ``eval_batches``); None when one of them is unusable."""
    try:
        example = as_inputs(task.example_inputs(micro_batch))
    except Exception as err:  # noqa: BLE001 - user code
        report.add(
            "error",
            "interface",
            f"example_inputs({micro_batch}) raised {type(err).__name__}: {err}",
            "return one micro-batch's model inputs (zeros of the right shape and dtype will do)",
        )
        return None
    if not all(isinstance(x, torch.Tensor) for x in example):
        report.add(
            "error",
            "interface",
            f"example_inputs({micro_batch}) returns {[_describe(x) for x in example]}",
            "return a tensor or a tuple of tensors, the model's positional inputs",
        )
        return None
    train = first_batch(_train_batches(task, micro_batch, seed, report), "train_batches", report)
    if train is not None:
        _same_as_example(train[0], example, "train_batches", micro_batch, report)
    held_out = None
    if callable(getattr(task, "eval_batches", None)):
        held_out = first_batch(
            _call(task.eval_batches, "eval_batches", report, micro_batch, seed), "eval_batches", report
        )
        if held_out is not None:
            _same_as_example(held_out[0], example, "eval_batches", micro_batch, report)
            if train is not None:
                _same_targets(train[1], held_out[1], report)
    return None if train is None else (example, train, held_out)


def _call(fn: Callable[..., Any], name: str, report: Report, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - user code
        report.add(
            "error", "interface", f"{name}{args} raised {type(err).__name__}: {err}", "fix the data code"
        )
        return None


def _train_batches(task: Any, micro_batch: int, seed: int, report: Report) -> Any:
    """The first shard's batches; with ``start``, checks that a restart at a position reads what training
    from the start reads there."""
    batches = _call(task.train_batches, "train_batches", report, micro_batch, 0, 1, seed)
    if batches is None or not takes_start(task.train_batches):
        return batches  # a call that raises is named once, not again for each call of the start= check
    ahead = _call(task.train_batches, "train_batches", report, micro_batch, 0, 1, seed, start=START_AT)
    want = list(
        itertools.islice(
            _call(task.train_batches, "train_batches", report, micro_batch, 0, 1, seed) or (), START_AT + 1
        )
    )
    got = None if ahead is None else next(iter(ahead), None)
    if len(want) > START_AT and got is not None and not _equal(got, want[START_AT]):
        report.add(
            "error",
            "interface",
            f"train_batches(..., start={START_AT})'s first batch is not the batch at "
            f"position {START_AT} of train_batches(...) from the start: a resumed node would train on other "
            "data",
            "make start=k yield what the k-th batch (counting from 0) would be",
        )
    return batches


def _equal(a: Any, b: Any) -> bool:
    import torch.utils._pytree as pytree

    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(la, lb)
    )


def _same_as_example(
    inputs: tuple[Any, ...], example: tuple[Any, ...], where: str, micro_batch: int, report: Report
) -> None:
    if len(inputs) != len(example):
        report.add(
            "error",
            "interface",
            f"{where} yields {len(inputs)} input(s), example_inputs({micro_batch}) {len(example)}",
            "make example_inputs return the model inputs a batch holds, in order",
        )
        return
    for i, (x, e) in enumerate(zip(inputs, example)):
        if x.shape != e.shape or x.dtype != e.dtype:
            report.add(
                "error",
                "interface",
                f"{where}'s input {i} is {_describe(x)}, example_inputs"
                f"({micro_batch})'s {_describe(e)}: the stages are traced at the example's shapes and "
                "refuse other ones",
                f"make example_inputs(micro_batch) return what {where} yields "
                "(same shape and dtype), or make the data fit it",
            )


def _same_targets(train: Any, held_out: Any, report: Report) -> None:
    kinds = (_describe(train), _describe(held_out))
    if (
        isinstance(train, torch.Tensor)
        and isinstance(held_out, torch.Tensor)
        and (train.shape[1:] != held_out.shape[1:] or train.dtype != held_out.dtype)
    ):
        report.add(
            "error",
            "interface",
            f"eval_batches' targets are {kinds[1]}, train_batches' {kinds[0]}",
            "yield held-out targets as training's (loss_fn scores both)",
        )
