"""What a stage is told and what it hands back: its options, the messages it wants sent, micro-batch ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ravq.codec.compress import DEFAULT_BLOCK, Format, Packed

MicroBatch = tuple[int, int]
"""(cluster, index of the micro-batch in stage 0's data)."""


@dataclass(slots=True)
class Outbound:
    """A message the stage wants sent: ``kind`` "fwd" or "bwd" to stage ``dest``."""

    kind: str
    dest: int
    micro_batch: MicroBatch
    version: int
    tensors: dict[str, torch.Tensor | Packed]
    """Activations and gradients packed when the stage compresses (``StageOptions.compress``)."""
    generation: int = 0
    """The cluster generation the work belongs to; work of an older generation is never sent."""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON fields for the header (``ravq.stage.clip``: squared norms, global norms, loss scales)."""


@dataclass(kw_only=True, slots=True)
class RecipeOptions:
    """What ``ravq.stage.recipe.Recipe`` does around a stage's optimizer step."""

    precision: str = "fp32"
    """fp32, bf16 or fp16 autocast (``ravq.stage.precision``)."""
    lr_lambda: Callable[[int], float] | None = None
    """Factor of the task's learning rates at optimizer step v (``ravq.stage.lr``); None: unchanged."""
    clip_grad_norm: float | None = None
    """Global gradient norm each step is clipped to (``ravq.stage.clip``); None: no clipping."""
    metrics_fn: Callable[[Any, Any], Any] | None = None
    """The task's ``metrics_fn(outputs, targets)`` -> {name: value}, averaged per step (last stage)."""
    eval_every: int = 0
    """Optimizer steps between evaluation rounds (``ravq.stage.evaluate``); 0: none."""
    eval_count: int = 8
    """Micro-batches of held-out data per round."""
    eval_batches: Callable[[int, int], Any] | None = None
    """The task's ``eval_batches(micro_batch, seed)`` (stage 0 reads it)."""
    seed: int = 0


@dataclass(kw_only=True, slots=True)
class StageOptions:
    steps: int
    """Micro-batches this cluster trains on."""
    max_inflight: int
    update_every: int = 1
    micro_batch: int = 1
    predict_weights: float = 0.0
    """Run each forward at weights extrapolated along the last update by this many times the stage's
    recent mean staleness (see ``ravq.stage.stash.WeightStash``); 0 runs it at the current weights.  The
    last update and the staleness window are not checkpointed: after a resume the forwards run unpredicted
    until the first update, so with staleness > 0 a resume is not bit-exact (an asynchronous resume is
    not anyway: the micro-batches in flight start over).  With max_inflight 1 it stays exact."""
    extrapolate_gradients: float = 0.0
    """Delay compensation (``ravq.stage.delay``): a stale update hands the optimizer its gradient
    extrapolated by this many times its staleness along the change since the stage's last update;
    0 hands it the gradient as it is.  No effect without staleness (max_inflight 1).  The last gradient is
    not checkpointed: after a resume the first update is not extrapolated."""
    stale_correction: str = "auto"
    """``pipenag``: a stale update takes Nesterov's look-ahead step (``ravq.stage.pipenag``); ``none``: the
    optimizer's own step.  No effect without staleness (max_inflight 1)."""
    inflight_warmup_steps: int = 0
    """Stage 0 keeps one micro-batch in flight (trains synchronously) until its version reaches this many
    optimizer steps, then up to ``max_inflight`` (``ravq.config.TrainingConfig.inflight_warmup_steps``)."""
    synchronous: bool = False
    """``training.schedule: sync``: 1F1B with a flush at every update (stage 0 starts no micro-batch of the
    next update before it took this one; no stage forwards while its update waits), so nothing is stale."""
    split_backward: bool = False
    """``training.schedule: zero_bubble`` (with ``synchronous``): a backward sends its input-gradients first
    and defers its weight pass to when the stage would idle, or to its update (``ravq.stage.passes``)."""
    compress: Format = Format.NONE
    """How activations and gradients leave this stage (``ravq.codec.compress``); model inputs and targets
    never are compressed, and what arrives compressed is restored to the dtype this stage expects."""
    int8_block: int = DEFAULT_BLOCK
    recipe: RecipeOptions = field(default_factory=RecipeOptions)

    def inflight_limit(self, version: int) -> int:
        """Micro-batches stage 0 may keep in flight at its weight version ``version``."""
        warming = version < self.inflight_warmup_steps and not self.synchronous  # sync: nothing stale to warm
        return 1 if warming else self.max_inflight
