"""Weight prediction (``predict_weights``): off without staleness, w + k * s * (last update) with it."""

from __future__ import annotations

from typing import Any

import torch

from ravq.cut.split import build_task_model
from tests import models_for_tests as skipnet
from tests.pipeline_harness import make_workers, merged_state, run_workers


def test_prediction_without_staleness_is_bit_identical_to_plain() -> None:
    """max_inflight 1: no staleness, so predict_weights > 0 must change nothing, to the bit."""
    runs = []
    for k in (0.0, 2.0, 3.0):
        workers = make_workers(skipnet, 3, steps=20, max_inflight=1, predict_weights=k)
        run_workers(workers)
        assert all(w.stats.staleness_max == 0 and w.forward_weights.last_update is None for w in workers)
        runs.append(merged_state(workers))
    for other in runs[1:]:
        for name, value in runs[0].items():
            assert torch.equal(other[name], value), name


def test_prediction_changes_an_asynchronous_run() -> None:
    """With staleness the forwards run at predicted weights: the run differs from plain stashing."""
    states = []
    for k in (0.0, 2.0):
        workers = make_workers(skipnet, 3, steps=30, max_inflight=3, predict_weights=k)
        run_workers(workers)
        states.append(merged_state(workers))
        assert workers[0].stats.staleness_max > 0
    assert any(not torch.equal(states[0][n], states[1][n]) for n in states[0])


class _OneStage:
    """Drives one single-stage worker by hand: forwards and backwards in a chosen order."""

    def __init__(self, k: float) -> None:
        (self.w,) = make_workers(skipnet, 1, steps=8, max_inflight=3, predict_weights=k)
        self.batches = skipnet.train_batches(4, 0, 1, 0)
        self.targets: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, Any] = {}
        self.versions: list[dict[str, torch.Tensor]] = [self.params()]  # weights after each update
        self.w.subscribe_updates(lambda w: self.versions.append(self.params()))

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.w.params.items()}

    def forward(self, seq: int) -> None:
        inputs, self.targets[seq] = next(self.batches)
        self.inputs[seq] = inputs
        self.w.passes.run_module((0, seq), list(inputs))

    def backward(self, seq: int) -> None:
        stash = self.w.state.stash[(0, seq)]
        loss = skipnet.loss_fn(stash.outputs[0], self.targets[seq])
        self.w.passes.backward_from((0, seq), stash, [loss], [None], lambda out: None)


def test_forward_runs_at_extrapolated_weights_and_backward_takes_their_gradient() -> None:
    k = 2.0
    run = _OneStage(k)
    run.forward(0)
    run.forward(1)  # both at version 0: nothing measured yet, so no prediction
    for name, value in run.versions[0].items():
        assert torch.equal(run.w.state.stash[(0, 1)].params[name], value)
    run.backward(0)  # version 1, staleness 0
    run.backward(1)  # version 2, staleness 1
    assert list(run.w.forward_weights.recent_staleness) == [0, 1] and run.w.version == 2
    run.forward(2)
    stash = run.w.state.stash[(0, 2)]
    mean_staleness = 0.5
    w1, w2 = run.versions[1], run.versions[2]
    for name in w2:
        want = w2[name] + k * mean_staleness * (w2[name] - w1[name])
        torch.testing.assert_close(stash.params[name], want, rtol=0, atol=1e-6, msg=name)
        assert not torch.allclose(stash.params[name], w2[name]), f"{name} was not extrapolated"
        assert torch.equal(run.w.params[name].detach(), w2[name]), "the live weights stay where they are"
    # the gradient of micro-batch 2 is the gradient at the predicted weights it saw
    ref = build_task_model(skipnet, 0)
    ref.load_state_dict({n: v.detach() for n, v in stash.params.items()})
    skipnet.loss_fn(ref(*run.inputs[2]), run.targets[2]).backward()
    captured: dict[str, torch.Tensor] = {}
    step = run.w.optimizer.step

    def capture(*a: Any, **kw: Any) -> Any:
        captured.update({n: p.grad.clone() for n, p in run.w.params.items() if p.grad is not None})
        return step(*a, **kw)

    run.w.optimizer.step = capture  # type: ignore[method-assign]
    run.backward(2)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(captured[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_no_prediction_at_zero_k_even_with_staleness() -> None:
    run = _OneStage(0.0)
    run.forward(0)
    run.forward(1)
    run.backward(0)
    run.backward(1)
    run.forward(2)
    assert run.w.forward_weights.last_update is None
    for name, value in run.versions[2].items():
        assert torch.equal(run.w.state.stash[(0, 2)].params[name], value)
