"""Tied and unused weights across stages: who holds which name after a split.

A tied weight is one tensor under several names of the unsplit model (GPT-2's ``transformer.wte.weight``
= ``lm_head.weight``; T5's ``shared``, ``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``lm_head``)
or one name read by several stages.  torch's tracer gives each stage that reads it a copy under the name
its graph reads, and leaves stray copies behind in stages that never read them.  ``settle_ties`` removes
the strays, makes the names one stage reads one tensor again, and records on every holder a ``TiedGroup``:
the group's key (its first name, the one ``named_parameters()`` and averaging use), the names this stage
holds and every stage holding a copy.  Names of a group no stage reads (T5's ``shared.weight``) are held by
the lowest holder, so the stages' state_dicts together name everything the model's state_dict does; the
holders keep their copies equal at run time (``ravq.stage.tied_step``).

Weights and persistent buffers that no stage reads at all (a BERT/RoBERTa MLM head's ``bias`` once untied
from its decoder) are kept by stage 0 (``give_unused_to_first``), unchanged: no gradient ever reaches them,
and checkpoints and export carry them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ravq.cut.modules import child, delete_parameter, set_parameter


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """One tied weight as one stage holds it."""

    key: str
    """The group's first name in the unsplit model (what ``named_parameters()`` reports; averaged under
    it)."""
    names: tuple[str, ...]
    """The names this stage holds it under (one tensor), the one it trains first."""
    holders: tuple[int, ...]
    """Every stage holding a copy, ascending; the lowest is the group's primary (it averages the copy)."""

    @property
    def primary(self) -> int:
        return self.holders[0]


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The unsplit model's tied parameters: the names of each tensor known under several, in model order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def read_names(module: nn.Module) -> set[str]:
    """Parameter and buffer names ``module``'s traced graphs read.  A submodule without a graph reads all its
    own if a graph calls it (or it sits in one so called); one nothing calls is a stray of the tracer."""
    read: set[str] = set()
    called: set[str] = set()
    plain: set[str] = set()  # graph-less modules that run (called, or inside one that is)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        graph = getattr(sub, "graph", None)
        if graph is not None:
            for node in graph.nodes:
                if node.op == "get_attr":
                    read.add(f"{dot}{node.target}")
                elif node.op == "call_module":
                    called.add(f"{dot}{node.target}")
        elif prefix in called or prefix.rpartition(".")[0] in plain:
            plain.add(prefix)
            read.update(f"{dot}{n}" for n, _ in sub.named_parameters(recurse=False, remove_duplicate=False))
            read.update(f"{dot}{n}" for n, _ in sub.named_buffers(recurse=False, remove_duplicate=False))
    return read


def settle_ties(
    model: nn.Module, modules: list[nn.Module], groups: list[list[str]]
) -> dict[int, list[TiedGroup]]:
    """Make each stage hold the tied weights its graph reads, one tensor per group, and nothing else of them;
    returns stage index -> the groups it shares with other stages.  ``groups``: ``tie_groups(model)`` taken
    before the split.  Weights no stage reads are left to ``give_unused_to_first``."""
    params = [dict(m.named_parameters(remove_duplicate=False)) for m in modules]
    reads = [read_names(m) for m in modules]
    shared = _names_in_several(params, reads)
    all_groups = groups + [[n] for n in shared if not any(n in g for g in groups)]
    out: dict[int, list[TiedGroup]] = {}
    for group in all_groups:
        held = {s: [n for n in group if n in params[s] and n in reads[s]] for s in range(len(modules))}
        for s, module in enumerate(modules):
            for name in group:
                if name in params[s] and name not in held[s]:
                    _delete(module, name)  # a stray copy the tracer left where nothing reads it
        holders = tuple(s for s in range(len(modules)) if held[s])
        if not holders:
            continue  # nothing reads it: stage 0 takes it (give_unused_to_first), as any unused weight
        unread = [n for n in group if not any(n in held[s] for s in holders)]
        held[holders[0]] += unread
        for s in holders:
            first = params[s][held[s][0]]
            for name in held[s][1:]:
                _put(modules[s], name, first)
            if len(holders) > 1:
                out.setdefault(s, []).append(TiedGroup(key=group[0], names=tuple(held[s]), holders=holders))
    return out


def _names_in_several(params: list[dict[str, nn.Parameter]], reads: list[set[str]]) -> list[str]:
    """Names that more than one stage's graph reads (a module called from two stages)."""
    count: dict[str, int] = {}
    for own, read in zip(params, reads):
        for name in own:
            if name in read:
                count[name] = count.get(name, 0) + 1
    return [n for n, c in count.items() if c > 1]


def give_unused_to_first(model: nn.Module, modules: list[nn.Module]) -> None:
    """Stage 0 holds every weight and persistent buffer of the model that no stage holds (never read)."""
    held = {k for m in modules for k in m.state_dict(keep_vars=True)}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, value in model.state_dict(keep_vars=True).items():
        if name in held:
            continue
        if name in params:
            _put(modules[0], name, params[name])
        elif name in buffers:
            owner, _, leaf = name.rpartition(".")
            _owner(modules[0], owner).register_buffer(leaf, value.detach().clone())


def _owner(module: nn.Module, path: str) -> nn.Module:
    """The submodule at ``path``, made (empty) where the stage has none."""
    for part in path.split(".") if path else []:
        sub = child(module, part)
        if sub is None:
            sub = nn.Module()
            module.add_module(part, sub)
        module = sub
    return module


def _put(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    set_parameter(_owner(module, owner), leaf, param)


def _delete(module: nn.Module, name: str) -> None:
    delete_parameter(module, name)

