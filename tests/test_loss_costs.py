"""The loss stage's extra work (issue #26): profiled apart, taken out of the FLOP/s, charged to the stage
that holds the last block by the cost model, the planner's search and the simulator.  Pure: no sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ravq.config import ClusterPlan, Plan, load_topology
from ravq.planner import BlockProfile, NodeProfile, cut_plan, evaluate_plan, make_plan
from ravq.profile.loss import flops_without_loss, measure_loss
from ravq.profile.store import Measurement, load_profiles, save_profile
from ravq.simulate import Settings, build_world, simulate
from ravq.simulate.world import stage_message_s
from ravq.tasks import charlm

GIB = 1 << 30
SETTINGS = {"micro_batch": 4, "sync_every": 10}


def nodes(loss_s: float, names: tuple[str, ...] = ("a", "b")) -> list[NodeProfile]:
    return [NodeProfile(name=n, flops=1e9, memory_bytes=8 * GIB, loss_s=loss_s,
                        bandwidth_bytes_per_s={m: 1e12 for m in names if m != n}) for n in names]


def blocks(count: int = 4) -> list[BlockProfile]:
    return [BlockProfile(name=f"b{i}", param_bytes=1000, fwd_flops=1e8, bwd_flops=2e8, act_bytes_out=10,
                         memory_bytes=1 << 20) for i in range(count)]


def test_only_the_stage_that_computes_the_loss_pays_it() -> None:
    two = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a", "b"], cuts=["b2"])])
    stages = evaluate_plan(two, nodes(0.05), blocks(), **SETTINGS).clusters[0].stages
    assert [s.compute_s for s in stages] == pytest.approx([0.6, 0.6 + 0.05])
    whole = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a"])])
    ex = evaluate_plan(whole, nodes(0.05), blocks(), **SETTINGS)
    assert ex.clusters[0].stages[0].compute_s == pytest.approx(1.2 + 0.05)
    assert ex.samples_per_s == pytest.approx(4 / 1.25)
    free = evaluate_plan(whole, nodes(0.0), blocks(), **SETTINGS)
    assert free.samples_per_s == pytest.approx(4 / 1.2)


def test_the_planner_gives_the_loss_stage_fewer_blocks() -> None:
    """Balanced cuts move a block off the stage that computes the loss once the loss is dear."""
    _, cheap = cut_plan([["a", "b"]], nodes(0.0), blocks(6), **SETTINGS)
    _, dear = cut_plan([["a", "b"]], nodes(0.4), blocks(6), **SETTINGS)
    held = [[s.last_block - s.first_block + 1 for s in ex.clusters[0].stages] for ex in (cheap, dear)]
    assert held[0] == [3, 3] and held[1] == [4, 2]
    # and dear enough, two whole copies beat one pipeline whose last stage pays it
    plan, _ = make_plan(nodes(0.4), blocks(6), **SETTINGS)
    assert [len(c.nodes) for c in plan.clusters] == [1, 1]


def test_the_simulator_charges_the_loss_to_the_last_stage() -> None:
    bl = blocks()
    node = nodes(0.05)[0]
    assert stage_message_s(node, bl, 2, 4) == pytest.approx(0.05) and stage_message_s(node, bl, 0, 2) == 0.0
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a"])])
    settings = Settings(steps=50, micro_batch=4, sync_every=10)
    charged = simulate(build_world(plan, nodes(0.05), bl, settings)).samples_per_s
    free = simulate(build_world(plan, nodes(0.0), bl, settings)).samples_per_s
    assert charged == pytest.approx(4 / 1.25, rel=0.02) and free == pytest.approx(4 / 1.2, rel=0.02)


def test_flops_leave_the_loss_out_when_the_timed_step_computed_it() -> None:
    # a step of 1e9 FLOPs took 1 s (1e9 FLOP/s), 0.2 s of it the loss: the blocks ran at 1.25e9 FLOP/s
    assert flops_without_loss(1e9, 1e9, 0.2) == pytest.approx(1.25e9)
    assert flops_without_loss(1e9, 1e9, 0.0) == 1e9
    assert flops_without_loss(1e9, 1e9, 0.8) == 1e9      # a loss dearer than half a step: timing is off


def test_the_loss_is_timed_and_travels_from_profile_to_planner(tmp_path: Path) -> None:
    cpu_s = measure_loss(charlm, 4, cpu_s=0.0, min_steps=2)
    assert cpu_s > 0
    save_profile(Measurement(name="a", device="cpu", flops=1e9, matmul_flops=1e9, model_flops=1e9,
                             memory_bytes=GIB, loss_s=0.004, loss_cpu_s=0.002), tmp_path)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"task": "ravq.tasks.charlm", "training": {"micro_batch": 4, "sync_every": 5},
                                    "broker": {"pub_port": 26901, "router_port": 26902},
                                    "nodes": [{"name": "a", "pipeline_port": 27000, "ring_port": 28000}]}))
    assert load_profiles(load_topology(path), tmp_path)[0].loss_s == 0.004
