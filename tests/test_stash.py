"""Weight stashing costs memory only while an update falls between a forward and its backward."""

from __future__ import annotations

import torch
from torch import nn

from ravq.stage.stash import WeightStash


def _stage() -> tuple[dict[str, nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    return dict(layer.named_parameters()), torch.optim.SGD(layer.parameters(), lr=0.5)


def _grad(weights: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = (x @ weights["weight"].T + weights["bias"]).pow(2).sum()
    return torch.autograd.grad(out, [weights["weight"]])[0], out.detach()


def test_with_nothing_in_flight_the_forward_runs_on_the_live_weights() -> None:
    params, opt = _stage()
    stash = WeightStash(params)
    weights = stash.weights(0, 0.0)
    assert all(w.data_ptr() == params[n].data_ptr() for n, w in weights.items())  # no copy
    for p in params.values():
        p.grad = torch.ones_like(p)
    stash.step(opt, 0.0, in_flight=False)
    assert stash.snapshot is None  # nobody held version 0's weights: nothing kept


def test_an_update_under_a_forward_in_flight_leaves_that_forward_its_weights() -> None:
    params, opt = _stage()
    x = torch.randn(2, 3)
    stash = WeightStash(params)
    before = {n: p.detach().clone() for n, p in params.items()}
    weights = stash.weights(0, 0.0)
    out = (x @ weights["weight"].T + weights["bias"]).pow(2).sum()  # a forward, its backward to come
    for p in params.values():
        p.grad = torch.ones_like(p)
    stash.step(opt, 0.0, in_flight=True)
    assert not torch.equal(params["weight"], before["weight"])  # the live weights moved on
    assert torch.equal(weights["weight"], before["weight"])  # the stashed ones did not
    got = torch.autograd.grad(out, [weights["weight"]])[0]
    want, _ = _grad({n: v.clone().requires_grad_() for n, v in before.items()}, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert stash.weights(1, 0.0)["weight"].data_ptr() == params["weight"].data_ptr()  # version 1: live again


def test_the_backward_of_a_forward_in_flight_survives_two_updates() -> None:
    """Autograd saved the weights for the input's gradient: they must be untouched at backward."""
    params, opt = _stage()
    stash = WeightStash(params)
    x = torch.randn(2, 3, requires_grad=True)
    before = {n: p.detach().clone() for n, p in params.items()}
    weights = stash.weights(0, 0.0)
    out = (x @ weights["weight"].T + weights["bias"]).pow(2).sum()
    for version in (1, 2):
        for p in params.values():
            p.grad = torch.ones_like(p)
        stash.step(opt, 0.0, in_flight=True)
        stash.weights(version, 0.0)
    got = torch.autograd.grad(out, [x])[0]
    x2 = x.detach().clone().requires_grad_()
    want = torch.autograd.grad((x2 @ before["weight"].T + before["bias"]).pow(2).sum(), [x2])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
