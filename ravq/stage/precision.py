"""Mixed precision of one stage: autocast of forwards and the loss, and fp16's dynamic loss scale.

Weights, their gradients and the optimizer's state stay float32 (the master weights): the stashed
weights a forward runs at are float32 copies and autocast casts them per operation, exactly as it casts
the live parameters of a model trained in one process.  Activations leave a stage in the dtype autocast
gave them (bf16/fp16 for a matmul's output), so the stage input specs are taken under the same autocast
(``autocast_for``), and the gradients sent back have the activations' dtypes.

fp16 needs a loss scale.  The last stage owns it: it multiplies each micro-batch's loss by its current
scale and tells every stage upstream which scale that micro-batch used (on the backward messages), so each
stage unscales its weight gradients by the scale its own gradients carry.  Whether a step overflowed is a
property of the whole cluster's gradient: every stage's squared gradient norm is exchanged for the global
norm (``ravq.stage.clip``), and a non-finite global norm makes every stage skip that step, as
``torch.amp.GradScaler`` skips it; the last stage then halves its scale (and doubles it after
``growth_interval`` finite steps), as GradScaler does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast_for(precision: str, device: torch.device | str) -> Iterator[None]:
    """Autocast on ``device``'s own device type (cpu, cuda, mps) for bf16/fp16; nothing for fp32."""
    if precision == "fp32":
        yield
        return
    if precision not in DTYPES:
        raise ValueError(f"training.precision: must be fp32, bf16 or fp16, got {precision!r}")
    with torch.autocast(torch.device(device).type, dtype=DTYPES[precision]):
        yield


class LossScale:
    """The last stage's dynamic loss scale (GradScaler's defaults and rules)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite: bool) -> None:
        """After a step whose global gradient norm was finite (or not)."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
