"""Issue #39's defaults for stale updates, each mechanism alone: the in-flight window a stated batch gets
(``default_inflight``, and the planner's and ``ravq check``'s estimates with it), PipeNAG chosen by
``stale_correction: auto`` with an update per micro-batch, the delay compensation capped at one update,
and the SGD-momentum MLP of the zoo at 4 stages, which diverged with the previous defaults.  In-process, no
sockets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ravq.config import TrainingConfig
from ravq.config.batch import default_inflight, staleness_bound
from ravq.stage.delay import GradientExtrapolation
from ravq.stage.optim import ClusterAdam
from ravq.stage.pipenag import uses_lookahead


@pytest.mark.parametrize(("stages", "update_every", "inflight"),
                         [(4, 1, 2), (3, 1, 2), (2, 1, 2), (1, 1, 1), (4, 4, 4), (4, 8, 4), (4, 2, 2), (4, 3, 3),
                          (3, 2, 2), (2, 4, 2), (3, 4, 3), (2, 8, 4), (3, 8, 4), (14, 50, 25), (10, 50, 20),
                          (1, 50, 1)])
def test_the_window_keeps_a_micro_batch_at_most_one_update_stale(stages: int, update_every: int,
                                                                 inflight: int) -> None:
    """A stated batch: less than an update stale; an update per micro-batch: one update (2 in flight, not one
    per stage: the first of 4 stages was 3 updates stale, and the zoo lost there).  Many micro-batches per
    update: up to half an update in flight, at most two per stage (a WAN pipeline waits for credits with one
    per stage)."""
    assert default_inflight(stages, update_every) == inflight
    assert staleness_bound(inflight, update_every) <= 1.0
    if update_every > 1:
        assert staleness_bound(inflight, update_every) < 1.0
    if inflight > stages:
        assert staleness_bound(inflight, update_every) < 0.5


def test_a_stage_built_with_two_micro_batches_per_update_keeps_two_in_flight() -> None:
    from ravq.metrics import Metrics
    from ravq.stage.build import build_stage
    from ravq.tasks import charlm

    def inflight(**kw: object) -> int:
        training = TrainingConfig(micro_batch=2, steps=4, **kw)
        built = build_stage(charlm, training, seed=0, cuts=["blocks.0", "blocks.1"], stage=0, cluster=0, clusters=1, device="cpu",
                            metrics=Metrics("stale_defaults"))
        return built.worker.options.max_inflight

    assert inflight(batch=4) == 2  # 3 stages, 2 micro-batches per update: half an update stale at most


def _sgd(momentum: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=momentum)


def test_auto_takes_pipenag_only_where_a_micro_batch_is_a_whole_update_stale() -> None:
    adam = ClusterAdam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    rms = torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert uses_lookahead("auto", _sgd(), 1) and uses_lookahead("auto", adam, 1)
    assert not uses_lookahead("auto", _sgd(), 4) and not uses_lookahead("auto", adam, 2)
    assert not uses_lookahead("auto", rms, 1)  # no PipeNAG step for it: its own step, no error
    assert not uses_lookahead("auto", _sgd(momentum=0.0), 1)
    assert not uses_lookahead("none", adam, 1)
    assert uses_lookahead("pipenag", adam, 4)
    with pytest.raises(ValueError, match="RMSprop"):
        uses_lookahead("pipenag", rms, 1)
    assert TrainingConfig().stale_correction == "auto"


@pytest.mark.parametrize("staleness", [0.5, 1.0, 3.0])
def test_the_compensation_extrapolates_at_most_one_update_ahead(staleness: float) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    comp = GradientExtrapolation({"w": p}, factor=2.0)
    p.grad = torch.tensor([1.0, 0.0, -1.0])
    comp.apply(staleness)  # the first stale update: handed as it is
    assert torch.equal(p.grad, torch.tensor([1.0, 0.0, -1.0]))
    p.grad = torch.tensor([2.0, 1.0, -1.0])
    comp.apply(staleness)
    ahead = 2.0 * min(staleness, 1.0)
    assert torch.allclose(p.grad, torch.tensor([2.0 + ahead, 1.0 + ahead, -1.0]))


def test_the_zoo_sgd_momentum_mlp_at_4_stages_trains_with_the_defaults() -> None:
    """Heavy-ball SGD (momentum 0.9) with the first stage 3 updates stale: the previous defaults (gradients
    extrapolated 2 x 3 updates ahead, the optimizer's own step) diverged to nan in every seed; the
    defaults end near synchronous training, though still 2-3x above it at half of the samples."""
    from benchmarks.zoo_tasks import TASKS
    from tests.pipeline_harness import final_loss_with_defaults

    torch.set_num_threads(1)
    sync, stale = (final_loss_with_defaults(TASKS["mlp_sgd"], 4, window) for window in (1, 4))
    assert math.isfinite(stale) and stale < 1.5 * sync


def test_the_planner_counts_the_window_a_stated_batch_gives() -> None:
    """A stated batch of 2 micro-batches per step keeps 2 in flight on 4 stages (``default_inflight``), so a
    stage holds 2 micro-batches' stashes, not 4; with 2 clusters the step is 1 micro-batch: one per stage."""
    from ravq.planner import training_settings
    from ravq.planner.problem import Problem
    from tests.test_planner import block, node

    nodes = [node(f"n{i}", 1e10, 8.0) for i in range(4)]
    blocks = [block(f"b{i}", 1e9, 0.5, inflight_gib=0.25) for i in range(4)]
    training = TrainingConfig(micro_batch=8, batch=16)
    one = Problem(nodes, blocks, **training_settings(training, clusters=1))
    assert one.inflight_for(4) == 2 and one.inflight_for(1) == 1
    assert one.mem_span(4)[0, 1] == pytest.approx((0.5 + 2 * 0.25) * 2**30)
    two = Problem(nodes, blocks, **training_settings(training, clusters=2))  # an update per micro-batch: 2
    assert two.inflight_for(4) == 2
    unknown = Problem(nodes, blocks, **training_settings(training))  # a search over clusters: the widest
    assert unknown.inflight_for(4) == 2
    wide = Problem(nodes, blocks, **training_settings(TrainingConfig(micro_batch=8, batch=64), clusters=1))
    assert wide.inflight_for(4) == 4 and wide.inflight_for(3) == 4   # 8 per update: up to half of it
    stated = Problem(nodes, blocks, **training_settings(TrainingConfig(micro_batch=8, update_every=3)))
    assert stated.inflight_for(4) == 3


def test_ravq_check_counts_the_window_a_stated_batch_gives(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`ravq check --topology` estimates each stage with the micro-batches its node keeps in flight."""
    import json

    import yaml

    from ravq.cli.main import main
    from tests.swarm import local_topology

    reports = {}
    for name, extra in (("batch", {"batch": 12}), ("none", {})):
        topology = local_topology("tests.check_zoo:tiny", [3], {"micro_batch": 4, **extra})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(topology))
        out = tmp_path / f"{name}.json"
        assert main(["check", "--topology", str(path), "--profiles", str(tmp_path), "--meta-only",
                     "--json", str(out)]) == 0
        reports[name] = json.loads(out.read_text())[0]
    capsys.readouterr()
    assert reports["batch"]["max_inflight"] == 3 and reports["none"]["max_inflight"] == 2
    first = [r["memory"][0] for r in (reports["batch"], reports["none"])]
    assert first[0]["activations"] > 0 and first[0]["activations"] * 2 == first[1]["activations"] * 3


def test_the_planner_and_the_simulator_average_every_sync_every_steps_of_the_stated_batch() -> None:
    """A round every ``sync_every`` optimizer steps of ``update_every`` micro-batches, as nodes run it: 2 steps
    of 5 micro-batches cost the planner what 10 steps of one do (it counted 2 micro-batches, so rounds 5x as
    often); and the simulator's window follows the nodes' (``default_inflight``) unless one is stated."""
    from ravq.config import ClusterPlan, Plan
    from ravq.planner import evaluate_plan
    from ravq.simulate import Settings
    from tests.test_planner import block, mesh, node

    links = mesh(["a", "b"], 1e6)
    nodes = [node(n, 1e9, 8.0, links[n]) for n in "ab"]
    blocks = [block(f"b{i}", 1e9, 0.5, param=2_500_000) for i in range(2)]  # a 5 s round over 1 MB/s
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a"]), ClusterPlan(nodes=["b"])])
    stated = evaluate_plan(plan, nodes, blocks, micro_batch=2, sync_every=2, update_every=5, max_inflight=1)
    plain = evaluate_plan(plan, nodes, blocks, micro_batch=2, sync_every=10, max_inflight=1)
    often = evaluate_plan(plan, nodes, blocks, micro_batch=2, sync_every=2, max_inflight=1)
    assert stated.samples_per_s == pytest.approx(plain.samples_per_s)
    assert often.samples_per_s < 0.9 * plain.samples_per_s  # the rounds cost something here
    assert Settings(update_every=1).window(4) == 2 and Settings(update_every=4).window(4) == 4
    assert Settings(update_every=1, max_inflight=3).window(4) == 3
