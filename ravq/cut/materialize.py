"""Real weights for one stage of a meta model, the same whatever the cut and in every cluster.

The rule (``docs/tasks.md``, "Initial weights"): a fresh meta model of the task is built; only the
tensors the stage holds (and their tied aliases) get memory; then every module that owns one of them,
and each of its ancestors, is initialised children first, each with the global RNG seeded from the run
seed and the module's qualified name:

1. transformers models: the nearest ``PreTrainedModel``'s ``_init_weights(module)`` (what its own
   ``post_init`` does, rotary frequencies included); other modules: their ``reset_parameters()``.  A module
   a user changed after building the model (a head's bias set to None, ``shared`` replaced), on which
   ``_init_weights`` fails, falls back to its own ``reset_parameters()`` if any, else to the built
   model's values (below), with one warning naming it;
2. then the task's ``init_weights(module, name)``, if it has one, to initialise as it likes.

A checkpoint the task names (``pretrained``: a transformers directory, a ``.safetensors`` file or a
directory of them, sharded or not) then overwrites the tensors it holds, each read alone with
safetensors' ``safe_open``.  Buffers start from the constructor's values (``ravq.cut.meta``).  A
parameter that nothing initialises (a bare ``nn.Parameter`` in a module without ``reset_parameters``)
takes the constructor's value, which costs one build of the whole model: a warning names it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravq.cut.meta import Blueprint, SkipMetaInPlace, build_meta_model
from ravq.cut.modules import hf_init_weights, is_parameter, replace_tensor

log = logging.getLogger(__name__)


class MaterializeError(ValueError):
    """The stage cannot be given real weights: a checkpoint does not fit the model, or tensors stayed meta."""


@dataclass(kw_only=True, slots=True)
class Materialized:
    names: int
    """How many tensors (parameters and buffers, aliases counted once) were given memory."""
    loaded: list[str] = field(default_factory=list)
    """Names read from the checkpoint."""
    missing: list[str] = field(default_factory=list)
    """Names the checkpoint lacks (they keep the initialised values)."""
    from_constructor: list[str] = field(default_factory=list)
    """Parameters no initialiser touched, given the constructor's values."""


def derived_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def task_checkpoint(task: Any) -> str | None:
    """The pretrained checkpoint a task names (``pretrained``: a path, or a function returning one)."""
    named = getattr(task, "pretrained", None)
    named = named() if callable(named) else named
    return str(named) if named else None


def materialize(target: nn.Module, task: Any, seed: int, *, pretrained: str | None = None) -> Materialized:
    """Give every meta parameter and buffer of ``target`` (the whole model, or a traced stage of it, whose
    tensors carry the unsplit model's qualified names) its real starting value, on the CPU.  Tensors that
    already have memory (e.g. an eval graph's, pointed at the training stage's) are left as they are."""
    on_meta = {n for n, t in _named_tensors(target) if t.is_meta}
    if not on_meta and not _meta_constants(target):
        return Materialized(names=0)
    wanted = [n for n, _ in _named_tensors(target)]  # all of them: a module's init draws for all its tensors
    source = build_meta_model(task, seed)
    pretrained = pretrained or task_checkpoint(task) or source.pretrained
    real, report = _real_tensors(source, set(wanted), task, seed, pretrained)
    for name in wanted:
        if name in on_meta:
            _install(target, name, real[name])
    left = [n for n, t in _named_tensors(target) if t.is_meta] + _meta_constants(target)
    if left:
        raise MaterializeError(f"tensors still without memory after materializing: {', '.join(left[:5])}")
    return report


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _meta_constants(module: nn.Module) -> list[str]:
    """Plain tensor attributes (a traced graph's lifted constants) still on meta."""
    return [f"{prefix}.{k}" if prefix else k for prefix, mod in module.named_modules()
            for k, v in vars(mod).items() if isinstance(v, torch.Tensor) and v.is_meta]


def _install(module: nn.Module, name: str, value: torch.Tensor) -> None:
    assert not is_parameter(module, name) or isinstance(value, nn.Parameter), name
    replace_tensor(module, name, value)


def _real_tensors(source: Blueprint, wanted: set[str], task: Any, seed: int,
                  pretrained: str | None) -> tuple[dict[str, torch.Tensor], Materialized]:
    model = source.model
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in _named_tensors(model):
        groups.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    unknown = wanted - {n for names in groups.values() for n in names}
    if unknown:
        raise MaterializeError(f"the model has no tensors named {', '.join(sorted(unknown)[:5])}")
    needed = [key for key, names in groups.items() if wanted & set(names)]
    real: dict[str, torch.Tensor] = {}
    for key in needed:
        value = _blank(tensors[key], groups[key], source.buffers)
        for name in groups[key]:
            _install(model, name, value)
            real[name] = value
    owners = {n.rpartition(".")[0] for key in needed for n in groups[key]}
    _initialise(model, owners, task, seed)
    report = Materialized(names=len(needed))
    if pretrained:
        _load_checkpoint(pretrained, model, {key: groups[key] for key in needed}, real, report)
    loaded = set(report.loaded)
    untouched = [
        groups[key][0]
        for key in needed
        if not loaded & set(groups[key])
        and real[groups[key][0]].is_floating_point()
        and bool(torch.isnan(real[groups[key][0]]).any())
    ]
    if untouched:
        _from_constructor(task, seed, untouched, real)
        report.from_constructor = untouched
    return real, report


