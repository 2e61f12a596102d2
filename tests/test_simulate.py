"""The simulator: closed forms reproduced exactly, ravq's coupling and churn, input errors, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from ravq.cli.main import main
from ravq.config import ClusterPlan, Plan, load_plan
from ravq.planner import BlockProfile, NodeProfile
from ravq.simulate import SegmentSpec, Settings, StageSpec, World, build_world, simulate
from ravq.simulate.engine import Connection, EventQueue, SharedResource
from ravq.simulate.world import Network
from ravq.simulate.worldwide import naive_plan, transformer_blocks, worldwide_nodes

GIB = 1 << 30


def stage(name: str, fwd: float, bwd: float, act: float = 0.0, grad: float = 0.0) -> StageSpec:
    return StageSpec(node=name, fwd_s=fwd, bwd_s=bwd, act_bytes=act, grad_bytes=grad, param_bytes=0.0, blocks=(0, 1))


def world(clusters: list[list[StageSpec]], settings: Settings, bandwidth: float | None = None, latency: float = 0.0,
          segments: list[SegmentSpec] | None = None) -> World:
    names = [s.node for c in clusters for s in c]
    nodes = {n: NodeProfile(name=n, flops=1.0, memory_bytes=GIB,
                            bandwidth_bytes_per_s={m: bandwidth for m in names if m != n} if bandwidth else {},
                            latency_s={m: latency for m in names if m != n}) for n in names}
    return World(clusters=clusters, segments=segments or [], network=Network(nodes=nodes), settings=settings)


# --- closed forms


def test_one_stage_runs_at_one_over_its_compute_time() -> None:
    r = simulate(world([[stage("a", 0.01, 0.02)]], Settings(steps=100, micro_batch=4)))
    assert r.wall_s == pytest.approx(100 * 0.03, rel=1e-12)
    assert r.samples_per_s == pytest.approx(4 / 0.03, rel=1e-12)
    assert r.nodes[0].busy_fraction == pytest.approx(1.0)
    assert r.samples == 400 and r.nodes[0].staleness_mean == 0


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_balanced_pipeline_period_is_one_stage_time(stages: int) -> None:
    """k equal stages, max_inflight k (every stage busy), free links: one micro-batch per (forward + backward)."""
    def wall(steps: int) -> float:
        clusters = [[stage(f"s{j}", 0.01, 0.02, act=1e3, grad=1e3) for j in range(stages)]]
        return simulate(world(clusters, Settings(steps=steps, max_inflight=stages))).wall_s

    assert (wall(100) - wall(50)) / 50 == pytest.approx(0.03, rel=1e-9)


def test_inflight_warmup_steps_run_synchronously_first() -> None:
    """training.inflight_warmup_steps: the first steps take a whole round trip each (forward and backward on
    both stages: 0.06 s), then the pipeline's period (one stage's 0.03 s)."""
    def run(warmup: int):
        clusters = [[stage(f"s{j}", 0.01, 0.02, act=1e3, grad=1e3) for j in range(2)]]
        return simulate(world(clusters, Settings(steps=100, inflight_warmup_steps=warmup)))

    opened, warm = run(0), run(20)
    assert warm.wall_s - opened.wall_s == pytest.approx(20 * (0.06 - 0.03), rel=0.05)
    assert warm.nodes[0].staleness_mean < opened.nodes[0].staleness_mean
    with pytest.raises(ValueError, match="inflight_warmup_steps"):
        Settings(inflight_warmup_steps=-1)


def test_a_slow_link_sets_the_period() -> None:
    """Two stages whose 1 MB activation crosses a 10 MB/s link: 0.1 s per micro-batch, not the compute."""
    def wall(steps: int) -> float:
        clusters = [[stage("a", 0.01, 0.01, act=1e6), stage("b", 0.01, 0.01, grad=1e3)]]
        return simulate(world(clusters, Settings(steps=steps, max_inflight=8), bandwidth=1e7, latency=0.02)).wall_s

    assert (wall(60) - wall(30)) / 30 == pytest.approx(0.1, rel=1e-9)


def test_compressed_messages_cross_a_slow_link_faster() -> None:
    """build_world counts a stage's messages as training.compress packs them: half the bytes, half the time."""
    blocks = [BlockProfile(name=n, param_bytes=1000, fwd_flops=1e6, bwd_flops=2e6, act_bytes_out=1_000_000,
                           memory_bytes=1 << 20) for n in ("x", "y")]
    nodes = [NodeProfile(name=n, flops=1e9, memory_bytes=GIB, bandwidth_bytes_per_s={m: 1e7 for m in "ab" if m != n},
                         latency_s={m: 0.0 for m in "ab" if m != n}) for n in "ab"]
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a", "b"], cuts=["y"])])

    def period(wire: float) -> float:
        walls = [simulate(build_world(plan, nodes, blocks, Settings(steps=n, max_inflight=8, pipeline_wire=wire,
                                                                   ring_wire=wire))).wall_s for n in (30, 60)]
        return (walls[1] - walls[0]) / 30

    assert period(1.0) == pytest.approx(0.1, rel=1e-9)   # 1 MB over 10 MB/s, both ways on separate uplinks
    assert period(0.5) == pytest.approx(0.05, rel=1e-9)
    world = build_world(Plan(epoch=0, clusters=[ClusterPlan(nodes=["a"]), ClusterPlan(nodes=["b"])]), nodes, blocks,
                        Settings(ring_wire=0.25, state_factor=2.0))
    assert [seg.nbytes for seg in world.segments] == [2000 * 2.0 * 0.25]


