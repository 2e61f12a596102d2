"""Keeping the copies of a tied weight equal while an asynchronous pipeline trains (DeepSpeed's tied layers).

Every stage holding a copy of a tied weight (``ravq.cut.tied.TiedGroup``) takes the copy's gradient out of
its own optimizer step: at its j-th step it sends that gradient, its *contribution* j, to the other holders
(a TIED message; the last stage sends it before its input-gradients, so an upstream holder has it before it
can finish the same micro-batch).  Tied step j runs on every holder once all contributions j are in: the same
sum, added in holder order, through the same optimizer state; so the copies go through the same updates, in
the same order, at different wall times, and are bit-identical whenever every holder has applied the same
steps (at the end of training they all have).  Nothing waits for a whole pipeline: a forward waits only
until its copy is at most ``max_inflight - 1`` tied steps behind the stage's own version, which the
contributions already sent guarantee (with ``max_inflight: 1`` each forward sees every update before it, as
one process does).

Averaging: only the holder of the group's key (its first name; the lowest holder, in every model tried)
averages the weight across clusters.  The round's delta does not land on its copy directly: it is sent to
the other holders with the step it follows (that holder's contributions so far: no holder can have applied
the next one), and every holder, itself included, adds it right after that tied step, before the next.

One start: when training starts, and when the cluster resumes after a pause (whose reset drops the steps in
flight and the count), the key holder sends its copy and optimizer state (SET); the other holders take it
before any forward or tied step, so copies loaded from different checkpoints or clusters agree again.  At a
node's end each holder sends ``fin`` after its last averaging round and waits for the others', so the last
rounds' deltas reach every copy.  A forward's weights are stashed as before; a tied step only drops the
cached snapshot, so the next forward copies the new weights.

Clipping and fp16 (``ravq.stage.clip``): the global norm counts each tied weight once, by its summed
gradient, as one process's ``clip_grad_norm_`` does.  The lowest holder of a group adds the squared norm of
the sum of contribution j to its own when it finishes its step j (the other holders sent theirs before the
backwards that reach it, so it waits only for messages in flight).  Tied step j waits until the stage
applied its own step j (which waited for the step's global norm): scaled by the same clipping factor,
skipped like it on an overflow, and, with or without clipping, at its learning rates (an LR schedule's
rate of step j, on every holder, however late it comes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ravq.cut.tied import TiedGroup
from ravq.stage.clip import Applied, squared_norm

GRAD, DELTA, SET, FIN = "g:", "d:", "s:", "fin"
"""Tensor names in a TIED message: prefixes of a contribution's gradient, of an averaging delta (by
averaged name: the group's key, or ``key::state`` for its optimizer state) and of the key holder's copy and
optimizer state after a disruption (``restart``); ``fin``: the sender is done (``close_tied``)."""
SEP = "::"

Send = Callable[[int, int, dict[str, torch.Tensor]], None]
"""send(dest stage, step, tensors)."""
Factor = Callable[[int], Applied | None]
"""The step named by a micro-batch index -> how the stage applied it (clipping factor, finite, learning
rates), or None until it has (``Recipe.step_applied``)."""
UNSCALED = Applied()


class TiedExchange:
    """One stage's side of its tied weights: contributions made and received, tied steps applied.

    ``receive`` runs on the event loop; everything else in the compute thread."""

    def __init__(self, stage: int, groups: list[TiedGroup], params: Mapping[str, nn.Parameter],
                 max_inflight: int) -> None:
        self.stage, self.groups = stage, groups
        self.param = {g.key: params[g.names[0]] for g in groups}
        self.lag = max(0, max_inflight - 1)
        self.contributed = 0
        """Contributions this stage made (its optimizer steps)."""
        self.applied = {g.key: 0 for g in groups}
        """Tied steps applied, per group."""
        self.cond = threading.Condition()
        self._grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        """(holder stage, step) -> its contribution's gradients, by group key."""
        self._deltas: dict[tuple[str, int], list[dict[str, torch.Tensor]]] = {}
        """(group key, step it follows) -> the averaging deltas, each by averaged name, in the order sent:
        rounds that end while the stage makes no step (its last rounds, drained at its end) follow the same
        step, and each is added on its own, as the key holder added it."""
        self.others = sorted({h for g in groups for h in g.holders} - {stage})
        """The other stages holding a copy of any of this stage's tied weights."""
        self.closed: set[int] = set()
        """Other holders that sent ``fin``: every delta they will ever send is in."""
        self.synced = {g.key: g.key in g.names for g in groups}
        """False until the key holder's copy arrived (``SET``): at the start (each stage may have loaded its
        own checkpoint) and after a disruption."""
        self.announced = False
        """Whether this stage sent its key copies (``restart``) since it started."""
        self._sets: dict[str, dict[str, torch.Tensor]] = {}
        self.counted = [g for g in groups if min(g.holders) == stage]
        """The groups whose summed gradient this stage counts in the global norm (their lowest holder)."""
        self._names: dict[int, int | None] = {}
        """This stage's step j -> the micro-batch index naming it (None: a last partial step, unclipped)."""
        self._factors: dict[int, Applied] = {}
        """Step j -> how the stage applied its own step j, once it has; until then no tied step j runs."""

    # ----------------------------------------------------------------- what arrives (event loop)
    def check(self, source: int, tensors: Mapping[str, Any]) -> str | None:
        """Why a TIED message from ``source`` is refused, or None."""
        for name, t in tensors.items():
            if name == FIN:
                if source not in self.others:
                    return "unexpected_tied"
                continue
            key, _, state = name[len(GRAD):].partition(SEP)
            group = next((g for g in self.groups if g.key == key), None)
            if group is None or source not in group.holders or source == self.stage or name[:2] not in (
                    GRAD, DELTA, SET):
                return "unexpected_tied"
            p = self.param[key]
            if not isinstance(t, torch.Tensor):
                return "tensor_mismatch"
            scalar = name.startswith(SET) and state and t.dim() == 0  # an optimizer's step count
            if (t.shape != p.shape or t.dtype != p.dtype) and not scalar:
                return "tensor_mismatch"
        return None

    def receive(self, source: int, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with self.cond:
            grads = {n.removeprefix(GRAD): t for n, t in tensors.items() if n.startswith(GRAD)}
            if grads:
                self._grads.setdefault((source, step), {}).update(grads)
            deltas: dict[str, dict[str, torch.Tensor]] = {}
            for name, t in tensors.items():
                if name.startswith(DELTA):
                    full = name.removeprefix(DELTA)
                    deltas.setdefault(full.split(SEP)[0], {})[full] = t
                elif name.startswith(SET):
                    full = name.removeprefix(SET)
                    self._sets.setdefault(full.split(SEP)[0], {})[full] = t
            for key, delta in deltas.items():
                self._deltas.setdefault((key, step), []).append(delta)
            if FIN in tensors:
                self.closed.add(source)
            self.cond.notify_all()

    # ----------------------------------------------------------------- after a disruption (compute thread)
    def reset(self) -> None:
        """The cluster paused and dropped its work in flight (and may load other weights): forget every
        step counted so far; until the key holder's copy arrives, apply and run nothing with it."""
        with self.cond:
            self._grads.clear()
            self._deltas.clear()
            self._sets.clear()
            self.contributed = 0
            self.applied = {g.key: 0 for g in self.groups}
            self.synced = {g.key: g.key in g.names for g in self.groups}
            self._names.clear()
            self._factors.clear()

    def restart(self, optimizer: torch.optim.Optimizer, send: Send) -> None:
        """Training starts or starts again: send the copies (and optimizer state) this stage holds the key of
        to the other holders, who take them before any tied step of the new count."""
        self.announced = True
        for g in self.groups:
            if g.key not in g.names:
                continue
            p = self.param[g.key]
            state = {k: v for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
            tensors = {f"{SET}{g.key}": p.detach(),
                       **{f"{SET}{g.key}{SEP}{k}": v.detach() for k, v in state.items()}}
            for dest in g.holders:
                if dest != self.stage:
                    send(dest, 0, tensors)

    # ----------------------------------------------------------------- compute thread
    def contribute(self, send: Send, name: int | None = None) -> int:
        """Take this step's gradients of the tied copies out of the stage's update and send them to the other
        holders; ``name``: the micro-batch index naming the step (None: not clipped).  Returns the step."""
        step = self.contributed + 1
        own: dict[str, torch.Tensor] = {}
        for g in self.groups:
            p = self.param[g.key]
            own[g.key] = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = None  # the stage's own optimizer step leaves the copy alone
        with self.cond:
            self._grads[(self.stage, step)] = own
            self.contributed = step
            self._names[step] = name
        for dest in self.others:
            send(dest, step, {f"{GRAD}{g.key}": own[g.key].detach()
                              for g in self.groups if dest in g.holders})
        return step

    def counted_in(self, step: int) -> bool:
        """Whether every holder's contribution ``step`` to the groups this stage counts is in."""
        with self.cond:
            return all(self._grads.get((h, step), {}).get(g.key) is not None
                       for g in self.counted for h in g.holders)

    def counted_norm(self, step: int) -> float:
        """The squared norm of the summed contributions ``step`` of the groups this stage counts (each summed
        in holder order, as the tied step sums them; a part not in counts as nothing)."""
        sums: dict[str, torch.Tensor | None] = {}
        with self.cond:
            for g in self.counted:
                parts = [t for h in g.holders if (t := self._grads.get((h, step), {}).get(g.key)) is not None]
                sums[g.key] = _summed(parts, self.param[g.key].device) if parts else None
        return squared_norm(sums)

    def defer_delta(self, deltas: Mapping[str, torch.Tensor], send: Send) -> None:
        """The primary's averaging deltas (by averaged name): every holder adds them after the tied step this
        stage contributed last."""
        after = self.contributed
        by_key: dict[str, dict[str, torch.Tensor]] = {}
        for name, d in deltas.items():
            by_key.setdefault(name.split(SEP)[0], {})[name] = d.detach().clone()
        with self.cond:
            for key, delta in by_key.items():
                self._deltas.setdefault((key, after), []).append(delta)
        for dest in self.others:
            send(dest, after, {f"{DELTA}{n}": d.detach() for n, d in deltas.items()
                               if dest in self._group(n.split(SEP)[0]).holders})

    def apply_ready(self, optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter],
                    before_change: Callable[[], None], factor: Factor | None = None) -> bool:
        """Apply every tied step and delta whose parts are all in (and, with ``factor``, whose step's global
        norm is known), in order (``before_change()`` first, once); whether anything changed."""
        self._learn_factors(factor)
        changed = False
        for g in self.groups:
            if not self.synced[g.key]:
                with self.cond:
                    copy = self._sets.pop(g.key, None)
                if copy is None:
                    continue  # nothing of the new count applies before the key holder's copy
                changed = changed or _call(before_change)
                self._take_copy(g.key, copy, optimizer)
            while True:
                with self.cond:
                    delta = _first(self._deltas, (g.key, self.applied[g.key]))
                    step = self.applied[g.key] + 1
                    parts = [self._grads.get((h, step), {}).get(g.key) for h in g.holders]
                if delta is None and (any(p is None for p in parts) or step not in self._factors):
                    break
                changed = changed or _call(before_change)
                if delta is not None:
                    self._add_delta(g.key, delta, optimizer)
                    continue
                self._step(g, parts, optimizer, params, self._factors[step])  # type: ignore[arg-type]
        with self.cond:
            done = min(self.applied.values())
            for step in [s for s in self._factors if s <= done]:
                del self._factors[step]
                self._names.pop(step, None)
        return changed

    def _learn_factors(self, factor: Factor | None) -> None:
        """Note the factors of the steps contributed whose global norm is now known (asked while it is: the
        stage's own step j reads the same norm, and a tied apply follows every step)."""
        with self.cond:
            for step in range(min(self.applied.values()) + 1, self.contributed + 1):
                if step in self._factors:
                    continue
                name = self._names.get(step)
                known = UNSCALED if factor is None or name is None else factor(name)
                if known is not None:
                    self._factors[step] = known

    def behind(self) -> bool:
        """Whether a forward must wait: a copy is more than ``lag`` tied steps behind this stage's own steps,
        or waits for the key holder's copy after a disruption."""
        return not all(self.synced.values()) or min(self.applied.values()) < self.contributed - self.lag

    def primary_behind(self) -> bool:
        """Whether a group this stage is primary of has not applied the stage's own steps yet (the other
        holders' contributions to them were sent before this stage's, so they are on their way), of those
        whose global norm is known (a later one's comes with the step that needs it)."""
        with self.cond:
            known = min(self.applied.values())
            while known < self.contributed and known + 1 in self._factors:
                known += 1
        return any(self.applied[g.key] < known for g in self.groups if g.primary == self.stage)

    def settled(self) -> bool:
        """Every step this stage contributed to is applied (at the end of training)."""
        return all(self.synced.values()) and min(self.applied.values()) >= self.contributed

    def wait(self, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait(timeout_s)

    def _group(self, key: str) -> TiedGroup:
        return next(g for g in self.groups if g.key == key)

    def _step(self, g: TiedGroup, parts: list[torch.Tensor], optimizer: torch.optim.Optimizer,
              params: Mapping[str, nn.Parameter], how: Applied) -> None:
        """Tied step ``applied + 1`` of group ``g``: the holders' gradients summed in holder order, scaled by
        the step's clipping factor, through the stage's optimizer at the step's learning rates with every
        other parameter's gradient held aside (skipped, as every stage's step is, when the step's global
        norm overflowed)."""
        if how.finite:
            p = self.param[g.key]
            total = _summed(parts, p.device)
            if how.factor != 1.0:
                total.mul_(how.factor)
            others = {q: q.grad for q in params.values() if q is not p}
            for q in others:
                q.grad = None
            p.grad = total
            now = [group["lr"] for group in optimizer.param_groups]
            for group, lr in zip(optimizer.param_groups, how.lrs):
                group["lr"] = lr
            optimizer.step()
            for group, lr in zip(optimizer.param_groups, now):
                group["lr"] = lr
            p.grad = None
            for q, grad in others.items():
                q.grad = grad
        with self.cond:
            step = self.applied[g.key] + 1
            for h in g.holders:
                self._grads.get((h, step), {}).pop(g.key, None)
                if not self._grads.get((h, step), True):
                    del self._grads[(h, step)]
            self.applied[g.key] = step

    def _take_copy(self, key: str, copy: Mapping[str, torch.Tensor],
                   optimizer: torch.optim.Optimizer) -> None:
        p = self.param[key]
        with torch.no_grad():
            p.copy_(copy[key])
        fields = {name.partition(SEP)[2]: t for name, t in copy.items() if SEP in name}
        if fields:
            optimizer.state[p] = {k: t.detach().clone().to(p.device if t.dim() else t.device)
                                  for k, t in fields.items()}
        self.synced[key] = True

    def _add_delta(self, key: str, delta: Mapping[str, torch.Tensor],
                   optimizer: torch.optim.Optimizer) -> None:
        p = self.param[key]
        with torch.no_grad():
            for name, d in sorted(delta.items()):
                _, _, state_key = name.partition(SEP)
                target = optimizer.state[p][state_key] if state_key else p
                target.add_(d.to(target.device))


def _first(deltas: dict[tuple[str, int], list[dict[str, torch.Tensor]]],
           at: tuple[str, int]) -> dict[str, torch.Tensor] | None:
    """The oldest delta waiting ``at`` (group key, step), taken off; None if none."""
    waiting = deltas.get(at)
    if not waiting:
        return None
    delta = waiting.pop(0)
    if not waiting:
        del deltas[at]
    return delta


def _summed(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The contributions added in holder order, on ``device``."""
    total = parts[0].detach().to(device).clone()
    for part in parts[1:]:
        total.add_(part.to(device))
    return total


def _call(fn: Callable[[], None]) -> bool:
    fn()
    return True
