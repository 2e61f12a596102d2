"""Tied weights across stages and clusters with real node processes (issue #23 part 3): GPT-2, T5 and BERT MLM
as 2 clusters x 2 stages train like one process, and every tied copy ends bit-identical."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ravq.stage import checkpoint
from tests.pipeline_harness import train_one_process
from tests.swarm import ROOT, Swarm, local_topology

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (pip install transformers)")]


def _train(tmp_path: Path, kind: str, training: dict[str, Any]) -> Path:
    ckpt = tmp_path / "ckpt"
    swarm = Swarm(tmp_path, local_topology(f"tests.zoo_hf:{kind}", [2, 2], {**training, "checkpoint_dir": str(ckpt)},
                                           timeouts={"connect_s": 240}))
    try:
        codes = swarm.wait(timeout_s=280)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    finally:
        swarm.close()
    return ckpt


def _tied_copies_identical(ckpt: Path, cluster: int) -> None:
    """Each stage's checkpoint holds its copy under the names it reads; all copies of a tie are one value."""
    stages = [checkpoint.load_stage(ckpt, cluster, s) for s in (0, 1)]
    for s, ck in enumerate(stages):
        assert ck.meta["tied"], f"cluster {cluster} stage {s} holds no tied copy"
    first = stages[0].model[stages[0].meta["tied"][0]["names"][0]]
    for s, ck in enumerate(stages):
        for group in ck.meta["tied"]:
            for name in group["names"]:
                assert torch.equal(ck.model[name], first), f"cluster {cluster} stage {s} {name}"


def _export(ckpt: Path, out: Path, cluster: int) -> dict[str, torch.Tensor]:
    proc = subprocess.run([sys.executable, "-m", "ravq", "export", "--checkpoint-dir", str(ckpt), "--out", str(out),
                           "--cluster", str(cluster)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return load_file(str(out))


@pytest.mark.parametrize("kind", ["gpt2", "t5", "bert"])
def test_tied_two_by_two_sync_equals_one_process(tmp_path: Path, kind: str) -> None:
    """max_inflight 1, averaging every step: each cluster's export equals one process training on both
    clusters' micro-batches (1e-5), the tie's names included, and the stages' copies are bit-identical."""
    from tests import zoo_hf

    steps = 5
    ckpt = _train(tmp_path, kind, {"steps": steps, "micro_batch": 4, "max_inflight": 1, "sync_every": 1,
                                   "overlap_averaging": False})
    want = train_one_process(getattr(zoo_hf, kind), steps=steps, micro_batch=4, shards=2)
    for cluster in (0, 1):
        _tied_copies_identical(ckpt, cluster)
        got = _export(ckpt, tmp_path / f"c{cluster}.safetensors", cluster)
        assert set(got) == set(want), set(got) ^ set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=f"cluster {cluster} {name}")


def test_tied_copies_identical_after_overlapped_averaging(tmp_path: Path) -> None:
    """GPT-2, max_inflight 2, overlapped averaging every step with the optimizer state: the averaging deltas
    of the tied weight reach both copies in step order, so each cluster's copies end bit-identical."""
    ckpt = _train(tmp_path, "gpt2", {"steps": 16, "micro_batch": 4, "max_inflight": 2, "sync_every": 1,
                                     "overlap_averaging": True, "average_optimizer_state": True})
    for cluster in (0, 1):
        _tied_copies_identical(ckpt, cluster)