@pytest.mark.parametrize("clusters", [2, 3, 4])
@pytest.mark.parametrize("piece", [1 << 30, 1000])
def test_ring_sends_2_c_minus_1_over_c_of_the_segment_at_link_speed(clusters: int, piece: int) -> None:
    size, bandwidth = 1e6, 1e6
    segment = SegmentSpec(blocks=(0, 1), nbytes=size, holders=tuple(f"c{c}" for c in range(clusters)))
    r = simulate(world([[stage(f"c{c}", 0.0, 0.0)] for c in range(clusters)],
                       Settings(steps=1, sync_every=1, piece_bytes=piece), bandwidth=bandwidth, segments=[segment]))
    assert r.allreduce_seconds_mean == pytest.approx(2 * (clusters - 1) / clusters * size / bandwidth, rel=1e-9)
    for n in r.nodes:
        assert n.ring_bytes == pytest.approx(2 * (clusters - 1) / clusters * size)
        assert n.allreduce_rounds == 1


def test_fluid_ring_matches_the_piece_by_piece_one_without_latency() -> None:
    size = 4e6
    segment = SegmentSpec(blocks=(0, 1), nbytes=size, holders=("a", "b", "c"))
    exact = simulate(world([[stage(n, 0.0, 0.0)] for n in "abc"], Settings(steps=1, sync_every=1, piece_bytes=1000),
                           bandwidth=1e6, segments=[segment]))
    fluid = simulate(world([[stage(n, 0.0, 0.0)] for n in "abc"],
                           Settings(steps=1, sync_every=1, piece_bytes=1000, fluid_ring_pieces=10),
                           bandwidth=1e6, segments=[segment]))
    assert fluid.events < exact.events / 10
    assert fluid.allreduce_seconds_mean == pytest.approx(exact.allreduce_seconds_mean, rel=1e-3)


def test_streams_share_an_uplink_and_keep_their_order() -> None:
    q = EventQueue()
    uplink = SharedResource(q, 1e6)
    a, b = Connection(q, uplink, math.inf, 0.5), Connection(q, uplink, 4e5, 0.0)
    seen: list[tuple[str, float]] = []
    a.send(1e6, lambda: seen.append(("a1", q.now)))
    a.send(1e6, lambda: seen.append(("a2", q.now)))
    b.send(1e6, lambda: seen.append(("b", q.now)))
    q.run()
    # b is capped at 0.4 MB/s, a gets the other 0.6 MB/s while both send; a's messages leave in order
    times = dict(seen)
    assert times["b"] == pytest.approx(2.5)
    assert times["a1"] == pytest.approx(1e6 / 6e5 + 0.5)
    assert times["a2"] - 0.5 == pytest.approx((1e6 - 0.6e6 * (2.5 - 1e6 / 6e5)) / 6e5 + 2.5 + 0.0, rel=1e-9) \
        or times["a2"] > times["a1"]
    assert uplink.served == pytest.approx(3e6)


