"""The convergence zoo's tasks (issue #39): small models of several families, each with the optimizer and
learning rate one process would use for it (chosen once, never per method), on synthetic data with
structure to learn.

Token tasks read a Markov chain (100 states of the vocabulary, 4 successors each: the loss starts near
ln(vocabulary), a model that ignores its input stops at ln 100 = 4.6, the floor is ln 4 = 1.39); image tasks
read 10 classes of noisy 16x16 patterns.  Every model offers at least 4 places to cut, so each runs at 2, 3
and 4 stages.  ``TASKS`` maps the zoo's names to the tasks (each a module-like namespace, as ravq takes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravq.stage.optim import ClusterAdam
from ravq.tasks import charlm
from ravq.tasks.hf_causal_lm import loss_fn as lm_loss

VOCAB, STATES, SUCCESSORS, CONTEXT = 256, 100, 4, 32
CLASSES, SIDE = 10, 16
MASK = VOCAB - 1


def _walks(micro_batch: int, shard: int, num_shards: int, seed: int, length: int) -> Iterator[torch.Tensor]:
    successors = torch.randint(0, STATES, (STATES, SUCCESSORS), generator=torch.Generator().manual_seed(123))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + num_shards)
    while True:
        walk = torch.empty(micro_batch, length, dtype=torch.long)
        walk[:, 0] = torch.randint(0, STATES, (micro_batch,), generator=gen)
        for t in range(1, length):
            walk[:, t] = successors[walk[:, t - 1], torch.randint(0, SUCCESSORS, (micro_batch,), generator=gen)]
        yield walk


def next_token_batches(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
    for walk in _walks(micro_batch, shard, num_shards, seed, CONTEXT + 1):
        yield (walk[:, :-1],), walk[:, 1:]


def masked_batches(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
    """BERT's objective: 15% of the tokens (at least one per row) replaced by MASK, predicted from both sides."""
    gen = torch.Generator().manual_seed(seed + 17)
    for walk in _walks(micro_batch, shard, num_shards, seed, CONTEXT):
        masked = torch.rand(walk.shape, generator=gen) < 0.15
        masked[torch.arange(micro_batch), torch.randint(0, CONTEXT, (micro_batch,), generator=gen)] = True
        targets = torch.where(masked, walk, torch.full_like(walk, -100))
        yield (torch.where(masked, torch.full_like(walk, MASK), walk),), targets


def pair_batches(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
    """T5: the walk's first half into the encoder, the second half (shifted) decoded from it."""
    half = CONTEXT // 2
    for walk in _walks(micro_batch, shard, num_shards, seed, CONTEXT + 1):
        yield (walk[:, :half], walk[:, half:-1]), walk[:, half + 1:]


def image_batches(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
    """10 classes, each a fixed random 3x16x16 pattern, seen at a random shift with noise of its size."""
    patterns = torch.randn(CLASSES, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(321))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + num_shards)
    while True:
        labels = torch.randint(0, CLASSES, (micro_batch,), generator=gen)
        shift = int(torch.randint(-2, 3, (1,), generator=gen))
        images = torch.roll(patterns[labels], shift, dims=-1) + 1.5 * torch.randn(micro_batch, 3, SIDE, SIDE,
                                                                                   generator=gen)
        yield (images,), labels


def _adam(lr: float, cls: type = torch.optim.Adam, **kw: Any) -> Callable[[Iterable[nn.Parameter]], Any]:
    return lambda params: cls(params, lr=lr, **kw)


def _task(build: Callable[[], nn.Module], *, loss: Callable[[Any, Any], torch.Tensor], batches: Callable[..., Any],
          example: Callable[[int], tuple], optimizer: Callable[..., Any], cuts: list[str]) -> SimpleNamespace:
    return SimpleNamespace(build_model=build, loss_fn=loss, train_batches=batches, example_inputs=example,
                           make_optimizer=optimizer, split_points=lambda: list(cuts))


def _tokens(mb: int, n: int = CONTEXT) -> tuple[torch.Tensor]:
    return (torch.zeros(mb, n, dtype=torch.long),)


def _causal(kind: str, tied: bool) -> nn.Module:
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, "use_cache": False, "tie_word_embeddings": tied,
                              "bos_token_id": 0, "eos_token_id": 0}
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=CONTEXT, **common))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=4, n_head=2, n_positions=CONTEXT, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        **common))


