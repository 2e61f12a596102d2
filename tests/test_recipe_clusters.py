"""The recipe on real node processes: one cluster of three stages and two clusters of two, bf16 autocast, a cosine schedule with
warmup and clipping that binds, against one process (docs/training.md)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ravq.config import TrainingConfig
from ravq.cut.split import build_task_model
from ravq.stage.recipe import recipe_options
from tests import models_for_tests as skipnet
from tests import recipe_tasks
from tests.recipe_reference import train_one_process_recipe
from tests.swarm import assert_clusters_equal, export, local_topology, train

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("clusters", [[3], [2, 2]], ids=["1x3", "2x2"])
def test_bf16_cosine_clipped_sync_equals_one_process(tmp_path: Path, clusters: list[int]) -> None:
    """max_inflight 1, sync_every 1, no compression: each cluster ends with the weights of one process that
    clips each shard's gradient (each cluster clips its own step by its own global norm), averages them,
    and steps SGD with momentum under the same LambdaLR and bf16 autocast (one cluster: plain clip_grad_norm_).  Tolerance 1e-5: autocast sees
    the same float32 weights on both sides (averaging every step keeps the clusters equal), so bf16 only
    repeats one process's roundings; what differs is float32 summation order (ring average, per-stage norms)."""
    ckpt = tmp_path / "ckpt"
    steps = 12
    training = {"steps": steps, "micro_batch": 4, "max_inflight": 1, "sync_every": 1, "overlap_averaging": False,
                "checkpoint_dir": str(ckpt), "precision": "bf16", "clip_grad_norm": 0.5,
                "lr_schedule": {"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}}
    train(tmp_path, local_topology("tests.models_for_tests", clusters, training), timeout_s=180)
    recipe = recipe_options(skipnet, TrainingConfig.model_validate(training))
    want = train_one_process_recipe(skipnet, recipe, steps=steps, shards=len(clusters))
    unclipped = train_one_process_recipe(skipnet, recipe_options(skipnet, TrainingConfig.model_validate(
        {**training, "clip_grad_norm": None})), steps=steps, shards=len(clusters))
    assert max((want[n] - unclipped[n]).abs().max().item() for n in want) > 1e-3  # clipping binds
    assert_clusters_equal(ckpt, len(clusters), want, tmp_path, same_names=False)


def test_swarm_eval_loss_equals_the_exported_model_in_one_process(tmp_path: Path) -> None:
    """Dropout and BatchNorm on 3 node processes, fp32, sync mode: the validation loss the last stage reports
    for the final step equals the exported model's, evaluated in eval mode in one process (1e-5)."""
    ckpt = tmp_path / "ckpt"
    training = {"steps": 12, "micro_batch": 4, "max_inflight": 1, "checkpoint_dir": str(ckpt), "eval_every": 6,
                "eval_batches": 3}
    swarm = train(tmp_path, local_topology("tests.recipe_tasks:dropout_bn", [3], training), timeout_s=180)
    last = swarm.summary("c0s2")
    assert [step for step, _ in last["eval_history"]] == [6, 12]
    task = recipe_tasks.dropout_bn
    model = build_task_model(task, 0)
    model.load_state_dict(export(ckpt, 0, tmp_path / "c0.safetensors"))
    model.eval()
    with torch.no_grad():
        losses = [float(task.loss_fn(model(*x), y)) for x, y in itertools.islice(task.eval_batches(4, 0), 3)]
    assert last["eval_loss"] == pytest.approx(sum(losses) / 3, abs=1e-5)
    assert 0.0 <= last["eval_metrics"]["accuracy"] <= 1.0
