"""Micro-batches of a token stream by their index: the k-th batch of a shard is computed, never reached.

A shard's tokens ``[lo, hi)`` are cut into ``count`` windows of ``context + 1`` tokens at stride ``context``
(the inputs are a window's first ``context`` tokens, the targets the next token at each place).  Sample
``i`` of the shard is window ``order(e)[i mod count]`` of epoch ``e = i // count``, where ``order(e)`` is a
permutation of the windows seeded by (seed, shard, e): every window once per epoch, in a new order each
epoch.  Micro-batch ``k`` holds samples ``k * micro_batch`` to ``(k + 1) * micro_batch - 1``, so opening the
data at position ``k`` costs one permutation of the windows (made once per epoch), whatever ``k`` is, and
reads only the tokens of the windows it yields.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count as counting

import numpy as np
import torch

Batch = tuple[tuple[torch.Tensor], torch.Tensor]
"""((inputs,), targets), each ``micro_batch x context`` int64 token ids."""


class Windows:
    """The windows of ``tokens[lo:hi]``, in a seeded order per epoch (in stream order: ``shuffle=False``)."""

    def __init__(self, tokens: np.ndarray, *, lo: int, hi: int, context: int, vocab_size: int,
                 key: tuple[int, ...], shuffle: bool = True) -> None:
        self.count = max(0, (hi - lo - 1) // context)
        """Windows in the range: one epoch of samples."""
        if self.count < 1:
            raise ValueError(f"{hi - lo} tokens hold no window of context + 1 = {context + 1} tokens; give "
                             "more data, fewer clusters, a smaller held_out or a smaller context")
        self._tokens, self._lo, self._context, self._vocab = tokens, lo, context, vocab_size
        self._key = tuple(k % (1 << 63) for k in key)  # SeedSequence takes non-negative integers
        self._shuffle = shuffle
        self._orders: dict[int, np.ndarray] = {}
        """The permutation of the last two epochs used (a micro-batch may straddle two)."""

    def start_of(self, sample: int) -> int:
        """Index of the first token of ``sample``'s window."""
        epoch, j = divmod(sample, self.count)
        window = self._order(epoch)[j] if self._shuffle else j
        return self._lo + int(window) * self._context

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            rng = np.random.default_rng(np.random.SeedSequence([*self._key, epoch]))
            self._orders[epoch] = rng.permutation(self.count)
        return self._orders[epoch]

    def batch(self, index: int, micro_batch: int) -> Batch:
        """Micro-batch ``index`` (from 0)."""
        width = self._context + 1
        rows = np.empty((micro_batch, width), dtype=np.int64)
        for r, sample in enumerate(range(index * micro_batch, (index + 1) * micro_batch)):
            start = self.start_of(sample)
            rows[r] = self._tokens[start:start + width]
        top = int(rows.max())
        if top >= self._vocab:
            raise ValueError(f"token id {top} in the data is not below vocab_size {self._vocab}: give the "
                             "task option vocab_size (or a meta.json beside the .bin) the tokenizer used")
        window = torch.from_numpy(rows)
        return (window[:, :-1],), window[:, 1:]

    def batches(self, micro_batch: int, start: int = 0) -> Iterator[Batch]:
        """Micro-batches ``start``, ``start + 1``, ... forever."""
        for index in counting(start):
            yield self.batch(index, micro_batch)

    def one_pass(self, micro_batch: int) -> Iterator[Batch]:
        """Every whole micro-batch of the first epoch once (a held-out set: the same ones every time)."""
        for index in range(self.count // micro_batch):
            yield self.batch(index, micro_batch)
