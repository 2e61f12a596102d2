"""The stage's tied weights as the node's end, the averager and a checkpoint see them: closing the exchange,
a round's deltas handed to every holder in step order (``ravq.stage.tied_step``), and what a checkpoint
records."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ravq.stage.tied_stage import TiedStep
from ravq.stage.tied_step import SEP, TiedExchange


class TiedHolder(Protocol):
    """What the node's end and the averager hand the functions below: a stage (``StageWorker``)."""

    @property
    def tied(self) -> TiedExchange | None: ...

    @property
    def tied_step(self) -> TiedStep | None: ...

    @property
    def params(self) -> dict[str, nn.Parameter]: ...

    @property
    def module(self) -> nn.Module: ...


def close_tied(worker: TiedHolder) -> None:
    """``TiedStep.close`` of the worker's tied weights (a node's end)."""
    assert worker.tied_step is not None
    worker.tied_step.close()


# ----------------------------------------------------------------- averaging (``ravq.average.averager``)
def held_params(worker: TiedHolder) -> dict[str, nn.Parameter]:
    """The stage's parameters under every name it holds them by (a tied weight's key among them)."""
    if getattr(worker, "tied", None) is None:  # (tests average fake stages without a module)
        return dict(worker.params)
    return dict(worker.module.named_parameters(remove_duplicate=False))


def tied_sinks(worker: TiedHolder, named: Mapping[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``named`` with a zero tensor in place of each tied weight (and its optimizer state), and those
    zeros: an averaging round's delta lands there, and ``hand_over`` gives it to every holder in step
    order."""
    tied: TiedExchange | None = getattr(worker, "tied", None)  # (tests average fake stages without one)
    if tied is None:
        return dict(named), {}
    keys = {g.key for g in tied.groups}
    sinks = {n: torch.zeros_like(t) for n, t in named.items() if n.split(SEP)[0] in keys}
    return {**named, **sinks}, sinks


def hand_over(worker: TiedHolder, sinks: Mapping[str, torch.Tensor]) -> None:
    """Compute thread: ``TiedStep.hand_over`` of the worker's tied weights."""
    if any(bool(d.any()) for d in sinks.values()):
        assert worker.tied_step is not None
        worker.tied_step.hand_over(sinks)


def tied_meta(tied: TiedExchange | None) -> list[dict[str, Any]]:
    """What a stage checkpoint records of its tied copies: each group's names and the tied steps applied
    (``ravq.persist.export`` writes the copy furthest along under every name)."""
    if tied is None:
        return []
    return [{"key": g.key, "names": list(g.names), "holders": list(g.holders), "applied": tied.applied[g.key]}
            for g in tied.groups]
