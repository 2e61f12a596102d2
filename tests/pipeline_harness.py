"""Runs one cluster's StageWorkers in threads, joined by in-memory delivery instead of sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import orjson
import torch

from ravq.codec.compress import Format, Packed
from ravq.cut.split import build_task_model, candidate_cuts, even_cuts, split_model, stage_input_specs
from ravq.net.wire import Message, MsgType, decode, encode
from ravq.stage.evaluate import eval_stage_module
from ravq.stage.pipeline import StageWorker
from ravq.stage.recipe import build_optimizer
from ravq.stage.tensors import model_input_needs
from ravq.stage.types import Outbound, RecipeOptions, StageOptions


def make_workers(task: ModuleType, stages: int, *, steps: int, max_inflight: int, micro_batch: int = 4,
                 seed: int = 0, update_every: int = 1, cluster: int = 0,
                 num_clusters: int = 1, predict_weights: float = 0.0, extrapolate_gradients: float = 0.0,
                 inflight_warmup_steps: int = 0, compress: Format = Format.NONE, recipe: RecipeOptions | None = None,
                 clocks: list[Callable[[], float]] | None = None, stale_correction: str = "none",
                 synchronous: bool = False, split_backward: bool = False) -> list[StageWorker]:
    """One StageWorker per stage of ``task``, cut evenly; ``clocks``: each stage's clock (default
    time.monotonic)."""
    model = build_task_model(task, seed)
    cuts = even_cuts(candidate_cuts(model, task), stages)
    specs = split_model(model, task.example_inputs(micro_batch), cuts)
    needs = model_input_needs(specs)
    recipe = recipe or RecipeOptions()
    in_specs = stage_input_specs(specs, task.example_inputs(micro_batch))
    _, target_example = next(task.train_batches(micro_batch, 0, 1, seed))
    opts = StageOptions(steps=steps, max_inflight=max_inflight, update_every=update_every, micro_batch=micro_batch,
                        predict_weights=predict_weights, extrapolate_gradients=extrapolate_gradients,
                        inflight_warmup_steps=inflight_warmup_steps, compress=compress, recipe=recipe,
                        stale_correction=stale_correction, synchronous=synchronous,
                        split_backward=split_backward)
    batches = task.train_batches(micro_batch, cluster, num_clusters, seed)
    workers = [StageWorker(spec, len(specs), task.make_optimizer, task.loss_fn, opts,
                           batches=batches if spec.index == 0 else None, cluster=cluster,
                           model_input_needs=needs, input_specs=in_specs[spec.index],
                           target_example=target_example, clock=clocks[spec.index] if clocks else time.monotonic)
               for spec in specs]
    if recipe.eval_every:
        for i, worker in enumerate(workers):
            example = task.example_inputs(micro_batch)
            worker.recipe.evaluator.attach(eval_stage_module(task, seed, example, cuts, i, worker.module))
    return workers


def _over_the_wire(packed: Packed) -> Packed:
    """A packed tensor as a receiver gets it: encoded and decoded by ravq.net.wire."""
    msg = Message(type=MsgType.PROBE, sender="harness", packed={"p": packed})
    return decode([bytes(f) for f in encode(msg)]).packed["p"]


def run_workers(workers: list[StageWorker], timeout_s: float = 60.0) -> None:
    def emit_from(src: int):
        def emit(out: Outbound) -> None:
            # clone: like the wire, the receiver gets its own copy
            tensors = {k: v.detach().clone() if isinstance(v, torch.Tensor) else _over_the_wire(v)
                       for k, v in out.tensors.items()}
            meta = orjson.loads(orjson.dumps(out.meta))  # as the header carries it
            refused = workers[out.dest].deliver(out.kind, out.micro_batch, src, tensors, meta)
            assert refused is None, f"stage {out.dest} refused {out.kind} {out.micro_batch} from {src}: {refused}"
        return emit

    errors: list[BaseException] = []

    def body(w: StageWorker) -> None:
        try:
            w.run(emit_from(w.spec.index))
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            errors.append(err)
            for other in workers:
                other.stop()

    threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "pipeline did not finish"


def merged_state(workers: list[StageWorker]) -> dict[str, torch.Tensor]:
    state: dict[str, Any] = {}
    for w in workers:
        state.update(w.module.state_dict())
    return state


def train_one_process(task: ModuleType, *, steps: int, micro_batch: int = 4, seed: int = 0,
                      shards: int = 1) -> dict[str, torch.Tensor]:
    """Reference: the unsplit model; with shards > 1 each step uses one micro-batch per shard and the
    mean of their losses (what synchronous data parallelism computes)."""
    model = build_task_model(task, seed)
    opt = build_optimizer(task.make_optimizer, dict(model.named_parameters()))
    streams = [task.train_batches(micro_batch, s, shards, seed) for s in range(shards)]
    for _ in range(steps):
        opt.zero_grad()
        losses = []
        for stream in streams:
            inputs, targets = next(stream)
            losses.append(task.loss_fn(model(*inputs), targets))
        torch.stack(losses).mean().backward()
        opt.step()
    return model.state_dict()


def run_in_order(workers: list[StageWorker]) -> None:
    """Run the stages in one thread, deterministically: each turn the lowest stage with work ready does
    one piece of it (``Scheduler.next``'s choice: backward, then forward, then a new micro-batch, then a
    deferred weight pass).  So
    stage 0 fills its credits before later stages run, and in steady state each stage's staleness is
    its distance from the last stage, as on a pipeline whose later stages answer at once."""
    outbox: list[tuple[int, Outbound, int]] = []

    def emit_from(src: int) -> Callable[[Outbound], None]:
        return lambda out: outbox.append((out.dest, out, src))

    emits = [emit_from(w.spec.index) for w in workers]
    while True:
        while outbox:
            dest, out, src = outbox.pop(0)
            tensors = {k: v.detach().clone() if isinstance(v, torch.Tensor) else _over_the_wire(v)
                       for k, v in out.tensors.items()}
            assert workers[dest].deliver(out.kind, out.micro_batch, src, tensors) is None
        ready = [w for w in workers if w._sched.has_ready() or w.may_start() or w.has_deferred()]
        if not ready:
            break
        worker = ready[0]
        kind, arg = worker._sched.next(worker, lambda: False)
        if kind == "start":
            worker.passes.start(emits[worker.spec.index])
        elif kind == "bwd":
            worker.passes.backward(arg[0], arg[1], emits[worker.spec.index])
        elif kind == "weights":
            worker.passes.run_weights()
        else:
            worker.passes.forward(arg[0], arg[1], emits[worker.spec.index])
    for w in workers:
        w._flush_update()


def final_loss_with_defaults(task: ModuleType, stages: int, max_inflight: int, *, steps: int = 120,
                             micro_batch: int = 8, seed: int = 0) -> float:
    """The last stage's mean loss over the last 10 of ``steps`` micro-batches, trained in order
    (``run_in_order``) with the topology's default stale mechanisms and ``max_inflight`` in flight."""
    from ravq.config import TrainingConfig

    d = TrainingConfig()
    workers = make_workers(task, stages, steps=steps, max_inflight=max_inflight, micro_batch=micro_batch,
                           seed=seed, predict_weights=d.predict_weights,
                           extrapolate_gradients=d.extrapolate_gradients,
                           inflight_warmup_steps=d.inflight_warmup_steps, stale_correction=d.stale_correction)
    run_in_order(workers)
    return sum(workers[-1].stats.loss_history[-10:]) / 10
