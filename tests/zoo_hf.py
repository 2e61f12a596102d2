"""Tiny Hugging Face models (random weights, no download) as tasks: ``tests.zoo_hf:gpt2`` / ``:llama`` (causal
LMs; GPT-2's head tied to its embedding), ``:t5`` (encoder-decoder, four names tied) and ``:bert`` (masked LM,
tied head and bias).

Plain SGD, so averaging the weights of 2 clusters every step equals one process on both clusters' batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ravq.tasks.charlm import VOCAB
from ravq.tasks.hf_causal_lm import _windows, loss_fn, make_task


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)


gpt2 = make_task("gpt2", layers=3, hidden=32, heads=2, context=16, optimizer=_sgd)
llama = make_task("llama", layers=3, hidden=32, heads=2, context=16, optimizer=_sgd)


class T5Pair(nn.Module):
    """T5 as a task's model: forward takes the encoder's and the decoder's token ids positionally."""

    def __init__(self, t5: nn.Module) -> None:
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> Any:
        return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids)


def _t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0)
    return T5Pair(transformers.T5ForConditionalGeneration(config))


def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=CONTEXT, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _pairs(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
    """T5: the window's tokens into the encoder and the decoder, the next tokens as targets."""
    for (x,), y in _windows(micro_batch, shard, num_shards, seed, CONTEXT):
        yield (x, x), y


def _hf_task(build: Callable[[], nn.Module], inputs: int, batches: Callable[..., Iterator[Any]],
             split_points: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        build_model=build, loss_fn=loss_fn, make_optimizer=_sgd, split_points=lambda: list(split_points),
        example_inputs=lambda micro_batch: tuple(torch.zeros(micro_batch, CONTEXT, dtype=torch.long)
                                                 for _ in range(inputs)),
        train_batches=batches)


CONTEXT = 16
t5 = _hf_task(_t5, 2, _pairs, ["t5.encoder.block.1", "t5.decoder", "t5.decoder.block.1", "t5.lm_head"])
"""T5 (encoder-decoder): ``shared``, ``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``lm_head`` are one
tensor; its holders are the stages reading any of them."""
bert = _hf_task(_bert, 1, lambda mb, shard, n, seed: _windows(mb, shard, n, seed, CONTEXT),
                ["bert.encoder.layer.1", "cls"])
"""BERT MLM: the decoder is tied to the word embeddings (first and last stage) and its ``bias`` to
``cls.predictions.bias`` (in one stage)."""


def _bert_without_head_bias() -> nn.Module:
    """A user's change after ``__init__``: the MLM head without its bias (transformers' ``_init_weights`` zeroes
    ``cls.predictions.bias``, now None)."""
    model = _bert()
    model.cls.predictions.bias = None
    model.cls.predictions.decoder.bias = None
    return model


def _t5_without_shared() -> nn.Module:
    """A user's change after ``__init__``: ``shared`` replaced by ``Identity`` (the encoder and decoder keep the
    embedding; ``_init_weights`` of the model reads ``shared.weight``)."""
    model = _t5()
    model.t5.shared = nn.Identity()
    return model


bert_edited = _hf_task(_bert_without_head_bias, 1, lambda mb, shard, n, seed: _windows(mb, shard, n, seed, CONTEXT),
                       ["bert.encoder.layer.1", "cls"])
t5_edited = _hf_task(_t5_without_shared, 2, _pairs, ["t5.decoder", "t5.lm_head"])
