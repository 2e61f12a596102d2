"""Global gradient norms over a cluster's pipeline, without a blocking round trip.

Clipping by global norm (``training.clip_grad_norm``) and fp16's overflow check need, for each optimizer
step, the norm of the whole model's gradient, and every stage holds only its part.  The squared norms
ride on the pipeline's own traffic:

- **upstream, on backward messages.**  When a stage finishes the backwards of a step (the micro-batch
  that makes ``update_every``), it adds its own squared gradient norm to those its consumers sent with
  that micro-batch's backward and sends the lot (one float per stage, by stage index, so a stage reached
  by two paths is counted once) with its own backward.  Stage 0, the last to finish a step, then knows
  the global squared norm and applies the step at once.
- **downstream, on forward messages.**  Stage 0 puts the global norms of its recent steps on every
  forward it sends; each stage relays what it knows on its own forwards.  A stage holds each step's
  gradients aside (not in ``.grad``: the next step's backwards accumulate there) until the step's global
  norm arrives, then applies the step, scaled by ``min(1, max_norm / (norm + 1e-6))`` as
  ``torch.nn.utils.clip_grad_norm_`` scales it.  With micro-batches in flight stage 0 also sends each
  step's norm at once, on a *tail* message with no tensors (which each stage relays the same way), rather
  than only on its next forward; and after its last step it sends one anyway.

Which step's norm a stage uses: always its own step's, so every stage of the cluster scales step v by the
same factor.  The price is paid in staleness, not in waiting: nothing blocks, but stage s applies step v
only once v's norm has come from stage 0 (as control work, after the operation it is running), i.e.
after the backwards and forwards already in flight; with ``max_inflight`` k every stage's updates lag by
up to k - 1 micro-batches (stage 0's lag is what it was; later stages' lag grows to stage 0's).  Sent only
on stage 0's next forward, the norm arrived *with* that forward, so a later stage applied the step between
the forward's arrival and its backward leaving: on the micro-batch's round trip, which made stage 0 wait
longer for credits (docs/training.md); sent at once, it arrives while the later stage is still working on
an earlier micro-batch, and the step runs after that one's messages are sent.  With ``max_inflight: 1``
nothing is sent early: the norm of step v arrives with the next micro-batch's forward, before that
forward runs: exactly ``clip_grad_norm_`` in one process.

A step is named by the index of the micro-batch that completed it (stages finish backwards in stage 0's
order), so re-queued micro-batches after a pause overwrite the held step they made before it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

EPS = 1e-6
"""Added to the norm before dividing, as ``clip_grad_norm_`` does."""
OVERFLOW = -1.0
"""A squared norm that overflowed (inf or nan), as the JSON header carries it (JSON has no inf)."""


def _wire(sq: float) -> float:
    return sq if math.isfinite(sq) else OVERFLOW


def _unwire(sq: float) -> float:
    return math.inf if sq < 0 else sq


@dataclass(slots=True)
class HeldStep:
    """A step's summed weight gradients, held until its global norm is known."""

    grads: dict[str, torch.Tensor | None]
    versions: list[int]
    """The versions the step's micro-batches' forwards ran at (for staleness)."""


@dataclass(frozen=True, slots=True)
class Applied:
    """How a stage applied one step: the clipping factor, whether the step's global norm was finite (else it
    was skipped), and the learning rates of its optimizer's groups (what the tied step of the same step runs
    at, ``ravq.stage.tied_step``; empty: whatever they are)."""

    factor: float = 1.0
    finite: bool = True
    lrs: tuple[float, ...] = ()


def squared_norm(grads: dict[str, torch.Tensor | None]) -> float:
    """Sum of squares of every gradient (inf/nan when one overflowed): each tensor's norm in float32, as
    ``clip_grad_norm_`` takes it, summed in float64, with one device sync."""
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32)
             for g in grads.values() if g is not None]
    return float(torch.stack(norms).double().square().sum()) if norms else 0.0


def clip_factor(total_sq: float, max_norm: float | None) -> float:
    """What every stage multiplies a step's gradients by (1 without clipping)."""
    if max_norm is None or not math.isfinite(total_sq):
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_sq) + EPS))


def _parse_sq(value: Any, num_stages: int) -> dict[int, float] | None:
    if not isinstance(value, dict):
        return None
    out = {}
    for key, sq in value.items():
        stage_ok = isinstance(key, str) and key.isdigit() and int(key) < num_stages
        if not stage_ok or type(sq) not in (int, float):
            return None
        out[int(key)] = _unwire(float(sq))
    return out


