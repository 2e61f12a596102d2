"""Small models with the traits of the models people train, each as a task object (``tests.zoo:NAME``).

- ``batchnorm``: BatchNorm layers (running statistics, an integer ``num_batches_tracked``);
- ``rotary``: Llama-style attention with rotary embeddings whose ``inv_freq`` is a non-persistent
  buffer, computed once under ``@torch.no_grad`` and fed to every layer across the cuts;
- ``structured``: returns a dataclass (registered with pytree, as ``transformers.ModelOutput`` is)
  holding a dict, one of its tensors made before the last stage;
- ``tied``: an embedding tied to the output head (its first and last stage each hold a copy);
- ``unused``: a weight and a buffer ``forward`` never reads (stage 0 keeps them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FEATURES = 8
CLASSES = 3


def _classification_batches(micro_batch: int, shard: int, num_shards: int,
                            seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 7919 + shard + 11)
    while True:
        x = torch.randn(micro_batch, FEATURES, generator=gen) * 2 + 1  # off-centre: running stats move
        yield (x,), (x[:, 0] > x[:, 1]).long() + (x[:, 2] > 1.5).long()


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _task(build: Callable[[], nn.Module], example: Callable[[int], Any], loss: Callable[[Any, Any], torch.Tensor],
          batches: Callable[..., Iterator[Any]], cuts: list[str]) -> SimpleNamespace:
    return SimpleNamespace(build_model=build, example_inputs=example, loss_fn=loss, train_batches=batches,
                           make_optimizer=_sgd, split_points=lambda: list(cuts))


# ---------------------------------------------------------------------------------------------- BatchNorm
class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        self.bn2 = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.inp(x)))
        return self.head(torch.relu(self.bn2(self.mid(h))))


batchnorm = _task(BatchNormNet, lambda mb: (torch.zeros(mb, FEATURES),), F.cross_entropy, _classification_batches,
                  ["bn1", "mid", "bn2", "head"])


# ---------------------------------------------------------------------------------------------- rotary
SEQ, VOCAB, D_MODEL, HEADS = 8, 16, 16, 2


class Rotary(nn.Module):
    """cos/sin tables for positions 0..t-1, as Llama's rotary embedding makes them."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class RotaryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.out = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(self.norm(x)).split(d, dim=2))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(att.transpose(1, 2).reshape(b, t, d))


class RotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.rotary = Rotary(D_MODEL // HEADS)
        self.layers = nn.ModuleList(RotaryBlock() for _ in range(3))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        cos, sin = self.rotary(x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x)


def _token_batches(micro_batch: int, shard: int, num_shards: int,
                   seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """Sequences counting up by a random step modulo VOCAB: the next token is predictable."""
    gen = torch.Generator().manual_seed(seed * 104729 + shard + 5)
    offsets = torch.arange(SEQ + 1)
    while True:
        start = torch.randint(0, VOCAB, (micro_batch, 1), generator=gen)
        step = torch.randint(1, 4, (micro_batch, 1), generator=gen)
        seq = (start + step * offsets) % VOCAB
        yield (seq[:, :-1],), seq[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


rotary = _task(RotaryNet, lambda mb: (torch.zeros(mb, SEQ, dtype=torch.long),), _lm_loss, _token_batches,
               ["layers.0", "layers.1", "layers.2", "head"])


# ---------------------------------------------------------------------------------------------- outputs
@dataclass
class NetOutput:
    """What the model returns, like a ``transformers`` ``ModelOutput``: named fields, a nested dict."""

    logits: torch.Tensor
    extras: dict[str, torch.Tensor]


torch.utils._pytree.register_dataclass(NetOutput)


class StructuredNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = (nn.Linear(FEATURES, FEATURES) for _ in range(3))
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> NetOutput:
        a = torch.tanh(self.l1(x))
        b = torch.tanh(self.l2(a))
        c = torch.tanh(self.l3(b))
        # "early" is made in the first stage and never passes through the later ones
        return NetOutput(logits=self.head(c), extras={"early": a, "penalty": (c * c).mean()})


def _structured_loss(out: NetOutput, targets: torch.Tensor) -> torch.Tensor:
    assert isinstance(out, NetOutput), f"loss_fn got {type(out).__name__}, not the model's NetOutput"
    return F.cross_entropy(out.logits, targets) + 0.1 * out.extras["penalty"] + 0.01 * out.extras["early"].square().mean()


def _tuple_batches(micro_batch: int, shard: int, num_shards: int,
                   seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    for (x,), t in _classification_batches(micro_batch, shard, num_shards, seed):
        yield (x * 0.5,), t


structured = _task(StructuredNet, lambda mb: (torch.zeros(mb, FEATURES),), _structured_loss, _tuple_batches,
                   ["l2", "l3", "head"])


# ---------------------------------------------------------------------------------------------- tied
class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.mid = nn.Linear(D_MODEL, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(idx))))


tied = _task(TiedNet, lambda mb: (torch.zeros(mb, SEQ, dtype=torch.long),), _lm_loss, _token_batches, ["mid", "head"])


class UnusedNet(TiedNet):
    """TiedNet with a weight and a persistent buffer in its head that ``forward`` never reads (as a BERT MLM
    head's ``bias`` once untied from its decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.head.spare = nn.Parameter(torch.randn(VOCAB))
        self.head.register_buffer("count", torch.arange(3.0))


unused = _task(UnusedNet, lambda mb: (torch.zeros(mb, SEQ, dtype=torch.long),), _lm_loss, _token_batches,
               ["mid", "head"])

UNIFORM_LM_LOSS = math.log(VOCAB)


# ---------------------------------------------------------------------------------------------- refused
class KeyValueCache:
    """Stands in for transformers' DynamicCache: an object in the output that is not a tensor."""


class CachingNet(BatchNormNet):
    """Returns a cache beside its logits, as a transformers model does with ``use_cache=True``."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:  # type: ignore[override]
        return {"logits": super().forward(x), "past_key_values": KeyValueCache()}


cached = _task(CachingNet, lambda mb: (torch.zeros(mb, FEATURES),), lambda out, t: F.cross_entropy(out["logits"], t),
               _classification_batches, ["bn1", "mid", "bn2", "head"])
