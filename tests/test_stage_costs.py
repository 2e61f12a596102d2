"""What a stage of a pipeline costs a node beyond its FLOPs, messages and loss (issue #26): timed on a real
two-stage pipeline over loopback sockets by ``ravq profile``, charged per stage by the cost model, the
planner's search, Ravnest's rule and the simulator (never to a whole copy of the model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ravq.config import ClusterPlan, Plan, load_topology, resolve_task_module
from ravq.planner import BlockProfile, NodeProfile, cut_plan, evaluate_plan, make_plan
from ravq.profile import stage_cost
from ravq.profile.measure import stage_cpu_s
from ravq.profile.stage_cost import StageCostConfig, StageCpu, balanced_order, measure_stage_cpu
from ravq.profile.store import Measurement, load_profiles, save_profile
from ravq.simulate import Settings, build_world, simulate
from ravq.simulate.world import stage_message_s
from tests import test_loss_costs as loss_costs
from tests.test_profile import one_node_topology

GIB = loss_costs.GIB
SETTINGS = {**loss_costs.SETTINGS, "update_every": 3}
"""A stated batch of 3 micro-batches per update: every stage of up to 3 busy (with an update per micro-batch
ravq keeps 2 in flight, ``default_inflight``), as these pipelines are costed."""


def nodes(stage_s: float, names: tuple[str, ...] = ("a", "b", "c")) -> list[NodeProfile]:
    return [NodeProfile(name=n, flops=1e9, memory_bytes=8 * GIB, pipeline_stage_s=stage_s,
                        bandwidth_bytes_per_s={m: 1e12 for m in names if m != n}) for n in names]


def blocks(count: int = 6) -> list[BlockProfile]:
    return loss_costs.blocks(count)


def test_every_stage_of_a_pipeline_pays_it_and_a_whole_copy_does_not() -> None:
    three = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a", "b", "c"], cuts=["b2", "b4"])])
    ex = evaluate_plan(three, nodes(0.1), blocks(), **SETTINGS)
    assert [s.compute_s for s in ex.clusters[0].stages] == pytest.approx([0.7, 0.7, 0.7])
    # three stages of 0.7 s, three in flight: 1 / 0.7 micro-batches per second (links are free)
    assert ex.samples_per_s == pytest.approx(4 / 0.7, rel=1e-3)
    whole = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a"])])
    assert evaluate_plan(whole, nodes(0.1), blocks(), **SETTINGS).clusters[0].stages[0].compute_s == pytest.approx(1.8)


def test_a_dear_stage_makes_the_planner_prefer_whole_copies() -> None:
    cheap, _ = make_plan(nodes(0.0), blocks(), **SETTINGS)
    dear, _ = make_plan(nodes(1.0), blocks(), **SETTINGS)
    assert max(len(c.nodes) for c in cheap.clusters) > 1
    assert [len(c.nodes) for c in dear.clusters] == [1, 1, 1]
    # a fixed layout is cut alike: the charge is the same for every stage, so balanced cuts stay balanced
    _, ex = cut_plan([["a", "b"]], nodes(0.2), blocks(), **SETTINGS)
    assert [s.compute_s for s in ex.clusters[0].stages] == pytest.approx([1.1, 1.1])


def test_the_simulator_charges_it_per_stage() -> None:
    bl = blocks()
    node = nodes(0.1)[0]
    assert stage_message_s(node, bl, 0, 3) == pytest.approx(0.1) and stage_message_s(node, bl, 2, 4) == 0.1
    assert stage_message_s(node, bl, 0, 6) == 0.0
    settings = Settings(steps=60, micro_batch=4, sync_every=10)
    two = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a", "b"], cuts=["b3"])])
    charged = simulate(build_world(two, nodes(0.3), bl, settings)).samples_per_s
    free = simulate(build_world(two, nodes(0.0), bl, settings)).samples_per_s
    # stages of 0.9 s + 0.3 s, two in flight: the cost model says 4 / 1.2 and 4 / 0.9
    assert charged == pytest.approx(4 / 1.2, rel=0.03) and free == pytest.approx(4 / 0.9, rel=0.03)
    assert charged == pytest.approx(evaluate_plan(two, nodes(0.3), bl, **SETTINGS).samples_per_s, rel=0.03)


def test_the_per_stage_cost_is_what_two_stages_cost_beyond_one_and_their_messages() -> None:
    table = [[1000, 0.001], [100_000, 0.003]]          # CPU seconds per message of that many float32 bytes
    measured = StageCpu(pipeline_cpu_s=0.130, single_cpu_s=0.100, act_bytes=1000, grad_bytes=100_000)
    assert stage_cpu_s(measured, table) == pytest.approx((0.130 - 0.100 - 0.001 - 0.003) / 2)
    cheaper = StageCpu(pipeline_cpu_s=0.099, single_cpu_s=0.100, act_bytes=1000, grad_bytes=1000)
    assert stage_cpu_s(cheaper, table) == 0.0


def test_runs_alternate_so_that_a_drifting_machine_cancels_out(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed once each, one stage then two, the per-stage cost of PCs alike came out 0-16 ms of CPU (issue
    #26): the machine's CPU per step moves by 10% within minutes.  Runs go one, two, two, one, and a speed
    that drifts at a steady rate adds as much to both means."""
    assert balanced_order(1) == ["single", "pipeline"]
    assert balanced_order(2) == ["single", "pipeline", "pipeline", "single"]
    assert balanced_order(3) == ["single", "pipeline", "pipeline", "single", "single", "pipeline"]
    clock = iter(range(100))
    ran: list[str] = []

    def single(*args: object) -> float:          # 100 ms of CPU, 5 ms more at every run: the machine slows
        ran.append("single")
        return 0.100 + 0.005 * next(clock)

    async def pipeline(*args: object) -> tuple[float, int, int]:
        ran.append("pipeline")
        return 0.120 + 0.005 * next(clock), 4096, 8192

    monkeypatch.setattr(stage_cost, "_single_cpu_s", single)
    monkeypatch.setattr(stage_cost, "_pipeline_cpu_s", pipeline)
    topology = one_node_topology(tmp_path, False, {"micro_batch": 4})
    got = measure_stage_cpu(topology, "a", None, StageCostConfig(repeats=2))
    assert ran == ["single", "pipeline", "pipeline", "single"]
    assert got.pipeline_cpu_s - got.single_cpu_s == pytest.approx(0.020)   # one run each read 0.025
    assert (got.act_bytes, got.grad_bytes) == (4096, 8192)