def test_shared_cores_slow_each_node_down() -> None:
    clusters = [[stage("a", 0.01, 0.01)], [stage("b", 0.01, 0.01)], [stage("c", 0.01, 0.01)]]
    alone = simulate(world(clusters, Settings(steps=30)))
    w = world(clusters, Settings(steps=30))
    w.hosts, w.host_cores = dict.fromkeys("abc", "pc"), {"pc": 2.0}
    shared = simulate(w)
    assert shared.samples_per_s == pytest.approx(alone.samples_per_s * 2 / 3, rel=1e-9)


# --- what ties ravq together


def test_averaging_lead_ties_a_fast_cluster_to_a_slow_one() -> None:
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e3, holders=("fast", "slow"))
    clusters = [[stage("fast", 0.005, 0.005)], [stage("slow", 0.02, 0.02)]]
    r = simulate(world(clusters, Settings(steps=100, sync_every=1, averaging_lead=1), bandwidth=1e9,
                       segments=[segment]))
    fast, slow = r.clusters
    assert fast.samples_per_s == pytest.approx(slow.samples_per_s, rel=0.05)
    assert r.nodes[0].averaging_wait_s > 0.5 * r.wall_s and r.nodes[1].averaging_wait_s < 0.01 * r.wall_s
    # a larger lead does not untie them: a node queues at most two rounds behind the running one
    queued = simulate(world(clusters, Settings(steps=100, sync_every=1, averaging_lead=100), bandwidth=1e9,
                            segments=[segment]))
    assert queued.clusters[0].samples_per_s == pytest.approx(queued.clusters[1].samples_per_s, rel=0.05)
    alone = simulate(world(clusters, Settings(steps=100, sync_every=1000), bandwidth=1e9, segments=[segment]))
    assert alone.clusters[0].samples_per_s == pytest.approx(4 * alone.clusters[1].samples_per_s)


def test_synchronous_averaging_waits_for_every_round() -> None:
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e6, holders=("a", "b"))
    clusters = [[stage("a", 0.01, 0.01)], [stage("b", 0.01, 0.01)]]
    r = simulate(world(clusters, Settings(steps=10, sync_every=1, overlap_averaging=False), bandwidth=1e7,
                       segments=[segment]))
    # each step: 0.02 s compute, then a round of 2(C-1)/C x 1 MB at 10 MB/s = 0.1 s
    assert r.wall_s == pytest.approx(10 * (0.02 + 0.1), rel=1e-9)
    assert r.nodes[0].allreduce_rounds == 10


def test_churn_costs_samples_per_second_and_every_cluster_finishes() -> None:
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e5, holders=("a0", "b0"))
    clusters = [[stage("a0", 0.5, 0.5, act=1e3), stage("a1", 0.5, 0.5, grad=1e3)],
                [stage("b0", 0.5, 0.5, act=1e3), stage("b1", 0.5, 0.5, grad=1e3)]]
    settings = Settings(steps=400, sync_every=5, ring_timeout_s=5.0, restart_s=20.0)
    calm = simulate(world(clusters, settings, bandwidth=1e8, segments=[segment]))
    stormy = simulate(world(clusters, dataclasses.replace(settings, churn_per_hour=6.0, seed=3), bandwidth=1e8,
                            segments=[segment]))
    assert sum(n.failures for n in stormy.nodes) > 0
    assert stormy.samples == calm.samples == 2 * 400 * settings.micro_batch
    assert stormy.samples_per_s < calm.samples_per_s
    assert sum(n.down_s for n in stormy.nodes) > 0


def test_jitter_makes_a_pipeline_idle() -> None:
    clusters = [[stage(f"s{j}", 0.01, 0.02) for j in range(3)]]
    even = simulate(world(clusters, Settings(steps=200)))
    uneven = simulate(world(clusters, Settings(steps=200, jitter=0.5, seed=1)))
    assert uneven.samples_per_s < even.samples_per_s
    assert max(n.busy_fraction for n in uneven.nodes) < 0.99


# --- from profiles and plans, and errors


def blocks(count: int = 6) -> list[BlockProfile]:
    return [BlockProfile(name=f"b{i}", param_bytes=1000, fwd_flops=1e9, bwd_flops=2e9, act_bytes_out=500,
                         memory_bytes=10_000) for i in range(count)]


def profiles(names: str) -> list[NodeProfile]:
    return [NodeProfile(name=n, flops=1e11, memory_bytes=GIB, bandwidth_bytes_per_s={m: 1e8 for m in names if m != n},
                        latency_s={m: 1e-3 for m in names if m != n}) for n in names]


