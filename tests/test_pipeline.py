"""The asynchronous pipeline without sockets: scheduling, stashing, staleness, sync equivalence."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ravq.config import PREDICT_WEIGHTS
from ravq.stage.pipeline import StageWorker
from ravq.stage.schedule import Scheduler
from tests import models_for_tests as skipnet
from tests.pipeline_harness import make_workers, merged_state, run_workers, train_one_process


@pytest.mark.parametrize("predict_weights", [0.0, PREDICT_WEIGHTS], ids=["plain", "predict-default"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_sync_pipeline_equals_one_process(stages: int, predict_weights: float) -> None:
    """max_inflight=1: the split model must train exactly like the unsplit one (the correctness anchor),
    with weight prediction off and at the configured default (no staleness: nothing to predict)."""
    workers = make_workers(skipnet, stages, steps=25, max_inflight=1, predict_weights=predict_weights)
    run_workers(workers)
    want = train_one_process(skipnet, steps=25)
    got = merged_state(workers)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    assert all(w.stats.staleness_max == 0 for w in workers)


def test_skip_connection_and_multi_input_stages_are_exercised() -> None:
    workers = make_workers(skipnet, 4, steps=1, max_inflight=1)
    # stage 1 reads model input y directly, stage 2 reads stage 0's output across a cut
    assert workers[1].spec.model_inputs == [1]
    assert 0 in workers[2].spec.producer_stages and len(workers[2].spec.inputs) >= 2


def test_async_pipeline_has_staleness_bounded_by_inflight() -> None:
    workers = make_workers(skipnet, 4, steps=40, max_inflight=4)
    run_workers(workers)
    assert all(w.stats.backwards == 40 and w.version == 40 for w in workers)
    assert workers[0].stats.staleness_max > 0  # stage 0 updates while 3 more micro-batches are in flight
    assert all(w.stats.staleness_max <= 3 for w in workers)
    assert workers[-1].stats.staleness_max == 0  # the last stage runs backward right after forward


def test_async_differs_from_sync_but_learns() -> None:
    workers = make_workers(skipnet, 3, steps=60, max_inflight=3)
    run_workers(workers)
    last = workers[-1].stats
    assert last.loss_last is not None and last.loss_first is not None


def test_weight_stashing_gives_gradient_at_forward_weights() -> None:
    """Two forwards at version 0, an update in between, the second backward must use version-0 weights."""
    workers = make_workers(skipnet, 1, steps=2, max_inflight=2)
    (w,) = workers
    batches = skipnet.train_batches(4, 0, 1, 0)
    (x1, y1), t1 = next(batches)
    (x2, y2), t2 = next(batches)
    ref = skipnet.build_model()
    ref.load_state_dict(w.module.state_dict())
    # gradient of micro-batch 2 at the initial weights
    skipnet.loss_fn(ref(x2, y2), t2).backward()
    expected = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out1 = w.passes.run_module((0, 0), [x1, y1])
    out2 = w.passes.run_module((0, 1), [x2, y2])
    assert out1 and out2
    w.optimizer = torch.optim.SGD(w.params.values(), lr=1.0)  # big step: stale weights would show
    w.passes.backward_from((0, 0), w.state.stash[(0, 0)],
                           [skipnet.loss_fn(w.state.stash[(0, 0)].outputs[0], t1)], [None], lambda out: None)
    assert w.version == 1
    captured = {}
    w.optimizer = torch.optim.SGD(w.params.values(), lr=0.0)
    orig_step = w.optimizer.step

    def capture(*a, **k):
        captured.update({n: p.grad.clone() for n, p in w.params.items()})
        return orig_step(*a, **k)

    w.optimizer.step = capture  # type: ignore[method-assign]
    w.passes.backward_from((0, 1), w.state.stash[(0, 1)],
                           [skipnet.loss_fn(w.state.stash[(0, 1)].outputs[0], t2)], [None], lambda out: None)
    for n, g in expected.items():
        torch.testing.assert_close(captured[n], g, rtol=1e-6, atol=1e-7, msg=n)
    assert w.stats.staleness_max == 1


def test_update_every_accumulates() -> None:
    workers = make_workers(skipnet, 2, steps=12, max_inflight=1, update_every=3)
    run_workers(workers)
    assert all(w.version == 4 for w in workers)


class ManualClock:
    """A stage's clock that moves only when the test says (``advance``): what the stage counts is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def entered_idle(worker: StageWorker, reason: str) -> threading.Event:
    """Set once ``worker``'s compute thread starts a wait for work it will count as ``reason``."""
    entered, idle_reason = threading.Event(), worker.idle_reason

    def watched() -> str | None:
        got = idle_reason()
        if got == reason:
            entered.set()
        return got

    worker.idle_reason = watched  # type: ignore[method-assign]
    return entered


