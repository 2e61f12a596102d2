"""A user's task written from docs/tasks.md alone (session 9, ``/tmp/ravq/user/encoder.py``; docs/convergence.md,
"Tasks written outside the repository"): topic classification of token sequences with a small pre-norm
transformer encoder, AdamW 1e-3.  Each of 10 topics draws its tokens from its own Zipf-like distribution over
128 tokens, mixed with background tokens, so micro-batch gradients are noisy."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, TOPICS, D = 128, 48, 10, 64


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.classify = nn.Linear(D, TOPICS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.classify(self.norm(h).mean(dim=1))


def build_model() -> nn.Module:
    return Encoder()


def example_inputs(micro_batch: int) -> tuple[torch.Tensor]:
    return (torch.zeros(micro_batch, SEQ, dtype=torch.long),)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def _topics() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float32) ** -1.1
    return torch.stack([ranks[torch.randperm(VOCAB, generator=gen)] for _ in range(TOPICS)])


def train_batches(micro_batch: int, shard: int, num_shards: int, seed: int):
    probs = _topics()
    background = torch.full((VOCAB,), 1.0 / VOCAB)
    gen = torch.Generator().manual_seed(31 * seed + shard)
    while True:
        labels = torch.randint(0, TOPICS, (micro_batch,), generator=gen)
        mix = 0.35 * probs[labels] / probs[labels].sum(1, keepdim=True) + 0.65 * background
        tokens = torch.multinomial(mix, SEQ, replacement=True, generator=gen)
        yield (tokens,), labels


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
