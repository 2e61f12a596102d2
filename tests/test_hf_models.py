"""Hugging Face GPT-2 and Llama (tiny configs, random weights) split into stages and clusters, written the
obvious way (``ravq.tasks.hf_causal_lm``): they train exactly like one process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process
from tests.swarm import assert_clusters_equal, local_topology, tied_copies_identical, train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install transformers)")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_one_cluster_sync_equals_one_process(kind: str) -> None:
    """3 stages, max_inflight 1: weights equal one process's; loss_fn reads ``.logits`` of the ModelOutput."""
    from tests import zoo_hf

    task = getattr(zoo_hf, kind)
    workers = make_workers(task, 3, steps=4, max_inflight=1)
    run_workers(workers, timeout_s=120)
    want = train_one_process(task, steps=4)
    got = merged_state(workers)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_two_clusters_sync_equal_one_process(tmp_path: Path, kind: str) -> None:
    """2 stages beside 3, averaging every step: each cluster ends with the weights of one process training
    on both clusters' micro-batches."""
    from tests import zoo_hf

    ckpt = tmp_path / "ckpt"
    steps = 5
    training = {"steps": steps, "micro_batch": 4, "max_inflight": 1, "sync_every": 1, "overlap_averaging": False,
                "checkpoint_dir": str(ckpt)}
    train(tmp_path, local_topology(f"tests.zoo_hf:{kind}", [2, 3], training, timeouts={"connect_s": 240}))
    if kind == "gpt2":  # its head is tied to the embedding: the first and last stage hold a copy each
        tied_copies_identical(ckpt, 0, (0, 1))
        tied_copies_identical(ckpt, 1, (0, 2))
    want = train_one_process(getattr(zoo_hf, kind), steps=steps, micro_batch=4, shards=2)
    assert_clusters_equal(ckpt, 2, want, tmp_path)
