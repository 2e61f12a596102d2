"""What a stage holds (issue #39 part 4): weight prediction and delay compensation nothing while nothing is stale,
one buffer each while it is, and the same numbers as the copies they replaced; a stated batch's gradient sum one
copy of the gradients."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ravq.cut.split import build_task_model
from ravq.stage.delay import GradientExtrapolation
from ravq.stage.pipeline import StageWorker
from ravq.stage.stash import WeightStash
from ravq.stage.types import MicroBatch
from tests.pipeline_harness import make_workers, merged_state, run_in_order


def _stage(seed: int = 0) -> tuple[dict[str, nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layer = nn.Linear(4, 3)
    return dict(layer.named_parameters()), torch.optim.Adam(layer.parameters(), lr=0.1)


def _set_grads(params: dict[str, nn.Parameter], k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g)


def _stale_steps(stash: WeightStash, params: dict[str, nn.Parameter], opt: torch.optim.Optimizer,
                 steps: int, predict: float = 2.0) -> list[dict[str, torch.Tensor]]:
    """Steps at staleness 1 with a forward (a snapshot taken) of each version in between; the snapshots."""
    snapshots = []
    for k in range(steps):
        snapshots.append({n: w.detach().clone() for n, w in stash.weights(k, predict).items()})
        _set_grads(params, k)
        stash.record_staleness(1)
        stash.step(opt, predict, in_flight=True)
    return snapshots


def _reference(steps: int, predict: float = 2.0) -> list[dict[str, torch.Tensor]]:
    """The snapshots as the copies before this change made them: w + k s (w_after - w_before)."""
    params, opt = _stage()
    last: dict[str, torch.Tensor] | None = None
    snapshots = []
    for k in range(steps):
        with torch.no_grad():
            if last is None:
                snapshots.append({n: p.detach().clone() for n, p in params.items()})
            else:
                snapshots.append({n: torch.add(p.detach(), last[n], alpha=predict * 1.0)
                                  for n, p in params.items()})
            _set_grads(params, k)
            before = {n: p.detach().clone() for n, p in params.items()}
            opt.step()
            last = {n: p.detach() - before[n] for n, p in params.items()}
    return snapshots


def test_predicted_snapshots_are_the_same_numbers_made_in_one_buffer() -> None:
    want = _reference(6)
    for reuse in (False, True):
        params, opt = _stage()
        got = _stale_steps(WeightStash(params, reuse_update=reuse), params, opt, 6)
        for g, w in zip(got, want):
            for name in w:
                torch.testing.assert_close(g[name], w[name], rtol=0, atol=0)


def test_the_snapshot_takes_the_update_buffer_and_a_step_reuses_it_when_kept() -> None:
    params, opt = _stage()
    stash = WeightStash(params, reuse_update=True)
    _stale_steps(stash, params, opt, 2)
    assert stash.last_update is not None
    update_ptrs = {n: t.data_ptr() for n, t in stash.last_update.items()}
    snapshot = stash.weights(2, 2.0)
    assert {n: t.data_ptr() for n, t in snapshot.items()} == update_ptrs  # no second copy
    assert stash.last_update is None

    params, opt = _stage()
    kept = WeightStash(params, reuse_update=False)  # tied copies may change the weights mid-version
    _stale_steps(kept, params, opt, 2)
    assert kept.last_update is not None
    ptrs = {n: t.data_ptr() for n, t in kept.last_update.items()}
    kept.weights(2, 2.0)
    _set_grads(params, 9)
    kept.record_staleness(1)
    kept.step(opt, 2.0, in_flight=True)
    assert {n: t.data_ptr() for n, t in kept.last_update.items()} == ptrs  # the step wrote into it


def test_no_staleness_holds_no_update_and_no_gradient() -> None:
    params, opt = _stage()
    stash = WeightStash(params, extrapolate=2.0, reuse_update=True)
    for k in range(3):
        stash.weights(k, 2.0)
        _set_grads(params, k)
        stash.record_staleness(0)
        stash.step(opt, 2.0, in_flight=False)
        opt.zero_grad(set_to_none=True)
    assert stash.last_update is None and not stash.extrapolation.previous


def test_the_last_gradient_is_kept_only_while_stale_and_extrapolates_as_before() -> None:
    params, _ = _stage()
    extrapolation = GradientExtrapolation(params, 2.0)
    _set_grads(params, 0)
    extrapolation.apply(0.0)
    assert not extrapolation.previous  # fresh: nothing kept
    _set_grads(params, 1)
    g1 = {n: p.grad.clone() for n, p in params.items()}
    extrapolation.apply(1.0)  # the first stale update: nothing to extrapolate from yet
    assert all(torch.equal(params[n].grad, g1[n]) for n in params)
    _set_grads(params, 2)
    g2 = {n: p.grad.clone() for n, p in params.items()}
    extrapolation.apply(0.5)
    for n, p in params.items():
        torch.testing.assert_close(p.grad, g2[n] + 2.0 * 0.5 * (g2[n] - g1[n]), rtol=0, atol=0)
        assert torch.equal(extrapolation.previous[n], g2[n])  # the raw gradient, for the next one
    _set_grads(params, 3)
    extrapolation.apply(0.0)
    assert not extrapolation.previous  # staleness gone: the copy is freed


class _Deep:
    """A task of eight equal layers, so one layer's gradient is an eighth of the stage's."""

    WIDTH, LAYERS = 128, 8

    @staticmethod
    def build_model() -> nn.Module:
        layers = [m for _ in range(_Deep.LAYERS) for m in (nn.Linear(_Deep.WIDTH, _Deep.WIDTH), nn.Tanh())]
        return nn.Sequential(*layers)

    @staticmethod
    def split_points() -> list[str]:
        return [str(2 * i) for i in range(1, _Deep.LAYERS)]

    @staticmethod
    def example_inputs(micro_batch: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(micro_batch, _Deep.WIDTH),)

    @staticmethod
    def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ((out - targets) ** 2).mean()

    @staticmethod
    def train_batches(micro_batch: int, shard: int, num_shards: int,
                      seed: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed * 31 + shard)
        while True:
            yield (torch.randn(micro_batch, _Deep.WIDTH, generator=gen),), torch.randn(micro_batch, _Deep.WIDTH,
                                                                                     generator=gen)

    @staticmethod
    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05)


def _allocated_peak(fn: Callable[[], None]) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn`` ran, over what it held before (the
    profiler's allocation and free events, in order: exact, whatever the process's resident size)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_a_stated_batch_sums_gradients_in_place_without_a_second_copy() -> None:
    """Several micro-batches per update: autograd adds each backward's gradients to the sum layer by layer,
    so the stage holds its gradients once (it held each backward's gradients and their scaled sum: twice)."""
    (worker,) = make_workers(_Deep, 1, steps=8, max_inflight=1, update_every=4, micro_batch=4)  # type: ignore[arg-type]
    stage = sum(p.numel() * p.element_size() for p in worker.params.values())
    peak = _allocated_peak(lambda: run_in_order([worker]))
    assert worker.version == 2
    assert peak < 1.4 * stage, f"{peak / stage:.2f} stages of memory over the weights"


@pytest.mark.parametrize("update_every", [3, 4])
def test_the_summed_update_is_the_mean_of_its_micro_batches_gradients(update_every: int) -> None:
    """The sum autograd accumulates is scaled once per update: the same weights as one process taking
    the mean of ``update_every`` micro-batches' losses each step."""
    workers = make_workers(_Deep, 2, steps=4 * update_every, max_inflight=1, update_every=update_every)  # type: ignore[arg-type]
    run_in_order(workers)
    model = build_task_model(_Deep, 0)  # type: ignore[arg-type]
    optimizer = _Deep.make_optimizer(model.parameters())
    batches = _Deep.train_batches(4, 0, 1, 0)
    for _ in range(4):
        optimizer.zero_grad()
        for _ in range(update_every):
            (x,), targets = next(batches)
            (_Deep.loss_fn(model(x), targets) / update_every).backward()
        optimizer.step()
    got = merged_state(workers)
    for name, want in model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6, msg=name)


