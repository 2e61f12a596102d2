"""A task whose model no test PC can hold: a 24-block transformer of ~680 M parameters (2.72 GB in
float32), for the memory-limited swarm test.  Plain SGD (no optimizer state) and one short sequence per
micro-batch, so a stage's memory is its weights and gradients; layers initialise themselves
(``reset_parameters``), so no node ever builds the whole model."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL = int(os.environ.get("RAVQ_BIG_D_MODEL", "1536"))
LAYERS = int(os.environ.get("RAVQ_BIG_LAYERS", "24"))
HEADS, VOCAB, CONTEXT = 16, 256, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.mlp_in = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.mlp_out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))


class BigLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return BigLM()


def split_points() -> list[str]:
    return [f"blocks.{i}" for i in range(1, LAYERS)]


def example_inputs(micro_batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(micro_batch, CONTEXT, dtype=torch.long),)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, VOCAB), targets.reshape(-1))


def train_batches(micro_batch: int, shard: int, num_shards: int,
                  seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 31 + shard)
    while True:
        start = torch.randint(0, VOCAB, (micro_batch, 1), generator=gen)
        seq = (start + torch.arange(CONTEXT + 1)) % VOCAB  # counting up: the next token is predictable
        yield (seq[:, :-1],), seq[:, 1:]


def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)
