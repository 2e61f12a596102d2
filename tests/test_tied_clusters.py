"""Tied weights across stages and clusters with real node processes (issue #23 part 3): T5 (four names tied)
as 2 clusters x 2 stages trains like one process, and every tied copy ends bit-identical, also under
overlapped averaging.  GPT-2's tie across clusters is in test_hf_models (2 stages beside 3); BERT's tied
bias, and all three in sync with one process, run in one process in test_tied."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline_harness import train_one_process
from tests.swarm import assert_clusters_equal, local_topology, tied_copies_identical, train

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (pip install transformers)")]


def _train(tmp_path: Path, kind: str, training: dict[str, Any]) -> Path:
    ckpt = tmp_path / "ckpt"
    train(tmp_path, local_topology(f"tests.zoo_hf:{kind}", [2, 2], {**training, "checkpoint_dir": str(ckpt)},
                                   timeouts={"connect_s": 240}))
    return ckpt


def test_tied_two_by_two_sync_equals_one_process(tmp_path: Path) -> None:
    """T5, max_inflight 1, averaging every step: each cluster's export equals one process training on both
    clusters' micro-batches (1e-5), the tie's names included, and the stages' copies are bit-identical."""
    from tests import zoo_hf

    steps = 5
    ckpt = _train(tmp_path, "t5", {"steps": steps, "micro_batch": 4, "max_inflight": 1, "sync_every": 1,
                                   "overlap_averaging": False})
    for cluster in (0, 1):
        tied_copies_identical(ckpt, cluster)
    want = train_one_process(zoo_hf.t5, steps=steps, micro_batch=4, shards=2)
    assert_clusters_equal(ckpt, 2, want, tmp_path)


def test_tied_copies_identical_after_overlapped_averaging(tmp_path: Path) -> None:
    """GPT-2, max_inflight 2, overlapped averaging every step with the optimizer state: the averaging deltas
    of the tied weight reach both copies in step order, so each cluster's copies end bit-identical."""
    ckpt = _train(tmp_path, "gpt2", {"steps": 16, "micro_batch": 4, "max_inflight": 2, "sync_every": 1,
                                     "inflight_warmup_steps": 0, "overlap_averaging": True,
                                     "average_optimizer_state": True})
    for cluster in (0, 1):
        tied_copies_identical(ckpt, cluster)
