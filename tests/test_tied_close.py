"""A stage's end with a tied weight (``TiedStep.close``), without sockets: what the other holder sent before its
``fin`` is applied even when it arrives while the last pass runs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ravq.cut.tied import TiedGroup
from ravq.stage.tied_stage import TiedStep
from ravq.stage.tied_step import DELTA, FIN, GRAD, SET, TiedExchange


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, int, dict[str, torch.Tensor]]] = []

    def send(self, kind: str, dest: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        self.sent.append((kind, dest, step, tensors))


class _LateExchange(TiedExchange):
    """The primary's last averaging delta and its ``fin`` arrive just after a pass found nothing new: between
    ``apply_ready`` and the check that ends ``close`` (the event loop receives while the compute thread
    applies)."""

    def __init__(self, *args: Any, delta: torch.Tensor) -> None:
        super().__init__(*args)
        self.late: dict[str, torch.Tensor] | None = {f"{DELTA}w": delta}

    def settled(self) -> bool:
        if self.late is not None:
            self.receive(0, self.contributed, self.late)
            self.receive(0, self.contributed, {FIN: torch.zeros(1)})
            self.late = None
        return super().settled()


def test_a_delta_arriving_with_fin_during_the_last_pass_is_applied_before_close_returns() -> None:
    torch.manual_seed(0)
    copy = nn.Parameter(torch.randn(3))
    params = {"head": copy}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    delta = torch.full((3,), 0.25)
    tied = _LateExchange(1, [TiedGroup(key="w", names=("head",), holders=(0, 1))], params, 1, delta=delta)
    step = TiedStep(tied, optimizer=optimizer, params=params, outbox=_Outbox(),  # type: ignore[arg-type]
                    submit=lambda fn: None, before_change=lambda: None, changed=lambda: None,
                    waited=lambda kind, s: None, should_abort=lambda: False, clock=lambda: 0.0)
    tied.receive(0, 0, {f"{SET}w": copy.detach().clone()})    # the key holder's copy at the start
    copy.grad = torch.ones(3)
    step.contribute()                                          # this stage's step 1 ...
    tied.receive(0, 1, {f"{GRAD}w": torch.ones(3)})            # ... and the primary's
    before = copy.detach().clone()
    step.close()
    assert tied.applied["w"] == 1 and tied.closed == {0}
    # tied step 1 (the two gradients summed, SGD lr 0.1), then the primary's delta after it
    assert torch.allclose(copy.detach(), before - 0.1 * 2 * torch.ones(3) + delta)


def test_two_deltas_after_the_same_step_are_both_added_in_the_order_sent() -> None:
    """The primary's last rounds end while it makes no step (drained at its end): each delta follows the same
    step.  A holder still short of that step keeps both and adds each on its own, in order (it kept only the
    last, and its copy ended one delta short of the primary's)."""
    torch.manual_seed(0)
    copy = nn.Parameter(torch.randn(3))
    params = {"head": copy}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    tied = TiedExchange(1, [TiedGroup(key="w", names=("head",), holders=(0, 1))], params, 1)
    step = TiedStep(tied, optimizer=optimizer, params=params, outbox=_Outbox(),  # type: ignore[arg-type]
                    submit=lambda fn: None, before_change=lambda: None, changed=lambda: None,
                    waited=lambda kind, s: None, should_abort=lambda: False, clock=lambda: 0.0)
    tied.receive(0, 0, {f"{SET}w": copy.detach().clone()})
    first, second = torch.full((3,), 0.25), torch.full((3,), 1e-8)
    tied.receive(0, 1, {f"{GRAD}w": torch.ones(3)})            # the primary's step 1, then its two deltas
    tied.receive(0, 1, {f"{DELTA}w": first})
    tied.receive(0, 1, {f"{DELTA}w": second})
    tied.receive(0, 1, {FIN: torch.zeros(1)})
    expected = copy.detach().clone() - 0.1 * 2 * torch.ones(3)
    expected.add_(first).add_(second)                          # one after the other, as the primary added them
    copy.grad = torch.ones(3)
    step.contribute()                                          # this stage's step 1 comes last
    step.close()
    assert tied.applied["w"] == 1
    assert torch.equal(copy.detach(), expected)
