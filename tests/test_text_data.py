"""Data with a position (issue #41): a task's ``train_batches(..., start=k)`` opens its data at micro-batch k;
stage 0's feed passes a checkpoint's position instead of replaying; ``ravq.tasks.text`` reads a user's
tokenized files (memmap), .txt/.jsonl folders (a local tokenizer or bytes), shards and holds out."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from ravq.config import ConfigError, resolve_task_module
from ravq.stage.feed import DataFeed, DataSource, takes_start
from ravq.tasks.text import EXAMPLE, configure
from ravq.tasks.text.tokens import BYTE_EOS, load_corpus, tokenize_folder
from ravq.tasks.text.windows import Windows


class Counting:
    """A task's data: batch k is (k, k); counts what it made and where it was opened."""

    def __init__(self) -> None:
        self.made, self.opened_at = 0, []

    def _from(self, start: int) -> Iterator[tuple[int, int]]:
        for k in itertools.count(start):
            self.made += 1
            yield k, k

    def positional(self, micro_batch: int, shard: int, num_shards: int, seed: int,
                   start: int = 0) -> Iterator[tuple[int, int]]:
        self.opened_at.append(start)
        return self._from(start)

    def generator(self, micro_batch: int, shard: int, num_shards: int, seed: int) -> Iterator[tuple[int, int]]:
        self.opened_at.append(0)
        return self._from(0)


def _feed(fn: object) -> DataFeed:
    return DataFeed(DataSource(train_batches=fn, micro_batch=4, shard=0, num_shards=1, seed=0))  # type: ignore[arg-type]


def test_takes_start_reads_the_signature() -> None:
    data = Counting()
    assert takes_start(data.positional) and not takes_start(data.generator)
    assert takes_start(configure().train_batches) and not takes_start(len)
    assert not takes_start(resolve_task_module("ravq.tasks.charlm").train_batches)


def test_a_positional_task_is_opened_at_the_checkpoint_position_without_reading_before() -> None:
    data = Counting()
    feed = _feed(data.positional)
    feed.skip_to(10**6)
    assert data.opened_at == []  # opened when the first batch is taken, at the position
    assert feed.take() == (10**6, (10**6, 10**6))
    assert feed.take()[0] == 10**6 + 1
    assert data.opened_at == [10**6] and data.made == 2


def test_the_generator_form_is_replayed_to_its_position() -> None:
    data = Counting()
    feed = _feed(data.generator)
    feed.skip_to(7)
    assert feed.take() == (7, (7, 7))
    assert data.made == 8 and data.opened_at == [0]


def test_a_fresh_positional_feed_starts_at_zero_and_requeues_as_before() -> None:
    data = Counting()
    feed = _feed(data.positional)
    taken = [feed.take() for _ in range(3)]
    assert [i for i, _ in taken] == [0, 1, 2] and data.opened_at == [0]


def _windows(tokens: np.ndarray, lo: int, hi: int, context: int = 4) -> Windows:
    return Windows(tokens, lo=lo, hi=hi, context=context, vocab_size=1 << 16, key=(3, 0, 1))


def test_batch_k_is_the_kth_batch_from_the_start_across_epochs() -> None:
    tokens = np.arange(203, dtype=np.uint16)
    w = _windows(tokens, 0, 203)
    assert w.count == 50
    ahead = list(itertools.islice(w.batches(3), 60))  # 180 samples: three epochs and some
    for k in (0, 1, 16, 17, 33, 59):  # 16 and 33 straddle an epoch boundary
        (x, ), y = next(_windows(tokens, 0, 203).batches(3, start=k))
        assert torch.equal(x, ahead[k][0][0]) and torch.equal(y, ahead[k][1])
    x, y = ahead[0][0][0], ahead[0][1]
    assert x.dtype == torch.int64 and x.shape == (3, 4) and torch.equal(y[:, :-1], x[:, 1:])