def _bert() -> nn.Module:
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=CONTEXT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class T5Pair(nn.Module):
    """T5 as a task's model: the encoder's and the decoder's token ids positionally."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2,
            dropout_rate=0.0, use_cache=False, decoder_start_token_id=0))

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> Any:
        return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids)


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.vit = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=SIDE, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=128, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=pixels).logits


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(_conv_block(3, 16), _conv_block(16, 32), nn.MaxPool2d(2), _conv_block(32, 32),
                                    nn.MaxPool2d(2), _conv_block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                    nn.Linear(64, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ResidualMLP(nn.Module):
    """A residual MLP regressing a fixed random teacher network (SGD with momentum: the other family)."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


def teacher_batches(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
    teacher = torch.Generator().manual_seed(555)
    w1, w2 = torch.randn(16, 32, generator=teacher) / 4, torch.randn(32, generator=teacher) / 32 ** 0.5
    gen = torch.Generator().manual_seed(seed * 1_000_003 + shard * 7919 + num_shards)
    while True:
        x = torch.randn(micro_batch, 16, generator=gen)
        yield (x,), torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(micro_batch, generator=gen)


def _images(mb: int) -> tuple[torch.Tensor]:
    return (torch.zeros(mb, 3, SIDE, SIDE),)


def _classify(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


_GPT = ["transformer.h.1", "transformer.h.2", "transformer.h.3", "transformer.ln_f"]
_LLAMA = ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm"]
TASKS: dict[str, SimpleNamespace] = {
    "gpt2_tied": _task(lambda: _causal("gpt2", tied=True), loss=lm_loss, batches=next_token_batches,
                       example=_tokens, optimizer=_adam(3e-3), cuts=_GPT),
    "llama": _task(lambda: _causal("llama", tied=False), loss=lm_loss, batches=next_token_batches,
                   example=_tokens, optimizer=_adam(3e-3), cuts=_LLAMA),
    "bert_mlm": _task(_bert, loss=lm_loss, batches=masked_batches, example=_tokens,
                      optimizer=_adam(1e-3, torch.optim.AdamW, weight_decay=0.01),
                      cuts=["bert.encoder.layer.1", "bert.encoder.layer.2", "bert.encoder.layer.3", "cls"]),
    "t5": _task(T5Pair, loss=lm_loss, batches=pair_batches,
                example=lambda mb: (_tokens(mb, CONTEXT // 2)[0], _tokens(mb, CONTEXT // 2)[0]),
                optimizer=_adam(1e-3, torch.optim.AdamW, weight_decay=0.01),
                cuts=["t5.encoder.block.1", "t5.decoder", "t5.decoder.block.1", "t5.lm_head"]),
    "vit": _task(ViT, loss=_classify, batches=image_batches, example=_images,
                 optimizer=_adam(1e-3, torch.optim.AdamW, weight_decay=0.05),
                 cuts=["vit.vit.layers.1", "vit.vit.layers.2", "vit.vit.layers.3",
                       "vit.vit.layernorm"]),
    "bn_cnn": _task(BatchNormCNN, loss=_classify, batches=image_batches, example=_images,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=5e-4),
                    cuts=["layers.1", "layers.3", "layers.4", "layers.6"]),
    "charlm": _task(charlm.build_model, loss=charlm.loss_fn, batches=charlm.train_batches,
                    example=charlm.example_inputs, optimizer=lambda ps: ClusterAdam(ps, lr=charlm.LEARNING_RATE),
                    cuts=charlm.split_points()),
    "mlp_sgd": _task(ResidualMLP, loss=F.mse_loss, batches=teacher_batches, example=lambda mb: (torch.zeros(mb, 16),),
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                     cuts=["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
}
"""The zoo; GPT-2's head is tied to its embedding (its first and last stages share the tensor)."""

# Each task by name, for ``ravq demo --task benchmarks.zoo_tasks:llama`` (real processes; ``charlm`` is
# ``ravq.tasks.charlm`` itself): bench_convergence.py --compare-inflight's wall time on the zoo.
gpt2_tied, llama, bert_mlm, t5 = (TASKS[n] for n in ("gpt2_tied", "llama", "bert_mlm", "t5"))
vit, bn_cnn, mlp_sgd = (TASKS[n] for n in ("vit", "bn_cnn", "mlp_sgd"))