def test_waiting_is_not_busy_and_is_counted_by_reason() -> None:
    """Honest busy, on each stage's own manual clock: stage 0's forwards take 0.25 s and its optimizer
    steps 0.5 s, and its update hook is held back 1 s each time (as for an averaging round).  The hold is
    "averaging" waiting, not backward compute; stage 0 at max_inflight waits for "credits" and stage 1,
    starved, for "input" (each made to happen at least once; the clocks stand still meanwhile)."""
    from ravq.metrics import Metrics

    forward_s, step_s, held_s, steps = 0.25, 0.5, 1.0, 6
    clocks = [ManualClock(), ManualClock()]
    workers = make_workers(skipnet, 2, steps=steps, max_inflight=1, clocks=clocks)
    metrics = Metrics("s0")
    workers[0].metrics = metrics
    credits, starved = entered_idle(workers[0], "credits"), entered_idle(workers[1], "input")

    def compute(*_: object) -> None:
        clocks[0].advance(forward_s)

    def reply(*_: object) -> None:  # stage 0 waits for credits meanwhile
        assert credits.wait(10), "stage 0 at max_inflight never waited for credits"

    workers[0].module.register_forward_hook(compute)
    workers[1].module.register_forward_hook(reply)

    def hold(worker: StageWorker) -> None:  # the optimizer step, then what Averager._hold_back does
        clocks[0].advance(step_s)
        assert starved.wait(10), "stage 1 never waited for input"  # it waits for the next forward meanwhile
        t0 = worker.clock()
        clocks[0].advance(held_s)
        worker.waited("averaging", worker.clock() - t0)

    workers[0].subscribe_updates(hold)
    run_workers(workers)
    s0, s1 = workers[0].stats, workers[1].stats
    assert s0.updates == steps and s0.started_at == 0.0
    assert (s0.forward_s, s0.backward_s) == (steps * forward_s, steps * step_s), "the hold is not compute"
    assert s0.busy_s == s0.forward_s + s0.backward_s
    assert s0.wait_s == {"averaging": steps * held_s, "credits": 0.0}
    assert s1.wait_s == {"input": 0.0} and s1.busy_s == 0.0
    snap = s0.snapshot()
    assert snap["wall_s"] == steps * (forward_s + step_s + held_s) == s0.busy_s + sum(s0.wait_s.values())
    assert snap["wait_s"] == s0.wait_s and snap["busy_fraction"] == s0.busy_s / snap["wall_s"]
    exported = {s.labels["reason"]: s.value for m in metrics.registry.collect() if m.name == "ravq_stage_wait_seconds"
                for s in m.samples if s.name.endswith("_total")}
    assert exported == s0.wait_s
    assert metrics.registry.get_sample_value("ravq_stage_busy_seconds_total") == s0.busy_s


class _Stage:
    """The scheduler's view of a stage with nothing to do, that counts its idle waits."""

    def __init__(self, reason: str | None, entered: threading.Event) -> None:
        self.reason, self.entered, self.waits = reason, entered, list[tuple[str, float]]()

    def may_start(self) -> bool:
        return False

    def may_forward(self) -> bool:
        return True

    def has_deferred(self) -> bool:
        return False

    def finished(self) -> bool:
        return False

    def idle_reason(self) -> str | None:
        self.entered.set()
        return self.reason

    def waited_idle(self, reason: str, seconds: float) -> None:
        self.waits.append((reason, seconds))


@pytest.mark.parametrize("reason", ["input", None])
def test_an_idle_wait_is_timed_on_the_stage_clock_and_counted_by_its_reason(reason: str | None) -> None:
    """The scheduler times a wait for work on the stage's clock: 2.5 s pass (on it) before work comes,
    and the stage counts 2.5 s for ``reason``, or nothing when there is no reason to count."""
    clock, entered = ManualClock(), threading.Event()
    stage, sched = _Stage(reason, entered), Scheduler([0], [], 4, clock)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(sched.next(stage, lambda: False)), daemon=True)
    thread.start()
    assert entered.wait(30)
    with sched.cond:  # held: the compute thread is inside its wait, its start already read
        clock.advance(2.5)
        sched.submit(print)
    thread.join(30)
    assert got == [("control", print)]
    assert sum(seconds for _, seconds in stage.waits) == (2.5 if reason else 0.0)
    assert {r for r, _ in stage.waits} == ({reason} if reason else set())


def test_a_part_that_completes_a_waiting_micro_batch_is_taken_at_the_limit_and_a_round_fits() -> None:
    """The limit bounds micro-batches waiting, not parts: at the limit, a new micro-batch is refused but
    the second part of one already waiting is taken.  The eval queue holds a whole round on top."""
    sched = Scheduler([0, 1], [], 2, eval_round=3)
    expected = {"x": ((2,), torch.float32)}
    part = {"x": torch.zeros(2)}
    with sched.cond:
        assert [sched.put("fwd", (0, i), 0, part, expected) for i in range(3)] == [None, None, "queue_full"]
        assert sched.put("fwd", (0, 1), 1, part, expected) is None
        assert sched.pop_ready("fwd") == ((0, 1), {0: part, 1: part})
        assert [sched.put("eval", (0, i), 0, part, expected) for i in range(6)] == [None] * 5 + ["queue_full"]
        assert all(sched.put("eval", (0, i), 1, part, expected) is None for i in range(5))
