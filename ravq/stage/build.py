"""Build one node's stage from the task and the plan, and save or resume it from its checkpoint.

``build_stage`` traces the task's model on the ``meta`` device (``ravq.cut.meta``), gives only this
node's stage real weights (``ravq.cut.materialize``: the same values whatever the cut, or a pretrained
checkpoint's, read tensor by tensor) and wraps it in a ``StageWorker`` with the topology's training
settings; stage 0 also gets its cluster's shard of the data.  No node ever holds more of the model than
its stage.
``resume`` loads the newest checkpoint of the stage (``ravq.persist.checkpoint``), if any, with its
optimizer state, version and data position; ``save`` writes one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ravq.codec.compress import Format
from ravq.config import TrainingConfig
from ravq.config.batch import default_inflight, for_clusters
from ravq.cut.materialize import materialize
from ravq.cut.meta import build_meta_model, example_args, retarget_device
from ravq.cut.split import StageSpec, build_task_model, split_model, stage_input_specs
from ravq.cut.split_cache import cache_dir, cached_stages
from ravq.metrics import Metrics
from ravq.persist import checkpoint
from ravq.stage import evaluate
from ravq.stage.feed import DataSource
from ravq.stage.frames import largest_inbound_frame
from ravq.stage.pipeline import StageWorker
from ravq.stage.recipe import recipe_options
from ravq.stage.tensors import model_input_needs
from ravq.stage.tied_hold import tied_meta
from ravq.stage.types import StageOptions

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class BuiltStage:
    worker: StageWorker
    model: torch.nn.Module
    """The whole model this stage was cut from, on ``meta`` (the averager reads its names and order)."""
    stage_names: list[list[str]]
    """Every stage's state_dict names, in stage order."""
    largest_frame: int
    """The largest tensor frame this stage can legitimately receive, in bytes."""


def build_stage(task: Any, training: TrainingConfig, *, seed: int, cuts: list[int], stage: int, cluster: int,
                clusters: int, device: str, metrics: Metrics) -> BuiltStage:
    training = for_clusters(training, clusters)  # update_every from training.batch and the plan's clusters
    example = example_args(task, training.micro_batch)
    model, specs, in_specs = _traced(task, seed, example, cuts, stage, device,
                                     cache_dir(training.checkpoint_dir), training.init_from)
    inflight = training.max_inflight or default_inflight(len(specs), training.update_every)
    options = StageOptions(steps=training.steps, max_inflight=inflight,
                           update_every=training.update_every, micro_batch=training.micro_batch,
                           predict_weights=training.predict_weights,
                           extrapolate_gradients=training.extrapolate_gradients,
                           stale_correction=training.stale_correction,
                           inflight_warmup_steps=training.inflight_warmup_steps,
                           synchronous=training.schedule in ("sync", "zero_bubble"),
                           split_backward=training.schedule == "zero_bubble",
                           compress=Format(training.compress.pipeline),
                           int8_block=training.compress.int8_block,
                           recipe=recipe_options(task, training, seed))
    batches = DataSource(train_batches=task.train_batches, micro_batch=training.micro_batch, shard=cluster,
                         num_shards=clusters, seed=seed) if stage == 0 else None
    _, target_example = next(iter(task.train_batches(training.micro_batch, 0, 1, seed)))
    worker = StageWorker(specs[stage], len(specs), task.make_optimizer, task.loss_fn, options,
                         device=device, batches=batches, cluster=cluster, metrics=metrics,
                         model_input_needs=model_input_needs(specs), input_specs=in_specs[stage],
                         target_example=target_example)
    if training.eval_every:  # an eval-mode graph of this stage, sharing its weights (ravq.stage.evaluate)
        eval_module = evaluate.eval_stage_module(task, seed, example, cuts, stage, worker.module)
        worker.recipe.evaluator.attach(eval_module)
    stage_names = [list(s.module.state_dict().keys()) for s in specs]
    return BuiltStage(worker=worker, model=model, stage_names=stage_names,
                      largest_frame=largest_inbound_frame(specs, in_specs, stage, target_example))