def _held_at_steps(workers: list[StageWorker]) -> dict[int, float]:
    """Per stage, the most stage-sized blocks alive at any of its optimizer steps: the live weights, their
    gradients, every weight snapshot a forward ran at that is still alive (held by anything: the stash, the
    weight stash's cache, a frame, autograd's graph) and the copies kept for reuse, in stages (bytes of
    distinct storages)."""
    held: dict[int, float] = {}
    for w in workers:
        snapshots: list[weakref.ref[torch.Tensor]] = []
        run_module, step = w.passes.run_module, w.optimizer.step

        def tracked(mb: MicroBatch, inputs: list[torch.Tensor], w: StageWorker = w,
                    run_module: Callable[..., tuple[torch.Tensor, ...]] = run_module,
                    snapshots: list[weakref.ref[torch.Tensor]] = snapshots) -> tuple[torch.Tensor, ...]:
            out = run_module(mb, inputs)
            snapshots.extend(weakref.ref(t) for t in w.state.stash[mb].params.values())
            return out

        def counted(*args: Any, w: StageWorker = w, step: Callable[..., Any] = step,
                    snapshots: list[weakref.ref[torch.Tensor]] = snapshots, **kwargs: Any) -> Any:
            alive = [*w.params.values(), *(p.grad for p in w.params.values() if p.grad is not None),
                     *(t for t in (ref() for ref in snapshots) if t is not None),
                     *(t for kept in w.forward_weights.retired for t in kept.values())]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
            stage = sum(p.untyped_storage().nbytes() for p in w.params.values())
            held[w.spec.index] = max(held.get(w.spec.index, 0.0), sum(storages.values()) / stage)
            return step(*args, **kwargs)

        w.passes.run_module = tracked  # type: ignore[method-assign]
        w.optimizer.step = counted  # type: ignore[method-assign]
    return held


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
def test_a_stale_step_holds_the_weights_their_gradients_and_a_copy_per_older_version_in_flight(
        max_inflight: int) -> None:
    """Issue #39's memory target: a step holds the stage's weights, gradients and one copy per older version
    still in flight (``max_inflight - 1``), no more.  The micro-batch whose backward completed the update no
    longer holds its snapshot (its graph's leaves), nor does the weight stash keep an old version's copy
    (each was one more stage at every stale step: 4 of a stage with 2 in flight, 5 with 3)."""
    workers = make_workers(_Deep, 3, steps=16, max_inflight=max_inflight)  # type: ignore[arg-type]
    held = _held_at_steps(workers)
    run_in_order(workers)
    assert all(w.version == 16 for w in workers)
    assert held[2] == pytest.approx(2.0)  # the last stage is never stale: weights and gradients
    for stage in (0, 1):
        assert held[stage] == pytest.approx(2.0 + (max_inflight - 1)), (stage, held)


