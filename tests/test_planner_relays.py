"""The planner and the simulator price relayed links (issue #24): a link between two nodes behind NAT runs
through a relay whose bandwidth every link through it shares."""

from __future__ import annotations

from ravq.config import ClusterPlan, Plan, Topology
from ravq.config.routes import relays
from ravq.planner import BlockProfile, cut_plan
from ravq.planner.relays import plan_links, plan_with_relays, priced_profiles, relayed_links
from ravq.planner.types import NodeProfile

GIB = 1 << 30
MB = 1e6
NAMES = ("a1", "a2", "b1", "b2")


def _topology(behind_nat: tuple[str, ...], relay_mb_s: float) -> Topology:
    return Topology.model_validate({
        "task": "tasks_for_tests", "broker": {"pub_port": 5500, "router_port": 5501},
        "nodes": [{"name": n, "pipeline_port": 5510 + 2 * i, "ring_port": 5511 + 2 * i, "cluster": i // 2,
                   "stage": i % 2, **({"reachable": False} if n in behind_nat else {})} for i, n in enumerate(NAMES)],
        "relays": [{"name": "r", "host": "10.0.0.9", "port": 6000, "bandwidth_bytes_per_s": relay_mb_s * MB}]})


def _nodes(link_mb_s: float) -> list[NodeProfile]:
    return [NodeProfile(name=n, flops=1e12, memory_bytes=8 * GIB, latency_s={p: 0.01 for p in NAMES if p != n},
                        bandwidth_bytes_per_s={p: link_mb_s * MB for p in NAMES if p != n}) for n in NAMES]


BLOCKS = [BlockProfile(name=f"b{i}", param_bytes=1 << 20, fwd_flops=1e9, bwd_flops=2e9, act_bytes_out=4_000_000,
                       memory_bytes=GIB) for i in range(4)]
PLAN = Plan(clusters=[ClusterPlan(nodes=["a1", "a2"], cuts=["x"]), ClusterPlan(nodes=["b1", "b2"], cuts=["x"])])


def test_links_of_a_plan_and_which_are_relayed() -> None:
    assert plan_links(PLAN) == [("pipeline", "a1", "a2"), ("pipeline", "b1", "b2"), ("ring", "a1", "b1"),
                                ("ring", "a2", "b2")]
    points = relays(_topology((), 10))
    assert relayed_links(PLAN, {"a1", "a2", "b1"}, points) == [("pipeline", "a1", "a2", "r"), ("ring", "a1", "b1", "r")]


def test_links_through_one_relay_share_its_bandwidth() -> None:
    points = relays(_topology((), 10))
    relayed = relayed_links(PLAN, set(NAMES), points)
    priced = {n.name: n for n in priced_profiles(_nodes(100), relayed, points)}
    assert priced["a1"].bandwidth_bytes_per_s["a2"] == 10 * MB / 4  # four links through the relay
    assert priced["a1"].bandwidth_bytes_per_s["b2"] == 100 * MB  # not a link of the plan
    fast_relay = {n.name: n for n in priced_profiles(_nodes(5), relayed, relays(_topology((), 1000)))}
    assert fast_relay["b1"].bandwidth_bytes_per_s["b2"] == 5 * MB  # the nodes' own links stay the cap


def test_the_planner_predicts_the_cost_of_a_slow_relay() -> None:
    def make(topology: Topology) -> tuple[Plan, float, list[tuple[str, str, str, str]]]:
        plan, explanation, relayed = plan_with_relays(
            topology, _nodes(100),
            lambda nodes: cut_plan([["a1", "a2"], ["b1", "b2"]], nodes, BLOCKS, micro_batch=8, sync_every=10))
        return plan, explanation.samples_per_s, relayed

    _, open_rate, none = make(_topology((), 10))
    _, nat_rate, relayed = make(_topology(NAMES, 10))
    _, fast_relay_rate, _ = make(_topology(NAMES, 10_000))
    assert none == [] and {r[0] for r in relayed} == {"pipeline", "ring"}
    assert nat_rate < 0.5 * open_rate  # the pipeline links get 10/4 MB/s of the relay instead of 100
    assert fast_relay_rate == open_rate  # a relay faster than the links costs nothing in this model
