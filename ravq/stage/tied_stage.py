"""The stage's side of its tied weights (``ravq.stage.tied_step``): ``TiedStep`` sends what the stage's
``TiedExchange`` makes through the stage's outbox, applies the tied steps whose parts are in, and, where the
stage counts a tied weight in the global norm (clipping, fp16), waits for the other holders' parts of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ravq.stage.state import Outbox
from ravq.stage.tied_step import FIN, Factor, TiedExchange


class TiedStep:
    """The stage's side of its tied weights: sends what its ``TiedExchange`` makes (TIED messages, through
    the stage's outbox) and applies the tied steps whose parts are in (compute thread, unless it says
    otherwise)."""

    def __init__(self, exchange: TiedExchange, *, optimizer: torch.optim.Optimizer,
                 params: dict[str, nn.Parameter], outbox: Outbox,
                 submit: Callable[[Callable[[], None]], None],
                 before_change: Callable[[], None], changed: Callable[[], None],
                 waited: Callable[[str, float], None], should_abort: Callable[[], bool],
                 clock: Callable[[], float], factor: Factor | None = None, norms: bool = False,
                 interrupted: Callable[[], bool] | None = None) -> None:
        self.exchange, self._optimizer, self._params, self._outbox = exchange, optimizer, params, outbox
        self._submit, self._before_change, self._changed = submit, before_change, changed
        self._waited, self._should_abort, self._clock = waited, should_abort, clock
        self._factor, self._norms = factor, norms
        """How the stage applied each step (each tied step waits for it); whether global norms are exchanged
        (clipping, fp16: the tied weights this stage counts go into its squared norm)."""
        self._interrupted = interrupted or should_abort
        """A pause or the end: the contributions waited for may never come."""

    def deliver(self, micro_batch: tuple[int, int], source: int, tensors: Mapping[str, Any]) -> str | None:
        """A TIED message arrived (event loop): None if taken (its steps apply in the compute thread),
        else why not."""
        reason = self.exchange.check(source, tensors)
        if reason is None:
            self.exchange.receive(source, micro_batch[1], tensors)
            self._submit(self.apply)
        return reason

    def send(self, dest: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        self._outbox.send("tied", dest, step, dict(tensors))

    def restart(self) -> None:
        """Training starts (again): the key holder's copies to the other holders
        (``TiedExchange.restart``)."""
        self.exchange.restart(self._optimizer, self.send)

    def contribute(self, name: int | None = None) -> float:
        """This step's gradients of the tied copies to the other holders (``TiedExchange.contribute``); the
        step named by micro-batch ``name`` (None: a last partial step).  Exchanging global norms, returns the
        squared norm of the summed gradients this stage counts (waiting for the other holders' parts, which
        are in flight), else 0."""
        tied = self.exchange
        step = tied.contribute(self.send, name)
        if not self._norms or name is None or not tied.counted:
            return 0.0
        t0 = None
        while not tied.counted_in(step) and not self._interrupted():  # interrupted: the step is dropped
            t0 = self._clock() if t0 is None else t0
            tied.wait(0.05)
        if t0 is not None:
            self._waited("tied", self._clock() - t0)
        return tied.counted_norm(step)

    def apply(self, wait: Callable[[], bool] = lambda: False) -> None:
        """Apply the tied steps whose parts are in; while ``wait()``, wait for more (counted as the "tied"
        wait)."""
        while True:
            self._apply_ready()
            if not wait():
                # What arrived while the pass above ran (a last delta, then ``fin``) made ``wait()`` false
                # without being applied: one more pass takes it, or ``close`` would end one copy short.
                self._apply_ready()
                return
            if self._should_abort():
                return
            t0 = self._clock()
            self.exchange.wait(0.5)
            self._waited("tied", self._clock() - t0)

    def _apply_ready(self) -> None:
        if self.exchange.apply_ready(self._optimizer, self._params, self._before_change, self._factor):
            self._changed()  # forwards from now on run at the new copy

    def close(self) -> None:
        """After training and the last averaging round (a node's end): tell the other holders this stage
        sends nothing more, and apply what they send until each of them said so; the copies are then
        bit-identical, the averaging deltas of the last rounds included."""
        tied = self.exchange
        for dest in tied.others:
            self.send(dest, tied.contributed, {FIN: torch.zeros(1)})
        self.apply(wait=lambda: not (tied.settled() and set(tied.others) <= tied.closed))

    def hand_over(self, sinks: Mapping[str, torch.Tensor]) -> None:
        """The averaging deltas that landed in ``tied_sinks``'s zeros, added by every holder after the tied
        step this stage contributed last (here at once, if it applied that step)."""
        moved = {n: d for n, d in sinks.items() if bool(d.any())}
        if moved:
            self.exchange.defer_delta(moved, self.send)
            self.apply()