def test_the_live_weights_move_into_a_finished_copy_never_into_one_in_use() -> None:
    """A step with forwards in flight moves the live weights into the copy the forwards of an older version
    ran at once they all finished (the same memory each step), never while a tensor still uses it."""
    params, opt = _stage()
    stash = WeightStash(params)
    ptrs = lambda ws: {n: t.data_ptr() for n, t in ws.items()}
    snap0 = stash.weights(0, 0.0)  # the live weights' storage until they change
    _set_grads(params, 0)
    stash.step(opt, 0.0, in_flight=True)  # the forwards at version 0 keep it; the live weights move
    snap1 = stash.weights(1, 0.0)
    _set_grads(params, 1)
    stash.step(opt, 0.0, in_flight=True)  # snap0 still in use: a fresh copy
    assert not set(ptrs(params).values()) & set(ptrs(snap0).values())
    before1 = {n: t.clone() for n, t in snap1.items()}
    freed = ptrs(snap0)
    del snap0
    stash.weights(2, 0.0)
    _set_grads(params, 2)
    stash.step(opt, 0.0, in_flight=True)  # version 0's forwards all finished: its copy takes the weights
    assert ptrs(params) == freed
    assert all(torch.equal(snap1[n], before1[n]) for n in snap1)  # still in use: untouched
    reference, ref_opt = _stage()
    for k in range(3):
        _set_grads(reference, k)
        ref_opt.step()
    assert all(torch.equal(params[n], reference[n]) for n in params)
