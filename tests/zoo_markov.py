"""A tiny GPT-2 and Llama (transformers configs, random weights) on a Markov chain, trained with Adam at
lr 3e-3: the trial of issue #25, where one step of pipeline staleness stalled the model at the plateau.

The chain walks over the first 100 of 512 token ids, each with 4 equally likely successors: the loss
starts near ln 512 = 6.2, a model that ignores its input stops at ln 100 = 4.6 (the plateau) and the
floor is ln 4 = 1.39.  ``tests.zoo_markov:gpt2`` / ``:llama`` as demo tasks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ravq.tasks.hf_causal_lm import loss_fn

VOCAB = 512
STATES = 100
SUCCESSORS = 4
CONTEXT = 32


def train_batches(micro_batch: int, shard: int, num_shards: int,
                  seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """Walks of the chain from random starts, forever, reproducibly (each shard its own stream)."""
    successors = torch.randint(0, STATES, (STATES, SUCCESSORS), generator=torch.Generator().manual_seed(123))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + num_shards)
    while True:
        walk = torch.empty(micro_batch, CONTEXT + 1, dtype=torch.long)
        walk[:, 0] = torch.randint(0, STATES, (micro_batch,), generator=gen)
        for t in range(CONTEXT):
            walk[:, t + 1] = successors[walk[:, t], torch.randint(0, SUCCESSORS, (micro_batch,), generator=gen)]
        yield (walk[:, :-1],), walk[:, 1:]


def _build(kind: str) -> nn.Module:
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False, "tie_word_embeddings": False,
                              "bos_token_id": 0, "eos_token_id": 0}
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=CONTEXT, **common))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=2, n_positions=CONTEXT, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        **common))


def _task(kind: str) -> SimpleNamespace:
    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=3e-3)

    def split_points() -> list[str]:
        return ["model.layers.1", "model.norm"] if kind == "llama" else ["transformer.h.1", "transformer.ln_f"]

    return SimpleNamespace(build_model=lambda: _build(kind), loss_fn=loss_fn, train_batches=train_batches,
                           example_inputs=lambda mb: (torch.zeros(mb, CONTEXT, dtype=torch.long),),
                           make_optimizer=make_optimizer, split_points=split_points)


gpt2 = _task("gpt2")
llama = _task("llama")