def test_a_stage_is_timed_as_a_node_runs_it(tmp_path: Path) -> None:
    topology = one_node_topology(tmp_path, True, {"compress": {"pipeline": "int8"}, "micro_batch": 4})
    got = measure_stage_cpu(topology, "a", resolve_task_module("ravq.tasks.charlm"), StageCostConfig(micro_batches=4, warmup=2))
    assert got.pipeline_cpu_s > 0 and got.single_cpu_s > 0
    assert got.act_bytes > 0 and got.grad_bytes > 0     # the cut's activations (and targets) and gradients
    # the model as two stages does all the one stage does, and its messages on top, in CPU terms
    assert got.pipeline_cpu_s < 50 * got.single_cpu_s
    # where two stages at the topology's micro-batch do not fit, they run at a smaller one
    half = measure_stage_cpu(topology, "a", resolve_task_module("ravq.tasks.charlm"),
                             StageCostConfig(micro_batches=2, warmup=1, micro_batch=2, repeats=1))
    assert half.act_bytes == got.act_bytes // 2 and half.grad_bytes == got.grad_bytes // 2


def test_the_per_stage_cost_travels_from_profile_to_planner(tmp_path: Path) -> None:
    save_profile(Measurement(name="a", device="cpu", flops=1e9, matmul_flops=1e9, model_flops=1e9,
                             memory_bytes=GIB, stage_s=0.012, stage_cpu_s=0.006), tmp_path)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"task": "ravq.tasks.charlm", "training": {"micro_batch": 4, "sync_every": 5},
                                    "broker": {"pub_port": 26901, "router_port": 26902},
                                    "nodes": [{"name": "a", "pipeline_port": 27000, "ring_port": 28000}]}))
    assert load_profiles(load_topology(path), tmp_path)[0].pipeline_stage_s == 0.012
