"""``training.batch`` (issue #39 part 1): the user states samples per optimizer step over all clusters; ravq
derives the accumulation from it, the micro-batch and the plan's clusters, and names what does not divide."""

from __future__ import annotations

from typing import Any

import pytest

from ravq.config import ConfigError, TrainingConfig, parse_topology
from ravq.config.batch import for_clusters, staleness_bound, update_every


def _topology(training: dict[str, Any], clusters: list[int | None]) -> dict[str, Any]:
    nodes = [{"name": f"n{i}", "pipeline_port": 5600 + 10 * i, "ring_port": 5601 + 10 * i}
             | ({} if c is None else {"cluster": c, "stage": sum(1 for d in clusters[:i] if d == c)})
             for i, c in enumerate(clusters)]
    return {"task": "ravq.tasks.charlm", "training": training,
            "broker": {"host": "127.0.0.1", "pub_port": 5550, "router_port": 5551}, "nodes": nodes}


@pytest.mark.parametrize(("batch", "micro_batch", "clusters", "want"),
                         [(64, 16, 1, 4), (64, 16, 2, 2), (64, 16, 4, 1), (96, 8, 3, 4)])
def test_the_accumulation_is_the_batch_over_micro_batch_and_clusters(batch: int, micro_batch: int,
                                                                       clusters: int, want: int) -> None:
    training = TrainingConfig(batch=batch, micro_batch=micro_batch)
    assert update_every(training, clusters) == want
    assert for_clusters(training, clusters).update_every == want
    assert for_clusters(training, clusters).batch == batch


def test_without_a_batch_update_every_is_as_set() -> None:
    training = TrainingConfig(update_every=3)
    assert update_every(training, 4) == 3 and for_clusters(training, 4) is training


def test_a_batch_that_does_not_divide_names_the_sizes_and_the_nearest_batches() -> None:
    with pytest.raises(ValueError, match=r"training.batch: 60 samples .* micro_batch 16 .* set batch to 48 "
                                         r"\(3 micro-batches .*\) or 64 \(4 micro-batches"):
        TrainingConfig(batch=60, micro_batch=16)
    training = TrainingConfig(batch=64, micro_batch=16)
    with pytest.raises(ConfigError, match=r"micro_batch x clusters = 16 x 3 = 48 .* set batch to 48 .* or 96"):
        update_every(training, 3)
    with pytest.raises(ValueError, match=r"set batch to 16 \(1 micro-batches"):
        TrainingConfig(batch=8, micro_batch=16)


def test_batch_and_update_every_are_one_setting() -> None:
    with pytest.raises(ValueError, match="set batch .* or update_every .*, not both"):
        TrainingConfig(batch=64, micro_batch=16, update_every=4)
    assert TrainingConfig(batch=64, micro_batch=16).update_every == 1  # derived per plan, not at parse


def test_a_topology_whose_nodes_name_their_clusters_is_checked_at_load() -> None:
    ok = parse_topology(_topology({"micro_batch": 8, "batch": 64}, [0, 0, 1, 1]), resolve_task=False)
    assert update_every(ok.training, 2) == 4
    with pytest.raises(ConfigError, match=r"training.batch: 72 .* 8 x 2 = 16"):
        parse_topology(_topology({"micro_batch": 8, "batch": 72}, [0, 0, 1, 1]), resolve_task=False)
    # the planner chooses the clusters: checked by each node against its plan
    planned = parse_topology(_topology({"micro_batch": 8, "batch": 72}, [None, None, None]), resolve_task=False)
    assert planned.training.batch == 72


def test_staleness_in_updates_is_micro_batches_in_flight_over_those_an_update_sums() -> None:
    assert staleness_bound(2, 1) == 1.0 and staleness_bound(4, 4) == 0.75 and staleness_bound(1, 1) == 0.0


def test_a_stage_built_from_a_batch_sums_its_share_of_micro_batches() -> None:
    from ravq.metrics import Metrics
    from ravq.stage.build import build_stage
    from ravq.tasks import charlm

    training = TrainingConfig(micro_batch=2, steps=4, batch=12)
    built = build_stage(charlm, training, seed=0, cuts=[], stage=0, cluster=0, clusters=2, device="cpu",
                        metrics=Metrics("batch"))
    assert built.worker.options.update_every == 3
    with pytest.raises(ConfigError, match="micro_batch x clusters = 2 x 4 = 8"):
        build_stage(charlm, training, seed=0, cuts=[], stage=0, cluster=0, clusters=4, device="cpu",
                    metrics=Metrics("batch"))


def test_the_simulator_sums_as_many_micro_batches_per_step_as_the_nodes_will(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ravq.cli import simulate as cli_simulate
    from ravq.config import ClusterPlan, Plan

    topology = parse_topology(_topology({"micro_batch": 8, "batch": 64}, [None, None]), resolve_task=False)
    seen = []

    def world(plan: Plan, nodes: Any, blocks: Any, settings: Any, **_: Any) -> Any:
        seen.append(settings.update_every)
        raise ValueError("enough")

    monkeypatch.setattr(cli_simulate, "build_world", world)
    for clusters, want in ((1, 8), (2, 4)):
        plan = Plan(clusters=[ClusterPlan(nodes=[f"n{c}"], cuts=[]) for c in range(clusters)])
        with pytest.raises(ConfigError, match="enough"):
            cli_simulate.run_simulation(topology, plan, [], [], cli_simulate.settings_for(topology))
        assert seen[-1] == want


def test_profiling_measures_micro_batches_whatever_batch_the_run_states(tmp_path: Any) -> None:
    """The profiler builds stages and rings of its own micro-batches and members: the run's batch (which
    need not divide them) is not theirs."""
    from ravq.profile import averaging_cost
    from tests.test_profile import one_node_topology

    topology = one_node_topology(tmp_path, False, {"micro_batch": 3, "batch": 6})
    ring = averaging_cost._ring_topology(topology, "a")  # micro-batches of 2, two members: 6 does not divide
    assert ring.training.batch is None and update_every(ring.training, 2) == 1
