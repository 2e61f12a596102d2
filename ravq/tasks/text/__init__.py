"""Built-in task: a transformers GPT-2 (a small config, built locally: no download) trained on a user's text.

The data is named in the topology's ``task_options`` (``configure``; the options are ``TextOptions``):
a tokenized ``.bin``/``.npy`` file or nanoGPT's ``train.bin``/``val.bin`` folder, memory-mapped; or a folder
of ``.txt``/``.jsonl`` documents, tokenized at start with a local tokenizer directory or as UTF-8 bytes
(``ravq.tasks.text.tokens``).  Without options it trains on the example the package ships
(``ravq/tasks/text/example``: CPython's documentation topics as text and JSON lines).

Each cluster trains on its own shard, a contiguous slice of the training tokens, in a seeded order of
windows per epoch; ``train_batches(..., start=k)`` opens the data at micro-batch ``k`` without reading what
comes before (``ravq.tasks.text.windows``), so a resumed node starts at its checkpoint's data position at
once.  ``eval_batches`` is one pass over the held-out tokens in order.  Needs ``pip install transformers``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravq.stage.optim import ClusterAdam
from ravq.tasks.text.tokens import Corpus, load_corpus, vocab_of
from ravq.tasks.text.windows import Batch, Windows

EXAMPLE = Path(__file__).resolve().parent / "example"
"""The example data the package ships: a folder of .txt and .jsonl files (about 300 KB)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TextOptions:
    """The task's settings: a topology's ``task_options``."""

    data: str = str(EXAMPLE)
    """The data: a folder of .txt/.jsonl files, a folder with train.bin (and val.bin), a .bin or a .npy file;
    relative to the current folder."""
    tokenizer: str | None = None
    """A local tokenizer directory (``save_pretrained``) for .txt/.jsonl; None: UTF-8 bytes."""
    held_out: float = 0.05
    """The share of the tokens, at their end, held out for evaluation (unless there is a val.bin)."""
    vocab_size: int | None = None
    """The model's vocabulary; None: the tokenizer's, a meta.json's beside a .bin, 257 for bytes, or 50304."""
    dtype: str | None = None
    """A .bin's token type; None: a meta.json's, or uint16 (nanoGPT's)."""
    text_field: str = "text"
    """The field of a .jsonl line holding its document."""
    context: int = 64
    """Tokens per sample."""
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    lr: float = 3e-3

    def __post_init__(self) -> None:
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out: {self.held_out} is not between 0 and 1")
        for name in ("data", "tokenizer"):
            path = getattr(self, name)
            if path is not None and not Path(path).exists():
                raise ValueError(f"{name}: {path} does not exist (relative to {Path.cwd()})")
        if self.dtype is not None and self.dtype not in ("uint16", "uint32", "int32", "int64"):
            raise ValueError(f"dtype: {self.dtype!r} is not uint16, uint32, int32 or int64")
        for name in ("context", "layers", "hidden", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} is not a positive integer")


class TextLM:
    """The task interface (docs/tasks.md) over one ``TextOptions``."""

    def __init__(self, options: TextOptions) -> None:
        self.options = options

    @cached_property
    def corpus(self) -> Corpus:
        o, (data, tokenizer) = self.options, self._paths()
        return load_corpus(data, tokenizer=tokenizer, held_out=o.held_out, vocab_size=o.vocab_size,
                           dtype=o.dtype, text_field=o.text_field)

    def _paths(self) -> tuple[Path, Path | None]:
        """The data and the tokenizer directory (None: bytes), absolute."""
        tokenizer = self.options.tokenizer
        return Path(self.options.data).resolve(), Path(tokenizer).resolve() if tokenizer else None

    @cached_property
    def vocab_size(self) -> int:
        """The model's vocabulary, known without reading or tokenizing the data."""
        data, tokenizer = self._paths()
        return vocab_of(data, tokenizer=tokenizer, vocab_size=self.options.vocab_size)

    def build_model(self) -> nn.Module:
        import transformers

        o, vocab = self.options, self.vocab_size
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=o.hidden, n_layer=o.layers, n_head=o.heads,
                                         n_positions=o.context, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, use_cache=False, bos_token_id=vocab - 1,
                                         eos_token_id=vocab - 1)
        return transformers.GPT2LMHeadModel(config)

    def split_points(self) -> list[str]:
        return [*(f"transformer.h.{i}" for i in range(1, self.options.layers)), "transformer.ln_f"]

    def example_inputs(self, micro_batch: int) -> tuple[torch.Tensor]:
        return (torch.zeros(micro_batch, self.options.context, dtype=torch.long),)

    def loss_fn(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def shard(self, shard: int, num_shards: int, seed: int) -> Windows:
        """Shard ``shard`` of ``num_shards``: a contiguous slice of the training tokens."""
        train = self.corpus.train
        span = len(train) // num_shards
        return Windows(train, lo=shard * span, hi=(shard + 1) * span, context=self.options.context,
                       vocab_size=self.corpus.vocab_size, key=(seed, shard, num_shards))

    def train_batches(self, micro_batch: int, shard: int, num_shards: int, seed: int,
                      start: int = 0) -> Iterator[Batch]:
        """Micro-batches ``start``, ``start + 1``, ... of this cluster's shard, forever (module docstring)."""
        return self.shard(shard, num_shards, seed).batches(micro_batch, start)

    def eval_batches(self, micro_batch: int, seed: int) -> Iterator[Batch]:
        """One pass over the held-out tokens' windows, in order (the same every round)."""
        held = self.corpus.held_out
        return Windows(held, lo=0, hi=len(held), context=self.options.context,
                       vocab_size=self.corpus.vocab_size, key=(seed,), shuffle=False).one_pass(micro_batch)

    def metrics_fn(self, outputs: Any, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Next-token accuracy (perplexity is exp of the loss)."""
        return {"accuracy": (outputs.logits.argmax(-1) == targets).float().mean()}

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return ClusterAdam(params, lr=self.options.lr)

    def uniform_loss(self) -> float:
        """The loss of a uniform guess over the vocabulary."""
        return math.log(self.vocab_size)


def configure(**options: Any) -> TextLM:
    """The task trained on the data the options name (``TextOptions``): a topology's ``task_options``."""
    return TextLM(TextOptions(**options))


_DEFAULT: list[TextLM] = []


def _default() -> TextLM:
    """The task on the shipped example, made when first used (importing the module reads no data)."""
    if not _DEFAULT:
        _DEFAULT.append(configure())
    return _DEFAULT[0]


def build_model() -> nn.Module:
    return _default().build_model()


def split_points() -> list[str]:
    return _default().split_points()


def example_inputs(micro_batch: int) -> tuple[torch.Tensor]:
    return _default().example_inputs(micro_batch)


def loss_fn(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return _default().loss_fn(outputs, targets)


def train_batches(micro_batch: int, shard: int, num_shards: int, seed: int,
                  start: int = 0) -> Iterator[Batch]:
    return _default().train_batches(micro_batch, shard, num_shards, seed, start)


def eval_batches(micro_batch: int, seed: int) -> Iterator[Batch]:
    return _default().eval_batches(micro_batch, seed)


def metrics_fn(outputs: Any, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return _default().metrics_fn(outputs, targets)


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return _default().make_optimizer(params)
