"""ClusterAdam: Adam to the bit with one cluster; with C clusters, the global batch's second moment."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from ravq.average.averager import Averager
from ravq.average.group_rounds import RoundGroups
from ravq.config.averaging import AveragingConfig
from ravq.planner.pacing import effective_clusters
from ravq.stage.optim import ClusterAdam, global_second_moment, set_clusters


def _train(make_opt, steps: int = 25, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_one_cluster_is_torch_adam_to_the_bit(decoupled: bool, weight_decay: float) -> None:
    reference = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours = _train(lambda ps: ClusterAdam(ps, lr=3e-3, weight_decay=weight_decay, decoupled_weight_decay=decoupled))
    theirs = _train(lambda ps: reference(ps, lr=3e-3, weight_decay=weight_decay))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_state_keys_and_checkpoint_round_trip_match_adam() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = ClusterAdam([p], lr=0.1, clusters=2)
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()
    q = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([q], lr=0.1)
    q.grad = torch.ones(3)
    adam.step()
    assert set(opt.state[p]) == set(adam.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
    clone = ClusterAdam([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    clone.load_state_dict(opt.state_dict())
    torch.testing.assert_close(next(iter(clone.state.values()))["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_global_second_moment() -> None:
    m = torch.tensor([1.0, 0.0, 2.0, 3.0])
    v = torch.tensor([5.0, 4.0, 4.0, 1.0])  # last: m^2 > v (the moments' windows differ): left as v
    torch.testing.assert_close(global_second_moment(m, v, 1), v)
    torch.testing.assert_close(global_second_moment(m, v, 4), torch.tensor([1 + 4 / 4, 4 / 4, 4.0, 1.0]))
    assert torch.all(global_second_moment(m, v, 3) <= v)


def test_corrected_moment_estimates_the_mean_gradients_moment() -> None:
    """Gradients mean mu plus noise sd sigma per cluster: Adam's state on one cluster's stream,
    corrected for C = 4, lands near E[(mean of the 4 clusters' gradients)^2] = mu^2 + sigma^2 / 4, while
    the uncorrected moment sits near mu^2 + sigma^2."""
    gen = torch.Generator().manual_seed(0)
    mu, sigma, clusters = torch.tensor([0.0, 0.5, 1.0, 2.0]), 1.0, 4
    p = torch.nn.Parameter(torch.zeros(4))
    opt = ClusterAdam([p], lr=0.0, betas=(0.99, 0.999), clusters=clusters)
    for _ in range(20000):
        p.grad = mu + sigma * torch.randn(4, generator=gen)
        opt.step()
    state, t = opt.state[p], float(opt.state[p]["step"])
    m_hat, v_hat = state["exp_avg"] / (1 - 0.99 ** t), state["exp_avg_sq"] / (1 - 0.999 ** t)
    want = mu.square() + sigma ** 2 / clusters
    got = global_second_moment(m_hat, v_hat, clusters)
    assert torch.all((got - want).abs() < 0.2 * want + 0.05), (got, want)
    assert torch.all((v_hat - (mu.square() + sigma ** 2)).abs() < 0.25), v_hat


def test_clusters_averaging_each_step_follow_global_adam_closer_than_plain_adam() -> None:
    """C = 4 clusters with noisy gradients of one quadratic, weights averaged after every step, against
    one Adam on the mean of the 4 gradients: ClusterAdam's trajectory stays much closer to it."""
    clusters, dim, steps = 4, 16, 200
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(dim, dim, generator=gen) / dim ** 0.5
    target = torch.randn(dim, generator=gen)
    noise = [[torch.randn(dim, generator=gen) * 2.0 for _ in range(clusters)] for _ in range(steps)]

    def grad(w: torch.Tensor) -> torch.Tensor:
        return a.T @ (a @ w - target)

    def run(make: type, per_cluster: bool) -> torch.Tensor:
        n = clusters if per_cluster else 1
        ws = [torch.nn.Parameter(torch.zeros(dim)) for _ in range(n)]
        opts = [make([w]) for w in ws]
        for opt in opts:
            set_clusters(opt, clusters)
        for s in range(steps):
            with torch.no_grad():
                if per_cluster:
                    for c, w in enumerate(ws):
                        w.grad = grad(w) + noise[s][c]
                else:
                    ws[0].grad = grad(ws[0]) + sum(noise[s]) / clusters
            for opt in opts:
                opt.step()
            with torch.no_grad():
                mean = sum(w.detach() for w in ws) / n
                for w in ws:
                    w.copy_(mean)
        return ws[0].detach()

    global_adam = run(lambda ps: torch.optim.Adam(ps, lr=0.02), per_cluster=False)
    plain = run(lambda ps: torch.optim.Adam(ps, lr=0.02), per_cluster=True)
    ours = run(lambda ps: ClusterAdam(ps, lr=0.02), per_cluster=True)
    assert (ours - global_adam).norm() < 0.5 * (plain - global_adam).norm()


def test_bad_arguments_are_refused() -> None:
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="betas"):
        ClusterAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="clusters"):
        ClusterAdam(p, clusters=0)
    with pytest.raises(ValueError, match="lr"):
        ClusterAdam(p, lr=-1.0)


