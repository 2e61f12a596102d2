"""A synthetic ravq task whose blocks all cost the same: for pipeline benchmarks, not for learning.

The model is ``BLOCKS`` identical blocks, each ``LayerNorm -> (Linear(width, width) -> ReLU) x layers``.
The LayerNorm resets the scale at every block, so activations neither vanish into denormals nor blow
up and every block costs the same at every step.  Stages may begin at any block, so 4 stages over 4
blocks (or over any multiple of 4) are equal.  Inputs are a fixed pool of random micro-batches (made
once per shard and seed, then cycled, so reading data costs nothing); the target is one number per
sample and the loss is the mean squared error of each sample's mean output: negligible next to a block.

Use it as ``--task benchmarks.synthetic_task`` (the default size, about 25 ms per stage forward on one
core with a micro-batch of 256) or name a preset: ``benchmarks.synthetic_task:quick`` (half the work per
stage), ``:device`` or ``:device_quick`` (simulated accelerator time, below).

Simulated device time.  The presets above are CPU matmuls: 4 stage processes on a 2-core machine then
share the cores, so a stage's time depends on how many others compute at that moment, which measures
the OS scheduler as much as the pipeline.  With ``device_ms`` every block also waits ``device_ms`` in
forward and twice that in backward, off the CPU and without the GIL (``time.sleep`` inside a custom
torch op, as a kernel on an accelerator would be), and the Linear work shrinks to one small layer: each
stage then behaves as if it had a machine of its own, which is what the pipeline is built for.  The
custom op ``ravqbench::device_time`` is an opaque node to ``torch.export``, so ravq's splitter and
``torch.distributed.pipelining`` cut and run it alike.  The repo root must be on ``sys.path`` (it is when ravq runs from a checkout's root).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCKS = 4
LEARNING_RATE = 1e-3
DATA_POOL = 16
"""Distinct micro-batches per shard; cycled."""


@torch.library.custom_op("ravqbench::device_time", mutates_args=())
def device_time(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """``x`` unchanged after ``seconds`` of simulated accelerator time (the GIL released)."""
    time.sleep(seconds)
    return x.clone()


@device_time.register_fake
def _device_time_fake(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def _device_time_setup(ctx: object, inputs: tuple[torch.Tensor, float], output: torch.Tensor) -> None:
    ctx.seconds = inputs[1]  # type: ignore[attr-defined]


def _device_time_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return torch.ops.ravqbench.device_time(grad, 2 * ctx.seconds), None  # type: ignore[attr-defined]


device_time.register_autograd(_device_time_backward, setup_context=_device_time_setup)


class Block(nn.Module):
    def __init__(self, width: int, layers: int, device_s: float = 0.0) -> None:
        super().__init__()
        self.device_s = device_s
        self.norm = nn.LayerNorm(width)
        linears = [nn.Linear(width, width) for _ in range(layers)]
        for layer in linears:
            # He init keeps the variance through ReLU: every layer sees inputs of the same scale.
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        self.layers = nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for layer in self.layers:
            x = F.relu(layer(x))
        if self.device_s > 0:
            x = torch.ops.ravqbench.device_time(x, self.device_s)
        return x


class BlockStack(nn.Module):
    def __init__(self, width: int, layers: int, blocks: int, device_s: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, layers, device_s) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True, slots=True)
class SyntheticTask:
    """The task interface (build_model, split_points, example_inputs, loss_fn, train_batches,
    make_optimizer) for one model size."""

    width: int = 512
    """Features per sample and the size of every Linear."""
    layers: int = 8
    """Linear+ReLU layers per block."""
    blocks: int = BLOCKS
    """Identical blocks; a multiple of the stage count gives equal stages."""
    device_ms: float = 0.0
    """Simulated accelerator time per block in forward (backward: twice that); 0 for none."""

    def build_model(self) -> nn.Module:
        return BlockStack(self.width, self.layers, self.blocks, self.device_ms / 1e3)

    def split_points(self) -> list[str]:
        return [f"blocks.{i}" for i in range(1, self.blocks)]

    def example_inputs(self, micro_batch: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(micro_batch, self.width),)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.mean(dim=1), targets)

    def train_batches(self, micro_batch: int, shard: int, num_shards: int,
                      seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        """A pool of random micro-batches for this shard, cycled forever, reproducibly."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + num_shards)
        pool = [(torch.randn(micro_batch, self.width, generator=gen), torch.randn(micro_batch, generator=gen))
                for _ in range(DATA_POOL)]
        while True:
            for inputs, targets in pool:
                yield (inputs,), targets

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9)

    def forward_flops(self, micro_batch: int) -> int:
        """Multiply-add FLOPs of one forward of the whole model (the Linears; the rest is noise)."""
        return 2 * micro_batch * self.width * self.width * self.layers * self.blocks


default = SyntheticTask()
quick = SyntheticTask(layers=4)
device = SyntheticTask(layers=1, device_ms=25.0)
device_quick = SyntheticTask(layers=1, device_ms=12.5)
link = SyntheticTask(layers=1, blocks=2, device_ms=10.0)
"""bench_pipeline_link.py: 2 stages of one block each, 10 ms forward + 20 ms backward of simulated device
time, so a 50 Mbit/s link (a micro-batch of 256: 0.5 MB of activations, ~84 ms) decides the rate."""

# The module itself is a task too (``--task benchmarks.synthetic_task``): the default size.
build_model = default.build_model
split_points = default.split_points
example_inputs = default.example_inputs
loss_fn = default.loss_fn
train_batches = default.train_batches
make_optimizer = default.make_optimizer
