"""What a restart at a data position costs stage 0: the time from opening the data at micro-batch N to
holding that batch, at N = 0 and N = 10^6, for a task whose ``train_batches`` takes ``start`` (ravq.tasks.text
on a tokenized .bin, memory-mapped) against the same batches in the generator form (no ``start``: the feed
replays them from the beginning, as every task did before issue #41).

    python benchmarks/bench_data_position.py [--tokens 20000000] [--micro-batch 16] [--repeats 21]
                                             [--reference-positions 0,10000,100000,1000000] [--json]

Each figure goes through the node's own path, ``ravq.stage.feed.DataFeed`` over a ``DataSource``:
``skip_to(N)`` then ``take()``, with a fresh task each time (the .bin opened again, no cached permutation).
The data is a nanoGPT-layout folder (train.bin, val.bin, meta.json) of random uint16 tokens written to a
temporary folder.  Medians of ``--repeats``, the two positions interleaved after one warm-up; the replayed reference is measured once per position (it is
O(N): 10^6 micro-batches take a minute or more).  The machine may be shared: note the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import emit_json, use_repo_checkout

use_repo_checkout()

import numpy as np
import orjson

from ravq.stage.feed import DataFeed, DataSource, takes_start
from ravq.tasks.text import configure
from ravq.tasks.text.tokens import load_corpus


def write_data(folder: Path, tokens: int, vocab: int = 50304) -> None:
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, vocab, tokens // 20, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_bytes(orjson.dumps({"vocab_size": vocab, "dtype": "uint16"}))


def first_batch_s(folder: Path, position: int, micro_batch: int, positional: bool) -> float:
    """Seconds from opening the data at ``position`` to holding its batch (a fresh task: nothing cached)."""
    load_corpus.cache_clear()
    task = configure(data=str(folder))

    def generator_form(micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
        yield from task.train_batches(micro_batch, shard, num_shards, seed)

    batches = task.train_batches if positional else generator_form
    assert takes_start(batches) == positional
    t0 = time.perf_counter()
    feed = DataFeed(DataSource(train_batches=batches, micro_batch=micro_batch, shard=0, num_shards=2, seed=0))
    feed.skip_to(position)
    index, _ = feed.take()
    elapsed = time.perf_counter() - t0
    assert index == position
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=20_000_000, help="tokens in train.bin")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--reference-positions", default="0,10000,100000,1000000",
                   help="positions at which the replayed generator form is measured (once each)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_data(folder, args.tokens)
        result: dict[str, Any] = {"tokens": args.tokens, "micro_batch": args.micro_batch, "load_before": load}
        first_batch_s(folder, 0, args.micro_batch, True)  # warm-up: the first call pays one-off imports
        times: dict[int, list[float]] = {0: [], 10**6: []}
        for _ in range(args.repeats):  # interleaved, so a change in the machine's load hits both alike
            for position, seen in times.items():
                seen.append(first_batch_s(folder, position, args.micro_batch, True))
        for position, seen in times.items():
            result[f"start_{position}_s"] = statistics.median(seen)
        result["ratio_1e6_over_0"] = result[f"start_{10**6}_s"] / result["start_0_s"]
        print(f"data position, ravq.tasks.text on {args.tokens:,} tokens (memmap), micro-batch {args.micro_batch}")
        print(f"  start=N (issue #41)   first batch at 0: {result['start_0_s'] * 1e3:8.2f} ms   "
              f"at 10^6: {result[f'start_{10**6}_s'] * 1e3:8.2f} ms   ratio {result['ratio_1e6_over_0']:.2f}")
        replay = {}
        for position in (int(x) for x in args.reference_positions.split(",") if x):
            replay[position] = first_batch_s(folder, position, args.micro_batch, False)
            print(f"  generator form, replayed to {position:>9,}: {replay[position]:10.3f} s"
                  f"   ({replay[position] / result[f'start_{10**6}_s']:,.0f}x start=10^6)", flush=True)
        result["replay_s"] = replay
    result["load_after"] = os.getloadavg()
    print(f"  load average before {load[0]:.2f}, after {result['load_after'][0]:.2f}")
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    sys.exit(main())