def test_build_world_from_a_plan() -> None:
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a", "b"], cuts=["b3"]), ClusterPlan(nodes=["c"], cuts=[])])
    w = build_world(plan, profiles("abc"), blocks(), Settings(steps=10))
    a, b = w.clusters[0]
    assert (a.blocks, b.blocks) == ((0, 3), (3, 6))
    assert a.fwd_s == pytest.approx(3e9 / 1e11) and a.bwd_s == pytest.approx(6e9 / 1e11)
    assert (a.act_bytes, a.grad_bytes, b.act_bytes, b.grad_bytes) == (500, 0, 0, 500)
    assert [(s.blocks, s.holders) for s in w.segments] == [((0, 3), ("a", "c")), ((3, 6), ("b", "c"))]
    r = simulate(w)
    assert r.samples == 2 * 10 * 16 and r.samples_per_s > 0


def test_stages_of_a_built_world_pay_for_their_messages() -> None:
    """Each stage's forward and backward take half of its messages' time (``NodeProfile.message_s``)
    on top of its FLOPs: a cut costs a stage half an activation's and half a gradient's message; the
    simulated pipeline runs at the pace of the stage that pays the most, as the cost model says."""
    from ravq.planner import evaluate_plan

    nodes = [dataclasses.replace(n, message_s=((100, 0.01), (1000, 0.02))) for n in profiles("abc")]
    plan = Plan(epoch=0, clusters=[ClusterPlan(nodes=["a", "b", "c"], cuts=["b2", "b4"])])
    w = build_world(plan, nodes, blocks(), Settings(steps=40))
    a, b, c = w.clusters[0]
    each = 0.01 + 0.01 * 400 / 900                            # a 500-byte message, interpolated
    assert a.fwd_s == pytest.approx(2e9 / 1e11 + each / 2) and a.bwd_s == pytest.approx(4e9 / 1e11 + each / 2)
    assert b.fwd_s == pytest.approx(2e9 / 1e11 + each) and b.bwd_s == pytest.approx(4e9 / 1e11 + each)
    assert c.fwd_s == pytest.approx(a.fwd_s) and c.bwd_s == pytest.approx(a.bwd_s)
    measured = simulate(w).samples_per_s
    predicted = evaluate_plan(plan, nodes, blocks(), micro_batch=Settings().micro_batch,
                              sync_every=Settings().sync_every, max_inflight=Settings().max_inflight).samples_per_s
    assert measured == pytest.approx(predicted, rel=0.1)
    plain = simulate(build_world(plan, profiles("abc"), blocks(), Settings(steps=40))).samples_per_s
    assert plain > measured * 1.1