def _traced(task: Any, seed: int, example: tuple[Any, ...], cuts: list[str], stage: int, device: str,
            split_cache: Path | None, init_from: str | None = None
            ) -> tuple[torch.nn.Module, list[StageSpec], list[list[Any]]]:
    """The model on meta, its stages and their input shapes, with this stage's weights made real (read from
    ``init_from`` where it holds them).  A model that cannot be traced on meta is traced with real weights
    (the same values), at the whole model's cost.  The meta split is read from ``split_cache`` when it holds
    it (``ravq.cut.split_cache``)."""
    try:
        model = build_meta_model(task, seed).model
        t0 = time.monotonic()
        specs, in_specs = cached_stages(model, example, cuts, split_cache)
        log.info("stage %d: split in %.2fs", stage, time.monotonic() - t0)
    except Exception as err:  # user code: the real trace says what is wrong, if anything is
        log.warning("the model cannot be traced on the meta device (%s: %s); tracing it with real weights, "
                    "which needs the whole model in memory", type(err).__name__, str(err)[:300])
        if init_from:
            raise ValueError(f"training.init_from ({init_from}) needs a model that can be built on the meta "
                             "device; this one cannot (see the warning above)") from err
        model = build_task_model(task, seed)
        specs = split_model(model, example, cuts)
        retarget_device(specs[stage].module, "cpu", device)
        return model, specs, stage_input_specs(specs, example)
    t0 = time.monotonic()
    report = materialize(specs[stage].module, task, seed, pretrained=init_from)
    retarget_device(specs[stage].module, "meta", device)
    origin = init_from or "the pretrained checkpoint"
    source = f" ({len(report.loaded)} from {origin})" if report.loaded else ""
    log.info("stage %d: %d tensors made real in %.1fs%s", stage, report.names, time.monotonic() - t0, source)
    return model, specs, in_specs


def resume(worker: StageWorker, root: str, *, cluster: int, stage: int, update_every: int, name: str,
           run_id: str | None = None, version: int | None = None) -> str | None:
    """Load the stage's newest checkpoint (of ``run_id``, at ``version``, when given) into ``worker``; the
    run id it belongs to, or None if none."""
    try:
        ckpt = checkpoint.load_stage(root, cluster, stage, run_id, version)
    except (FileNotFoundError, ValueError) as err:
        log.info("%s: no checkpoint to resume from (%s); starting from the seed", name, err)
        return None
    worker.module.load_state_dict(ckpt.model)
    names = checkpoint.optimizer_names(worker.optimizer, worker.params)
    checkpoint.restore_optimizer(worker.optimizer, names, ckpt.optimizer["tensors"], ckpt.optimizer["rest"])
    version = ckpt.meta["version"]
    # count the micro-batches already trained towards training.steps
    worker.restore(version=version, trained=ckpt.meta.get("trained", version * update_every),
                   data_position=ckpt.meta["data_position"])
    run_id = ckpt.meta.get("run_id")
    log.info("%s: resumed at version %d (run %s)", name, worker.version, run_id)
    return run_id if isinstance(run_id, str) else None


def save(worker: StageWorker, root: str, *, cluster: int, stage: int, node: str, run_id: str | None,
         cluster_nodes: list[str], extra: dict[str, Any] | None = None) -> None:
    """Write this stage's checkpoint (in the compute thread, or after it ended)."""
    first = worker.is_first
    checkpoint.save_stage(root, cluster=cluster, stage=stage, num_stages=worker.num_stages, node=node,
                          module=worker.module, optimizer=worker.optimizer, version=worker.version,
                          data_position=worker.trained_prefix if first else 0, run_id=run_id,
                          cluster_nodes=cluster_nodes,
                          extra={"trained": worker.trained_prefix if first else worker.trained,
                                 "tied": tied_meta(worker.tied), **(extra or {})})
