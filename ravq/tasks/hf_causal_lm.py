"""Example task: a Hugging Face causal language model built from a config (random weights, no download).

Written the obvious way: ``build_model`` returns the ``transformers`` model, ``loss_fn`` takes its usual
output (a ``CausalLMOutputWithPast``; ravq rebuilds it on the last stage however many stages there are)
and reads ``.logits``.  One setting makes a model splittable: ``use_cache=False`` (a key/value cache,
``DynamicCache``, is for generation; it is not a tensor, so it cannot cross a stage cut or reach the loss).
GPT-2 ties its output head to its input embedding (``tie_word_embeddings``, transformers' default): the first
and the last stage each hold a copy and keep them equal (``ravq.stage.tied_step``).

The data is the built-in character corpus (``ravq.tasks.charlm``: CPython's documentation, shipped with
Python).  ``ravq demo --task ravq.tasks.hf_causal_lm`` trains the Llama-style model; ``...:gpt2`` a
GPT-2.  ``make_task`` builds other sizes (the tests use tiny ones).  Needs ``pip install transformers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravq.stage.optim import ClusterAdam
from ravq.tasks.charlm import VOCAB, corpus, training_end, windows

CONTEXT = 64


def make_task(
    kind: str = "llama",
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    context: int = CONTEXT,
    lr: float = 3e-3,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> SimpleNamespace:
    """A task object for ``kind`` "llama" or "gpt2" of the given size (the task interface:
    docs/design.md, "User-facing surface")."""
    if kind not in ("llama", "gpt2"):
        raise ValueError(f"kind: {kind!r} is not 'llama' or 'gpt2'")

    def build_model() -> nn.Module:
        return _build(kind, layers=layers, hidden=hidden, heads=heads, context=context)

    def example_inputs(micro_batch: int) -> tuple[torch.Tensor]:
        return (torch.zeros(micro_batch, context, dtype=torch.long),)

    def train_batches(micro_batch: int, shard: int, num_shards: int,
                      seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
        return _windows(micro_batch, shard, num_shards, seed, context)

    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return optimizer(params) if optimizer is not None else ClusterAdam(params, lr=lr)

    def split_points() -> list[str]:
        blocks = [f"model.layers.{i}" for i in range(layers)] if kind == "llama" else \
            [f"transformer.h.{i}" for i in range(layers)]
        return [*blocks[1:], "model.norm" if kind == "llama" else "transformer.ln_f"]

    def eval_batches(micro_batch: int, seed: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
        """Held-out windows: the end of the corpus no training batch reads (``ravq.tasks.charlm``)."""
        return _held_out(micro_batch, seed, context)

    return SimpleNamespace(
        build_model=build_model,
        example_inputs=example_inputs,
        loss_fn=loss_fn,
        train_batches=train_batches,
        make_optimizer=make_optimizer,
        split_points=split_points,
        eval_batches=eval_batches,
        metrics_fn=metrics_fn,
    )


def loss_fn(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the model's usual output."""
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _build(kind: str, *, layers: int, hidden: int, heads: int, context: int) -> nn.Module:
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False,
                              "bos_token_id": 0, "eos_token_id": 0}
    if kind == "llama":
        llama = transformers.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=context,
            **common,
        )
        return transformers.LlamaForCausalLM(llama)
    gpt2 = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    return transformers.GPT2LMHeadModel(gpt2)


def _windows(micro_batch: int, shard: int, num_shards: int, seed: int,
             context: int) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """Random windows from this shard's slice of the training part of the corpus, forever, reproducibly."""
    span = training_end() // num_shards
    return windows(micro_batch, shard * span, (shard + 1) * span, seed * 1_000_003 + shard, context)


def _held_out(
    micro_batch: int, seed: int, context: int
) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    return windows(micro_batch, training_end(), len(corpus()), 7_777_777 + seed, context)


def metrics_fn(outputs: Any, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Next-token accuracy (perplexity is exp of the loss)."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return {"accuracy": (logits.argmax(-1) == targets).float().mean()}


llama = make_task("llama")
gpt2 = make_task("gpt2")
build_model, example_inputs, train_batches = llama.build_model, llama.example_inputs, llama.train_batches
eval_batches = llama.eval_batches
make_optimizer, split_points = llama.make_optimizer, llama.split_points