@pytest.mark.parametrize(("clusters", "message"), [
    ([ClusterPlan(nodes=["a", "z"], cuts=["b3"])], "no profile for node 'z'"),
    ([ClusterPlan(nodes=["a", "b"], cuts=["nope"])], "'nope' is not a block"),
    ([ClusterPlan(nodes=["a", "b", "c"], cuts=["b4", "b2"])], "increasing cuts"),
    ([ClusterPlan(nodes=["a"], cuts=[]), ClusterPlan(nodes=["a"], cuts=[])], "appears twice"),
])
def test_build_world_names_the_mistake(clusters: list[ClusterPlan], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_world(Plan(epoch=0, clusters=clusters), profiles("abc"), blocks(), Settings())


@pytest.mark.parametrize(("field", "value"), [("steps", 0), ("sync_every", 0), ("churn_per_hour", -1.0),
                                              ("max_inflight", 0), ("jitter", -0.1),
                                              ("pipeline_wire", 0.0), ("ring_wire", 1.5)])
def test_settings_name_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Settings(**{field: value})


def test_worldwide_world_and_naive_plan() -> None:
    nodes, regions = worldwide_nodes(16, seed=1)
    assert len(set(regions)) == 8 and len(nodes) == 16
    a, b = nodes[0], nodes[15]
    assert a.latency_s[b.name] > 0 and a.bandwidth_bytes_per_s[b.name] <= 1e9 / 8
    model = transformer_blocks(layers=4)
    plan = naive_plan(nodes, model, max_inflight=2)
    r = simulate(build_world(plan, nodes, model, Settings(steps=5, max_inflight=2, sync_every=5)))
    assert r.samples == 5 * 16 * len(plan.clusters)


# --- the command


def write_case(tmp_path: Path) -> tuple[Path, Path]:
    ports = iter(range(27100, 27200))
    nodes = [{"name": n, "host": "127.0.0.1", "pipeline_port": next(ports), "ring_port": next(ports),
              "memory_bytes": GIB, "flops": f, "bandwidth_bytes_per_s": 1e8} for n, f in (("a", 1e10), ("b", 2e10),
                                                                                      ("c", 4e10))]
    topo = tmp_path / "t.yaml"
    topo.write_text(yaml.safe_dump({"task": "tests.tasks_for_tests", "training": {"micro_batch": 4, "sync_every": 2,
                                                                                "steps": 20},
                                    "broker": {"pub_port": 27098, "router_port": 27099}, "nodes": nodes}))
    assert main(["plan", "--topology", str(topo), "--profiles", str(tmp_path / "none"),
                 "--out", str(tmp_path / "plan.yaml")]) == 0
    return topo, tmp_path / "plan.yaml"


def test_simulate_command_prints_tables_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo, plan = write_case(tmp_path)
    capsys.readouterr()
    out_json = tmp_path / "sim.json"
    assert main(["simulate", "--topology", str(topo), "--profiles", str(tmp_path / "none"), "--plan", str(plan),
                 "--steps", "30", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "busy" in out and "allreduce s" in out
    data = json.loads(out_json.read_text())
    planned = load_plan(plan)
    assert data["samples"] == 30 * 4 * len(planned.clusters)
    assert {n["name"] for n in data["nodes"]} == {n for c in planned.clusters for n in c.nodes}
    assert data["samples_per_s"] > 0 and all(0 < n["busy_fraction"] <= 1 for n in data["nodes"])


def test_simulate_command_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo, plan = write_case(tmp_path)
    capsys.readouterr()
    args = ["simulate", "--topology", str(topo), "--profiles", str(tmp_path / "none"), "--plan"]
    assert main([*args, str(plan), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().out
    assert main([*args, str(plan), "--churn", "-1"]) == 2
    assert "--churn" in capsys.readouterr().out
    assert main([*args, str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"plan": {"epoch": 0, "clusters": [{"nodes": ["a", "zz"], "cuts": ["fc2"]}]}}))
    assert main([*args, str(bad)]) == 2
    assert "zz" in capsys.readouterr().out


def test_plan_simulate_ranks_candidates_by_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo, _ = write_case(tmp_path)
    capsys.readouterr()
    assert main(["plan", "--topology", str(topo), "--profiles", str(tmp_path / "none"), "--out",
                 str(tmp_path / "sim-plan.yaml"), "--simulate", "--candidates", "3", "--sim-steps", "20"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out and "chosen by simulation" in out
    lines = [line.split() for line in out.splitlines()[1:] if line[:4].strip().isdigit()]
    rates = [float(parts[-2]) for parts in lines]
    assert rates == sorted(rates, reverse=True) and rates
    plan = load_plan(tmp_path / "sim-plan.yaml")
    assert plan.predicted_samples_per_s == pytest.approx(rates[0], rel=1e-3)
    assert main(["plan", "--topology", str(topo), "--profiles", str(tmp_path / "none"), "--out",
                 str(tmp_path / "x.yaml"), "--simulate", "--candidates", "0"]) == 2


def test_a_long_fluid_ring_round_is_not_taken_for_a_dead_one() -> None:
    """A round streaming for longer than ring_timeout_s makes progress all along: it must finish."""
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e8, holders=("a", "b"))
    r = simulate(world([[stage("a", 0.0, 0.0)], [stage("b", 0.0, 0.0)]],
                       Settings(steps=1, sync_every=1, fluid_ring_pieces=1, ring_timeout_s=30.0), bandwidth=1e6,
                       segments=[segment]))
    assert [n.allreduce_rounds for n in r.nodes] == [1, 1] and not any(n.allreduce_aborts for n in r.nodes)
    assert r.allreduce_seconds_mean == pytest.approx(1e8 / 1e6, rel=1e-3)


def test_plan_candidates_start_with_make_plans_choice() -> None:
    from ravq.planner import make_plan, plan_candidates

    nodes = [NodeProfile(name=f"n{i}", flops=f, memory_bytes=GIB, bandwidth_bytes_per_s={f"n{j}": 1e8 for j in range(5)
                                                                                            if j != i})
             for i, f in enumerate((1e11, 2e11, 4e11, 1e11, 3e11))]
    settings = {"micro_batch": 4, "sync_every": 5}
    best, explanation = make_plan(nodes, blocks(), **settings)
    found = plan_candidates(nodes, blocks(), count=3, **settings)
    assert found[0][0] == best and found[0][1].samples_per_s == explanation.samples_per_s
    keys = [tuple(sorted(tuple(sorted(c.nodes)) for c in p.clusters)) for p, _ in found]
    assert len(set(keys)) == len(keys)


def test_update_every_and_sync_every_count_versions() -> None:
    """An optimizer step every 2 backwards; a round every 3 versions: 12 micro-batches -> 6 versions, 2 rounds."""
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e3, holders=("a", "b"))
    r = simulate(world([[stage("a", 0.01, 0.01)], [stage("b", 0.01, 0.01)]],
                       Settings(steps=12, update_every=2, sync_every=3), bandwidth=1e9, segments=[segment]))
    assert [(n.updates, n.version, n.allreduce_rounds) for n in r.nodes] == [(6, 6, 2), (6, 6, 2)]


def test_stages_pay_averaging_cpu_for_the_optimizer_state_they_average() -> None:
    """With ``average_optimizer_state`` a ring averages a parameter and Adam's two moments: the settings
    of such a topology carry three values a parameter, and each stage's averaging CPU is three times
    the parameters-only charge, as the cost model's (``Wire.state``)."""
    from ravq.cli.simulate import settings_for
    from ravq.config import parse_topology
    from ravq.simulate.world import stage_averaging_s

    topo = {"task": "tests.sgd_task", "broker": {"pub_port": 5550, "router_port": 5551},
            "nodes": [{"name": "a", "pipeline_port": 5560, "ring_port": 5561}]}
    assert settings_for(parse_topology(topo)).state_factor == 1.0
    with_state = parse_topology({**topo, "training": {"average_optimizer_state": True}})
    assert settings_for(with_state).state_factor == 3.0
    node = dataclasses.replace(profiles("a")[0], ring_s_per_byte=1e-9)
    plain = stage_averaging_s(node, blocks(), 0, 3, 2, 10)
    assert plain > 0
    assert stage_averaging_s(node, blocks(), 0, 3, 2, 10, state_factor=3.0) == pytest.approx(3 * plain)


# --- rounds counted from the plan epoch, membership changes, groups (issue #38)


def three_solo(settings: Settings, nbytes: float = 1e6) -> World:
    segment = SegmentSpec(blocks=(0, 1), nbytes=nbytes, holders=("a", "b", "c"))
    return world([[stage("a", 0.01, 0.01)], [stage("b", 0.01, 0.01)], [stage("c", 0.01, 0.01)]], settings,
                 bandwidth=1e7, segments=[segment])


def test_a_lost_cluster_abandons_every_open_round_at_once_and_rounds_count_from_the_new_epoch() -> None:
    """Cluster c fails at 1 s; lost_s later the broker takes it out of the rings (a new plan epoch): the open
    round of a and b is abandoned then, not after ring_step_s (30 s), and a and b average on between
    themselves; c rejoins (another epoch) and averages again although its version differs from theirs."""
    from ravq.simulate import Simulation, collect

    settings = Settings(steps=400, sync_every=5, lost_s=0.5, restart_s=2.0, ring_timeout_s=30.0)
    sim = Simulation(three_solo(settings))
    sim.q.at(1.0, sim.churn.fail, sim.nodes["c"])
    sim.run(until=1.0)
    before = [n.rounds_done for n in sim.nodes.values()]
    sim.q.run()
    r = collect(sim)
    a, b, c = r.nodes
    assert c.failures == 1 and r.plan_epochs == 3           # c out, c back in, a and b done before c
    assert a.allreduce_aborts >= 1 and b.allreduce_aborts >= 1
    assert r.wall_s < settings.ring_timeout_s                 # nobody waited for a ring step's timeout
    assert a.allreduce_rounds - before[0] > 50 and c.allreduce_rounds - before[2] > 50
    assert c.version > a.version                            # c took a's version at its rejoin, and trained on


def test_groups_average_within_their_group_each_round() -> None:
    """Four clusters in groups of two: each ring has 2 members, so a node sends 2(2-1)/2 = 1 segment a round,
    not 2(4-1)/4 = 1.5 as one ring over all four."""
    names = "abcd"
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e6, holders=tuple(names))
    clusters = [[stage(n, 0.01, 0.01)] for n in names]
    for mode, share in (("global", 1.5), ("groups", 1.0)):
        settings = Settings(steps=20, sync_every=5, averaging_mode=mode, group_size=2)
        r = simulate(world(clusters, settings, bandwidth=1e8, segments=[segment]))
        for n in r.nodes:
            assert n.allreduce_rounds == 4
            assert n.ring_bytes == pytest.approx(4 * share * 1e6)


def test_a_later_stage_ends_when_it_next_wakes_after_stage_0_finished() -> None:
    """ravq's compute thread waits for work at most ``finish_poll_s``: a later stage done with its micro-batches
    sees stage 0's finish at the end of that wait, and its wall time runs until then."""
    clusters = [[stage("s0", 0.01, 0.02, act=1e3), stage("s1", 0.01, 0.02, grad=1e3)]]
    at_once = simulate(world(clusters, Settings(steps=50)))
    polled = simulate(world(clusters, Settings(steps=50, finish_poll_s=0.5)))
    # s1 went idle after its last backward; stage 0's last backward (0.02 s) came after it
    assert polled.nodes[1].wall_s == pytest.approx(at_once.nodes[1].wall_s + 0.5, rel=1e-9)
    assert polled.samples_per_s < at_once.samples_per_s


def test_in_groups_mode_a_lost_cluster_abandons_only_the_rounds_of_groups_it_touches() -> None:
    """Four clusters; d fails.  In global mode the membership change abandons every open round; in groups of
    two only those of d's group (``RoundGroups.touched``): a and b, c lose fewer rounds."""
    from ravq.simulate import Simulation, collect

    names = "abcd"
    segment = SegmentSpec(blocks=(0, 1), nbytes=1e6, holders=tuple(names))
    aborts = {}
    for mode in ("global", "groups"):
        settings = Settings(steps=300, sync_every=5, lost_s=0.5, restart_s=2.0, averaging_mode=mode, group_size=2)
        sim = Simulation(world([[stage(n, 0.01, 0.01)] for n in names], settings, bandwidth=1e7,
                               segments=[segment]))
        for t in (1.03, 3.51):
            sim.q.at(t, sim.churn.fail, sim.nodes["d"])
        sim.run()
        r = collect(sim)
        assert r.plan_epochs >= 4
        aborts[mode] = sum(n.allreduce_aborts for n in r.nodes if n.name != "d")
    assert aborts["global"] >= 6 and aborts["groups"] < aborts["global"]


def test_a_node_back_before_lost_s_still_takes_its_cluster_out_of_the_rings_when_it_registers() -> None:
    """Restarted within lost_s, the node's new process registers and the broker pauses its cluster: the rings
    change then (an epoch, open rounds abandoned) and again when the cluster trains (bench_churn's kills)."""
    from ravq.simulate import Simulation, collect

    settings = Settings(steps=400, sync_every=5, lost_s=6.0, restart_s=2.0, ring_timeout_s=30.0)
    sim = Simulation(three_solo(settings))
    sim.q.at(1.0, sim.churn.fail, sim.nodes["c"])
    sim.run()
    r = collect(sim)
    assert r.plan_epochs == 3                               # c out at its restart, back in, a and b done first
    assert sum(n.allreduce_aborts for n in r.nodes) >= 2 and r.wall_s < settings.ring_timeout_s


def test_a_stage_holding_back_for_a_silent_cluster_trains_on_after_hold_s() -> None:
    """c fails; a and b hold back for their round with c only hold_s, then train on and queue rounds (up to
    the queue's limit), which the exclusion lost_s later abandons (``Averager._gone``); without the
    release they wait for the exclusion with one round open."""
    from ravq.simulate import Simulation, collect

    versions, aborts = {}, {}
    for hold_s in (0.2, 100.0):
        settings = Settings(steps=400, sync_every=5, lost_s=5.0, restart_s=20.0, hold_s=hold_s)
        sim = Simulation(three_solo(settings))
        sim.q.at(1.0, sim.churn.fail, sim.nodes["c"])
        sim.run(until=5.9)
        versions[hold_s] = sim.nodes["a"].version
        sim.q.run(6.5)
        aborts[hold_s] = collect(sim).nodes[0].allreduce_aborts
    assert versions[0.2] >= versions[100.0] + 10               # two more rounds' steps before the queue fills
    assert aborts[0.2] >= 3 and aborts[100.0] == 1           # the open round, and the queued ones skipped
