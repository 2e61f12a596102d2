"""Built-in task: a small GPT-style character model on text that ships with Python.

The corpus is CPython's own documentation topics (``pydoc_data.topics``, ~700 KB of English prose),
so the demo needs no download.  A uniform guess scores ln(96) = 4.56 nats per character; the model
gets well under 3 within a couple of minutes on two CPU cores.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from ravq.stage.optim import ClusterAdam

VOCAB = 96  # printable ASCII 32..126 plus newline (index 95)
CONTEXT = 64
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 6
LEARNING_RATE = 3e-3


@lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The whole corpus as a uint8 tensor of token ids (deterministic order)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    ids = bytearray()
    for ch in text.encode("ascii", errors="replace"):
        ids.append(95 if ch == 10 else (ch - 32 if 32 <= ch < 127 else 0))
    return torch.frombuffer(ids, dtype=torch.uint8).clone()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp_in = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.mlp_out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, N_HEADS, d // N_HEADS)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))


class CharGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(1, CONTEXT, D_MODEL))
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The model's own parameter (each layer resets its own): how ravq initialises it on any stage."""
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return CharGPT()


def split_points() -> list[str]:
    """Module names where a stage may begin, in model order."""
    return [f"blocks.{i}" for i in range(N_LAYERS)] + ["ln_f"]


def example_inputs(micro_batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(micro_batch, CONTEXT, dtype=torch.long),)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, VOCAB), targets.reshape(-1))


HELD_OUT = 0.05
"""The corpus's last 5% is held out for evaluation: training never reads it."""


def training_end() -> int:
    """Index where the held-out part of the corpus begins."""
    return int(len(corpus()) * (1 - HELD_OUT))


def windows(micro_batch: int, lo: int, hi: int, seed: int,
            context: int = CONTEXT) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Random windows of ``corpus()[lo:hi]`` (next-character targets), forever, reproducibly."""
    data = corpus()
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(lo, hi - context - 1, (micro_batch, 1), generator=gen)
        window = data[starts + offsets].long()
        yield (window[:, :-1],), window[:, 1:]


def train_batches(micro_batch: int, shard: int, num_shards: int,
                  seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Random windows from this shard's contiguous slice of the training part of the corpus."""
    span = training_end() // num_shards
    return windows(micro_batch, shard * span, (shard + 1) * span, seed * 1_000_003 + shard)


def eval_batches(micro_batch: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Random windows from the held-out end of the corpus (the same ones for a given seed)."""
    return windows(micro_batch, training_end(), len(corpus()), 7_777_777 + seed)


def metrics_fn(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Next-character accuracy (perplexity is exp of the loss)."""
    return {"accuracy": (outputs.argmax(-1) == targets).float().mean()}


def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam; with C clusters averaging, each steps as Adam would on all C clusters' batches together
    (``ravq.stage.optim.ClusterAdam``; exactly ``torch.optim.Adam`` with one cluster)."""
    return ClusterAdam(params, lr=LEARNING_RATE)


UNIFORM_LOSS = math.log(VOCAB)
