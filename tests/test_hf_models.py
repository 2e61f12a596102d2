"""Hugging Face GPT-2 and Llama (tiny configs, random weights) split into stages and clusters, written the
obvious way (``ravq.tasks.hf_causal_lm``): they train exactly like one process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process
from tests.swarm import ROOT, Swarm, local_topology

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
    swarm = Swarm(tmp_path, local_topology(f"tests.zoo_hf:{kind}", [2, 3], training, timeouts={"connect_s": 240}))
    try:
        codes = swarm.wait(timeout_s=280)
        assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    finally:
        swarm.close()
    want = train_one_process(getattr(zoo_hf, kind), steps=steps, micro_batch=4, shards=2)
    for cluster in (0, 1):
        out = tmp_path / f"c{cluster}.safetensors"
        proc = subprocess.run([sys.executable, "-m", "ravq", "export", "--checkpoint-dir", str(ckpt), "--out",
                               str(out), "--cluster", str(cluster)], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        got = load_file(str(out))
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=f"cluster {cluster} {name}")