def _parse_norms(value: Any) -> list[tuple[int, float]] | None:
    if not isinstance(value, list) or len(value) > 1024:
        return None
    out = []
    for item in value:
        pair = isinstance(item, list) and len(item) == 2
        if not (pair and type(item[0]) is int and type(item[1]) in (int, float)):
            return None
        out.append((item[0], _unwire(float(item[1]))))
    return out


class NormExchange:
    """One stage's side of the exchange: what it received, the global norms it knows, its held steps.

    ``receive`` runs in the event loop (under the stage's lock); everything else in the compute thread."""

    def __init__(self, stage: int, num_stages: int, window: int) -> None:
        self.stage, self.num_stages, self.window = stage, num_stages, window
        self.lock = threading.Lock()
        self.from_consumers: dict[int, dict[int, float]] = {}
        """Micro-batch index -> squared norms (by stage) its backward messages carried."""
        self.scales: dict[int, float] = {}
        """Micro-batch index -> the loss scale its loss was multiplied by (fp16)."""
        self.totals: OrderedDict[int, float] = OrderedDict()
        """Step (index of the micro-batch that completed it) -> global squared norm; the newest ``window``."""
        self.held: OrderedDict[int, HeldStep] = OrderedDict()

    # ----------------------------------------------------------------- arrivals (event loop)
    def check(self, kind: str, meta: dict[str, Any]) -> str | None:
        """None if the message's exchange fields are well formed, else why not."""
        if kind == "bwd":
            if "sq" in meta and _parse_sq(meta["sq"], self.num_stages) is None:
                return "bad_meta"
            if "ls" in meta and (type(meta["ls"]) not in (int, float) or not meta["ls"] > 0):
                return "bad_meta"
        elif "norms" in meta and _parse_norms(meta["norms"]) is None:
            return "bad_meta"
        return None

    def receive(self, kind: str, index: int, meta: dict[str, Any]) -> bool:
        """Record an accepted message's fields; True if it brought global norms this stage did not know."""
        with self.lock:
            if kind == "bwd":
                sq = _parse_sq(meta.get("sq"), self.num_stages)
                if sq:
                    self.from_consumers.setdefault(index, {}).update(sq)
                if "ls" in meta:
                    self.scales[index] = float(meta["ls"])
                return False
            new = False
            for step, total in _parse_norms(meta.get("norms", [])) or []:
                if step not in self.totals:
                    self._remember(step, total)
                    new = True
            return new

    def _remember(self, step: int, total_sq: float) -> None:
        self.totals[step] = total_sq
        while len(self.totals) > self.window:
            self.totals.popitem(last=False)

    # ----------------------------------------------------------------- the compute thread
    def set_scale(self, index: int, scale: float) -> None:
        """The last stage scaled micro-batch ``index``'s loss by ``scale`` (fp16)."""
        with self.lock:
            self.scales[index] = scale

    def scale_of(self, index: int) -> float | None:
        with self.lock:
            return self.scales.pop(index, None)

    def hold(self, index: int, grads: dict[str, torch.Tensor | None], versions: list[int],
             extra_sq: float = 0.0) -> dict[str, Any]:
        """Hold a finished step's gradients; returns the backward messages' fields (this stage's squared
        norm, with ``extra_sq`` (tied weights it counts), and its consumers'); on stage 0 also learns the
        step's global norm."""
        own = squared_norm(grads) + extra_sq
        self.held[index] = HeldStep(grads, versions)
        self.held.move_to_end(index)
        with self.lock:
            sq = {**self.from_consumers.pop(index, {}), self.stage: own}
            if self.stage == 0:
                if len(sq) != self.num_stages:
                    missing = sorted(set(range(self.num_stages)) - set(sq))
                    raise RuntimeError(f"step of micro-batch {index}: no squared norm from stages {missing}")
                self._remember(index, sum(sq.values()))
        return {"sq": {str(k): _wire(v) for k, v in sq.items()}}

    def ready(self) -> list[tuple[int, HeldStep, float]]:
        """Held steps whose global norm is known, oldest first, taken off the hold (in order only)."""
        out = []
        with self.lock:
            while self.held:
                index = next(iter(self.held))
                if index not in self.totals:
                    break
                out.append((index, self.held.pop(index), self.totals[index]))
        return out

    def total(self, step: int) -> float | None:
        """The global squared norm of the step named ``step``, if known."""
        with self.lock:
            return self.totals.get(step)

    def norms_meta(self) -> list[list[Any]]:
        """The global norms this stage knows, for its forward messages."""
        with self.lock:
            return [[step, _wire(total)] for step, total in self.totals.items()]

    def forget_received(self) -> None:
        """After a pause dropped the work in flight: what arrived for it is void (held steps stay)."""
        with self.lock:
            self.from_consumers.clear()
            self.scales.clear()