def _blank(meta: torch.Tensor, names: list[str], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """CPU memory for one tensor: a buffer's constructor value, else NaN (so "never initialised" shows)."""
    kept = next((buffers[n] for n in names if n in buffers), None)
    if kept is not None:
        value = kept.clone()
    elif meta.is_floating_point() or meta.is_complex():
        value = torch.full(meta.shape, float("nan"), dtype=meta.dtype)
    else:
        value = torch.zeros(meta.shape, dtype=meta.dtype)
    if isinstance(meta, nn.Parameter):
        return nn.Parameter(value, requires_grad=meta.requires_grad)
    return value


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and any(
        c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _initialise(model: nn.Module, owners: set[str], task: Any, seed: int) -> None:
    """Initialise, children first, every module in ``owners`` and each ancestor of one."""
    relevant = {""}
    for owner in owners:
        parts = owner.split(".") if owner else []
        relevant.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    custom: Callable[[nn.Module, str], Any] | None = getattr(task, "init_weights", None)
    edited: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module, hf: nn.Module | None) -> None:
        hf = module if _is_hf_model(module) else hf
        for child_name, child in module.named_children():
            qualified = f"{prefix}.{child_name}" if prefix else child_name
            if qualified in relevant:
                visit(qualified, child, hf)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derived_seed(seed, prefix))
            _init_module(hf, module, prefix, seed, edited)
            if custom is not None:
                custom(module, prefix)

    with torch.no_grad(), SkipMetaInPlace():  # an initialiser's draws for tensors this stage does not hold
        visit("", model, None)
    if edited:
        log.warning(
            "transformers' _init_weights cannot initialise %s, changed after the model was built (%s); it "
            "starts from its own reset_parameters(), else from the values the built model had",
            ", ".join(edited), "; ".join(f"{name}: {why}" for name, why in edited.items()),
        )


def _init_module(hf: nn.Module | None, module: nn.Module, prefix: str, seed: int,
                 edited: dict[str, str]) -> None:
    """``module``'s initialiser: its transformers model's ``_init_weights``, else its own
    ``reset_parameters``.  ``_init_weights`` expects each module as the model's class built it: one a user
    changed after ``__init__`` (a bias set to None, an embedding replaced) fails there and falls back
    (recorded in ``edited``)."""
    if hf is not None:
        try:
            hf_init_weights(hf, module)
            return
        except (AttributeError, TypeError) as err:  # the attribute it reads is gone, or is another thing
            edited[prefix or type(module).__name__] = f"{type(err).__name__}: {str(err)[:120]}"
            torch.manual_seed(derived_seed(seed, prefix))  # as if the failed initialiser had drawn nothing
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def _from_constructor(task: Any, seed: int, names: list[str], real: dict[str, torch.Tensor]) -> None:
    log.warning(
        "no initialiser sets %s (no reset_parameters(), no task init_weights()): building the whole model "
        "once to take the constructor's values; give the module a reset_parameters() or the task an "
        "init_weights(module, name) so that no PC needs the whole model",
        ", ".join(names[:5]),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        whole = task.build_model()
    state = dict(_named_tensors(whole))
    with torch.no_grad():
        for name in names:
            real[name].copy_(state[name])


def checkpoint_files(path: str) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a transformers directory (sharded or not), a directory of
    ``.safetensors`` files or one file."""
    root = Path(path)
    if root.is_file():
        files = [root]
    elif (root / "model.safetensors.index.json").is_file():
        index = json.loads((root / "model.safetensors.index.json").read_text())
        return {name: root / file for name, file in index["weight_map"].items()}
    elif root.is_dir():
        files = sorted(root.glob("*.safetensors"))
    else:
        raise MaterializeError(f"pretrained: {path} does not exist")
    if not files:
        raise MaterializeError(
            f"pretrained: no .safetensors file in {path} (ravq reads safetensors only, never "
            "pickle: save with save_pretrained(..., safe_serialization=True))"
        )
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def _load_checkpoint(path: str, model: nn.Module, groups: dict[int, list[str]], real: dict[str, torch.Tensor],
                     report: Materialized) -> None:
    """Overwrite each needed tensor the checkpoint holds (under any alias, with or without the model's
    transformers base-model prefix), reading one tensor at a time."""
    from safetensors import safe_open

    where = checkpoint_files(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    todo: dict[Path, list[tuple[str, str]]] = {}
    for names in groups.values():
        key = next((k for n in names for k in _spellings(n, prefix) if k in where), None)
        if key is None:
            report.missing.append(names[0])
        else:
            todo.setdefault(where[key], []).append((names[0], key))
    with torch.no_grad():
        for file, pairs in todo.items():
            with safe_open(str(file), framework="pt") as f:
                for name, key in pairs:
                    stored = f.get_slice(key)
                    if list(stored.get_shape()) != list(real[name].shape):
                        raise MaterializeError(
                            f"pretrained: {key} in {file} has shape {stored.get_shape()}, the "
                            f"model's {name} {list(real[name].shape)}"
                        )
                    real[name].copy_(f.get_tensor(key))
                    report.loaded.append(name)
    if report.missing:
        log.warning("pretrained: %s lacks %d of this stage's tensors (%s); they keep their initial values",
                    path, len(report.missing), ", ".join(report.missing[:5]))


def _spellings(name: str, prefix: str) -> list[str]:
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name.removeprefix(prefix + ".")]
    return [name, f"{prefix}.{name}"]