def test_the_averager_tells_the_optimizer_how_many_clusters_average() -> None:
    """Set on every update from the plan: 3 live clusters, then 2 when one is dropped, then 1 once this
    node's own cluster is dropped.  Optimizers without ``set_clusters`` are left alone."""
    excluded: set[int] = set()
    avg = Averager.__new__(Averager)
    avg.loop, avg._pending, avg.lead, avg.sync_every, avg.cluster = object(), [], 1, 1000, 0
    avg.groups = RoundGroups(AveragingConfig(), 0, 1000)
    avg.compute_timer = contextlib.nullcontext
    avg.plan = lambda: SimpleNamespace(clusters=[0, 1, 2], excluded=excluded, epoch=0, averaging=None)
    opt = ClusterAdam([torch.nn.Parameter(torch.zeros(1))])
    worker = SimpleNamespace(version=1, optimizer=opt)
    avg.on_update(worker)
    assert opt.clusters == 3
    excluded.add(2)
    avg.on_update(worker)
    assert opt.clusters == 2
    excluded.add(0)
    avg.on_update(worker)
    assert opt.clusters == 1
    worker.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    avg.on_update(worker)  # no set_clusters: nothing to do


@pytest.mark.parametrize("mode", ["global", "groups"])
def test_under_rate_pacing_the_averager_tells_the_optimizer_what_its_mix_is_worth(mode: str) -> None:
    """Rates 3:3:3:1 and sync_every 6: rounds mix the clusters 6:6:6:2 by samples, which averages away the
    noise of 3.41 clusters, not 4 (``effective_clusters``); the node tells ClusterAdam that, so a cluster that
    mixed with faster ones takes no step sized for equal weights.  Without the slow cluster the shares are
    equal again: 3; paced by steps: every live cluster, 4."""
    excluded: set[int] = set()
    paced = AveragingConfig(mode=mode, pace="rate", rates=[3.0, 3.0, 3.0, 1.0])
    plan = SimpleNamespace(clusters=[0, 1, 2, 3], excluded=excluded, epoch=0, averaging=paced)
    avg = Averager.__new__(Averager)
    avg.loop, avg._pending, avg.lead, avg.sync_every, avg.cluster = object(), [], 1, 6, 3
    avg.groups = RoundGroups(AveragingConfig(), 3, 6)
    avg.compute_timer = contextlib.nullcontext
    avg.plan = lambda: plan
    opt = ClusterAdam([torch.nn.Parameter(torch.zeros(1))])
    worker = SimpleNamespace(version=1, optimizer=opt)
    avg.on_update(worker)
    assert opt.clusters == pytest.approx(effective_clusters([6, 6, 6, 2])) == pytest.approx(20 * 112 / 656)
    assert opt.clusters < 3.5
    avg.cluster = 0
    avg.groups = RoundGroups(AveragingConfig(), 0, 6)
    excluded.add(3)
    avg.on_update(worker)
    assert opt.clusters == 3
    plan.averaging = None
    excluded.clear()
    avg.on_update(worker)
    assert opt.clusters == 4