def test_every_window_once_per_epoch_in_a_new_order() -> None:
    w = _windows(np.arange(203, dtype=np.uint16), 0, 203)
    epochs = [[w.start_of(e * w.count + j) for j in range(w.count)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == [4 * j for j in range(50)]
    assert epochs[0] != epochs[1]


def test_each_cluster_reads_its_own_slice() -> None:
    task = configure(data=str(EXAMPLE), context=16)
    train = task.corpus.train
    span = len(train) // 3
    for shard in range(3):
        w = task.shard(shard, 3, seed=0)
        starts = [w.start_of(i) for i in range(2 * w.count)]
        assert min(starts) >= shard * span and max(starts) + 17 <= (shard + 1) * span
    one = next(task.train_batches(2, 0, 3, 0))[1]
    other = next(task.train_batches(2, 1, 3, 0))[1]
    assert not torch.equal(one, other)


def test_nanogpt_folder_is_memory_mapped_with_its_held_out_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rng.integers(0, 1000, 5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 1000, 600, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_bytes(orjson.dumps({"vocab_size": 1000}))
    task = configure(data=str(tmp_path), context=8, hidden=16, layers=2, heads=2)
    assert isinstance(task.corpus.train, np.memmap) and len(task.corpus.train) == 5000
    assert task.vocab_size == task.corpus.vocab_size == 1000 and len(task.corpus.held_out) == 600
    (x, ), y = next(task.train_batches(4, 0, 1, 0))
    assert x.shape == (4, 8) and int(x.max()) < 1000
    held = list(task.eval_batches(4, 0))
    assert len(held) == (599 // 8) // 4
    assert torch.equal(held[0][0][0][0], torch.from_numpy(np.fromfile(tmp_path / "val.bin", np.uint16)[:8].astype(np.int64)))
    logits = task.build_model()(x).logits
    assert logits.shape == (4, 8, 1000)


def test_one_bin_or_npy_file_holds_out_its_end(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 97
    tokens.tofile(tmp_path / "tokens.bin")
    np.save(tmp_path / "tokens.npy", tokens.astype(np.int32))
    for name in ("tokens.bin", "tokens.npy"):
        corpus = load_corpus(tmp_path / name, tokenizer=None, held_out=0.1, vocab_size=97, dtype=None,
                             text_field="text")
        assert len(corpus.train) == 900 and np.array_equal(corpus.held_out, tokens[900:])
    np.save(tmp_path / "bad.npy", np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="not 1-D integer"):
        load_corpus(tmp_path / "bad.npy", tokenizer=None, held_out=0.1, vocab_size=97, dtype=None,
                    text_field="text")


def test_a_token_beyond_the_vocabulary_is_named() -> None:
    w = Windows(np.full(100, 300, dtype=np.uint16), lo=0, hi=100, context=4, vocab_size=257, key=(0,))
    with pytest.raises(ValueError, match="token id 300 .* vocab_size 257"):
        w.batch(0, 2)


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("zwei drei", encoding="utf-8")
    (folder / "sub" / "c.jsonl").write_bytes(b'{"text": "vier"}\n\n{"text": "f\xc3\xbcnf", "id": 2}\n')
    (folder / "a.txt").write_text("eins", encoding="utf-8")
    (folder / "ignored.md").write_text("not data", encoding="utf-8")
    return folder


def test_a_folder_of_txt_and_jsonl_as_bytes(tmp_path: Path) -> None:
    ids, vocab = tokenize_folder(_folder(tmp_path), tokenizer=None)
    want = b"".join(d + bytes([0]) for d in (b"eins", b"zwei drei", b"vier", "fünf".encode()))
    expected = np.frombuffer(want, dtype=np.uint8).astype(np.uint16)
    expected[expected == 0] = BYTE_EOS
    assert vocab == 257 and np.array_equal(ids, expected)
    task = configure(data=str(tmp_path / "docs"), held_out=0.5)
    assert task.vocab_size == 257 and "corpus" not in vars(task)  # known without reading the data


def test_a_jsonl_line_without_the_field_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "sub" / "c.jsonl").write_bytes(b'{"text": "vier"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2 has no string field 'text'"):
        tokenize_folder(folder, tokenizer=None)
    (folder / "sub" / "c.jsonl").write_bytes(b'{"body": "x"}\n')
    ids, _ = tokenize_folder(folder, tokenizer=None, text_field="body")
    assert bytes(ids[ids != BYTE_EOS].astype(np.uint8)).endswith(b"zwei dreix")


def test_a_folder_tokenized_by_a_local_tokenizer_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["eins zwei drei vier fünf"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="<eos>").save_pretrained(tmp_path / "tok")
    ids, vocab = tokenize_folder(_folder(tmp_path), tokenizer=tmp_path / "tok")
    vocab_of = words.get_vocab()
    eos = vocab_of["<eos>"]
    want = [vocab_of["eins"], eos, vocab_of["zwei"], vocab_of["drei"], eos, vocab_of["vier"], eos, vocab_of["fünf"], eos]
    assert vocab == 7 and ids.tolist() == want
    task = configure(data=str(tmp_path / "docs"), tokenizer=str(tmp_path / "tok"), held_out=0.5)
    assert task.vocab_size == task.corpus.vocab_size == 7


def test_task_options_configure_the_task(tmp_path: Path) -> None:
    np.arange(4000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    task = resolve_task_module("ravq.tasks.text", {"data": str(tmp_path / "t.bin"), "vocab_size": 4000,
                                                   "context": 8})
    assert task.corpus.vocab_size == 4000 and task.example_inputs(2)[0].shape == (2, 8)
    with pytest.raises(ConfigError, match="task_options: .*unexpected keyword argument 'colour'"):
        resolve_task_module("ravq.tasks.text", {"colour": "blue"})
    with pytest.raises(ConfigError, match="task_options: data: .*nowhere does not exist"):
        resolve_task_module("ravq.tasks.text", {"data": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="takes no options"):
        resolve_task_module("ravq.tasks.charlm", {"data": "x"})


def test_a_stage_resumed_past_evaluation_rounds_does_not_owe_them() -> None:
    """A stage resumed at version 10 with eval_every 5 ran no round at 5 or 10 (the process that wrote the
    checkpoint did): before, it counted them owed and never finished (found with the text task's kill -9)."""
    import threading

    from ravq.config import TrainingConfig
    from ravq.metrics import Metrics
    from ravq.stage.build import build_stage
    from ravq.tasks import charlm

    training = TrainingConfig(micro_batch=2, steps=12, eval_every=5, eval_batches=1)
    worker = build_stage(charlm, training, seed=0, cuts=[], stage=0, cluster=0, clusters=1, device="cpu",
                         metrics=Metrics("resumed")).worker
    worker.restore(version=10, trained=10, data_position=10)
    assert not worker.recipe.unfinished()
    run = threading.Thread(target=worker.run, args=(lambda out: None,), daemon=True)
    run.start()
    run.join(timeout=120)  # a deadline for a hang, not a measurement
    assert not run.is_alive() and worker.trained_prefix == 12 and worker.version == 12


def test_prepare_writes_what_training_on_the_folder_reads(tmp_path: Path) -> None:
    from ravq.tasks.text.prepare import prepare

    counts = prepare(_folder(tmp_path), tmp_path / "out", tokenizer=None, held_out=0.25, text_field="text")
    direct = configure(data=str(tmp_path / "docs"), held_out=0.25).corpus
    prepared = configure(data=str(tmp_path / "out")).corpus
    assert isinstance(prepared.train, np.memmap) and prepared.vocab_size == direct.vocab_size == 257
    assert np.array_equal(prepared.train, direct.train) and np.array_equal(prepared.held_out, direct.held_out)
    assert counts == {"train": len(direct.train), "val": len(direct.held_out)}


def test_demo_task_options_are_yaml_scalars() -> None:
    import argparse

    from ravq.cli.demo import add_demo_arguments, task_options

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    args = parser.parse_args(["--task", "ravq.tasks.text", "--task-option", "data=x/y", "--task-option",
                              "context=32", "--task-option", "held_out=0.1"])
    assert task_options(args) == {"data": "x/y", "context": 32, "held_out": 0.1}
    with pytest.raises(ConfigError, match="'novalue' is not KEY=VALUE"):
        task_options(parser.parse_args(["--task-option", "novalue"]))


def test_a_topology_names_the_data_in_task_options(tmp_path: Path) -> None:
    from ravq.config import parse_topology

    np.arange(4000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    topo = {"task": "ravq.tasks.text", "task_options": {"data": str(tmp_path / "t.bin"), "vocab_size": 4000},
            "broker": {"pub_port": 5550, "router_port": 5551},
            "nodes": [{"name": "a", "pipeline_port": 5600, "ring_port": 5601}]}
    assert parse_topology(topo).task_options == {"data": str(tmp_path / "t.bin"), "vocab_size": 4000}
    topo["task_options"]["dtype"] = "float32"
    with pytest.raises(ConfigError, match="task: task_options: dtype: 'float32' is not uint16"):
        parse_topology(topo)
