"""BatchNorm and rotary models across clusters: real node processes, averaging weights and running statistics."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ravq.cut.split import build_task_model
from tests import zoo
from tests.swarm import ROOT, Swarm, assert_clusters_equal, local_topology, train

pytestmark = pytest.mark.multiprocess


def _run(tmp_path: Path, task: str, clusters: list[int], training: dict[str, Any]) -> Swarm:
    return train(tmp_path, local_topology(task, clusters, training), timeout_s=180)


def _data_parallel_reference(task: Any, steps: int, micro_batch: int, shards: int) -> dict[str, torch.Tensor]:
    """One process doing what synchronous data parallelism with averaged buffers does: each step, every
    shard's forward starts from the same running statistics, the step uses the mean of the shards'
    losses, and the running statistics become the mean of what each shard's forward made of them."""
    model = build_task_model(task, 0)
    opt = task.make_optimizer(model.parameters())
    streams = [task.train_batches(micro_batch, s, shards, 0) for s in range(shards)]
    floating = [n for n, b in model.named_buffers() if b.is_floating_point()]

    def put(name: str, value: torch.Tensor) -> None:  # new storage: the forwards' saved tensors stay intact
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, value)

    for step in range(steps):
        opt.zero_grad()
        start = {n: model.get_buffer(n).clone() for n in floating}
        losses, moved = [], []
        for stream in streams:
            for n in floating:
                put(n, start[n].clone())
            inputs, targets = next(stream)
            losses.append(task.loss_fn(model(*inputs), targets))
            moved.append({n: model.get_buffer(n) for n in floating})
        torch.stack(losses).mean().backward()
        opt.step()
        for n in floating:
            put(n, torch.stack([m[n] for m in moved]).mean(0))
        for n, b in model.named_buffers():
            if not b.is_floating_point():  # every cluster counts its own batches: one per step
                b.fill_(step + 1)
    return model.state_dict()


def test_batchnorm_two_uneven_clusters_sync_equal_one_process(tmp_path: Path) -> None:
    """2 stages beside 3, max_inflight 1, sync_every 1: each cluster ends with the weights AND running
    statistics of the data-parallel reference (1e-5)."""
    ckpt = tmp_path / "ckpt"
    steps = 12
    training = {"steps": steps, "micro_batch": 8, "max_inflight": 1, "sync_every": 1, "overlap_averaging": False,
                "checkpoint_dir": str(ckpt)}
    _run(tmp_path, "tests.zoo:batchnorm", [2, 3], training)
    want = _data_parallel_reference(zoo.batchnorm, steps, 8, 2)
    assert (want["bn1.running_mean"] - build_task_model(zoo.batchnorm, 0).state_dict()["bn1.running_mean"]
            ).abs().max() > 0.1  # the statistics really moved
    assert_clusters_equal(ckpt, 2, want, tmp_path)


@pytest.mark.parametrize("task", ["tests.zoo:batchnorm", "tests.zoo:rotary"])
def test_overlapped_averaging_with_micro_batches_in_flight_trains(tmp_path: Path, task: str) -> None:
    """BatchNorm (its running statistics are averaged while forwards that saved them are in flight) and a
    rotary model (non-persistent inv_freq, not averaged): 2 clusters x 2 stages, max_inflight 2,
    overlapped averaging every step.  Before buffers got fresh storage, BatchNorm's backward failed with
    "modified by an inplace operation"."""
    training = {"steps": 40, "micro_batch": 8, "max_inflight": 2, "inflight_warmup_steps": 0, "sync_every": 1,
                "overlap_averaging": True}
    swarm = _run(tmp_path, task, [2, 2], training)
    for name in swarm.nodes:
        s = swarm.summary(name)
        assert s["backwards"] == 40 and s["allreduce_rounds"] > 0, (name, s)
    last = swarm.summary("c0s1")
    assert last["loss_recent"] < last["loss_initial"], last


def test_demo_reports_a_plan_error_from_the_broker(tmp_path: Path) -> None:
    """4 stages of a model offering 2 cut points: the broker refuses the plan and exits; the demo says
    why (the broker's own error), rather than leaving the nodes to time out waiting for it."""
    proc = subprocess.run([sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--task", "tests.zoo:tied",
                           "--clusters", "1", "--stages", "4", "--steps", "5", "--run-dir", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ravq demo: broker failed:" in proc.stderr and "4 stages need 3 cut point(s) and the model offers 2" in proc.stderr, proc.stderr
    assert "give the task a split_points()" in proc.stderr, proc.stderr  # how to get more
    assert "no answer from the broker" not in proc.stderr, proc.stderr


def test_demo_reports_why_a_node_cannot_split_the_model(tmp_path: Path) -> None:
    """A model returning a cache object: the node's one-line error says what it is and what to do, and the
    demo shows it (torch's tracer would only say it "cannot capture your model as a full graph")."""
    proc = subprocess.run([sys.executable, "-m", "ravq", "demo", "--quiet", "--no-curve", "--task", "tests.zoo:cached",
                           "--clusters", "1", "--stages", "2", "--steps", "5", "--run-dir", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"ravq demo: c0s[01] failed: ravq node: ", proc.stderr), proc.stderr  # whichever failed first
    assert "output['past_key_values'] is a KeyValueCache" in proc.stderr and "use_cache=False" in proc.stderr, proc.stderr
