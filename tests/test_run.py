"""The run as a durable object, without processes: the broker's run state, which checkpoints belong
together, refusing another run's checkpoints, a leave in the book, weights that only move forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from brokers.book import Book
from brokers.run import RUN_FILE, open_run, save_run, state_dir_for
from ravq.config import ClusterPlan, ConfigError, Plan
from ravq.metrics import Metrics
from ravq.net.protocol import Heartbeat
from ravq.persist import checkpoint
from ravq.persist.checkpoint import CheckpointError, save_stage
from ravq.persist.export import export_cluster
from ravq.persist.lineage import Point, coexisted, consistent_choice, older
from ravq.swarm.resume import check_run

PLAN = Plan(clusters=[ClusterPlan(nodes=["a0", "a1"], cuts=["l3"]), ClusterPlan(nodes=["b0", "b1"], cuts=["l3"])])


# ---------------------------------------------------------------- the broker's run state
def test_a_restarted_broker_continues_the_run_and_new_run_is_explicit(tmp_path: Path) -> None:
    first = open_run(tmp_path, PLAN, new_run=False)
    assert not first.explicit and (tmp_path / RUN_FILE).exists()
    again = open_run(tmp_path, PLAN, new_run=False)  # a reboot of the broker's PC
    assert again.run_id == first.run_id and again.plan.epoch > first.plan.epoch
    fresh = open_run(tmp_path, PLAN, new_run=True)
    assert fresh.run_id != first.run_id and fresh.explicit
    assert open_run(tmp_path, PLAN, new_run=False).run_id == fresh.run_id  # and that one survives too


def test_the_run_keeps_a_standby_replacement_across_broker_restarts(tmp_path: Path) -> None:
    run = open_run(tmp_path, PLAN, new_run=False)
    replaced = [PLAN.clusters[0], ClusterPlan(nodes=["b0", "spare"], cuts=["l3"])]
    run.plan = run.plan.model_copy(update={"clusters": replaced, "epoch": run.plan.epoch + 1, "excluded": [1]})
    save_run(tmp_path, run)
    again = open_run(tmp_path, PLAN, new_run=False)
    assert again.plan.clusters[1].nodes == ["b0", "spare"] and again.plan.excluded == []
    assert again.plan.epoch > run.plan.epoch


def test_a_plan_with_other_cuts_needs_a_new_run(tmp_path: Path) -> None:
    open_run(tmp_path, PLAN, new_run=False)
    other = Plan(clusters=[ClusterPlan(nodes=["a0", "a1"], cuts=["l5"]), PLAN.clusters[1]])
    with pytest.raises(ConfigError, match="cuts the model differently.*--new-run") as err:
        open_run(tmp_path, other, new_run=False)
    assert "\n" not in str(err.value)
    assert open_run(tmp_path, other, new_run=True).base == other


def test_the_broker_keeps_the_run_by_default_next_to_the_checkpoints_or_in_the_units_state_directory(
        tmp_path: Path) -> None:
    """The topology a user writes first (no broker.state_dir) survives a restart of the broker: the state
    goes to the unit's StateDirectory= (systemd sets $STATE_DIRECTORY), else next to the checkpoints;
    only a topology without checkpoints (nothing to resume) keeps the run in the process alone."""
    ckpt, unit = str(tmp_path / "ckpt"), str(tmp_path / "var-lib-ravq")
    assert state_dir_for(None, ckpt, {}) == str(tmp_path / "ckpt" / "broker")
    assert state_dir_for(None, ckpt, {"STATE_DIRECTORY": f"{unit}:{tmp_path}/other"}) == f"{unit}/broker"
    assert state_dir_for("/srv/state", ckpt, {"STATE_DIRECTORY": unit}) == "/srv/state"  # the topology's wins
    assert state_dir_for(None, None, {}) is None
    first = open_run(state_dir_for(None, ckpt, {}), PLAN, new_run=False)
    again = open_run(state_dir_for(None, ckpt, {}), PLAN, new_run=False)  # the broker after a power cut
    assert again.run_id == first.run_id and again.plan.epoch > first.plan.epoch
    assert open_run(state_dir_for(None, ckpt, {}), PLAN, new_run=True).run_id != first.run_id


def test_a_default_state_directory_the_broker_cannot_write_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file where the checkpoint directory should be")
    with pytest.raises(ConfigError, match="cannot keep the run's state there.*broker.state_dir") as err:
        open_run(state_dir_for(None, str(tmp_path / "ckpt"), {}), PLAN, new_run=False)
    assert "\n" not in str(err.value)


def test_a_corrupt_run_state_is_one_line(tmp_path: Path) -> None:
    (tmp_path / RUN_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the run state"):
        open_run(tmp_path, PLAN, new_run=False)


# ---------------------------------------------------------------- which checkpoints belong together
def test_the_newest_set_that_coexisted_is_chosen() -> None:
    # a power cut between the stages' saves of trained 80: stage 1 saved it, stage 0 did not
    stage0 = [Point(version=40, trained=40, window=2), Point(version=0, trained=0, window=2)]
    stage1 = [Point(version=80, trained=80, window=2), Point(version=40, trained=40, window=2)]
    assert not coexisted([stage0[0], stage1[0]])
    assert consistent_choice([stage0, stage1]) == [0, 1]
    # stages stopped a few micro-batches apart (within the window) coexisted
    assert consistent_choice([[Point(version=103, trained=101, window=2)], [Point(version=104, trained=103,
                                                                                       window=2)]]) == [0, 0]
    assert consistent_choice([[Point(version=10, trained=10, window=2)], [Point(version=90, trained=90,
                                                                                     window=2)]]) is None


def test_weights_only_move_forward() -> None:
    own = {"run_id": "r", "version": 130}
    assert older(own, {"h": {"run_id": "r", "version": 131}}) is None
    assert "no holder is fresher (h at 45)" in (older(own, {"h": {"run_id": "r", "version": 45}}) or "")
    assert "another run" in (older(own, {"h": {"run_id": "q", "version": 900}}) or "")
    assert older(own, {}) is not None


def _save(root: Path, stage: int, version: int, trained: int, run_id: str = "r") -> None:
    torch.manual_seed(1000 * stage + version)
    module = torch.nn.Linear(4, 4) if stage == 0 else torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 2))
    save_stage(root, cluster=0, stage=stage, num_stages=2, node=f"n{stage}", module=module,
               optimizer=torch.optim.SGD(module.parameters(), lr=0.1), version=version, data_position=trained,
               run_id=run_id, cluster_nodes=["n0", "n1"], extra={"trained": trained, "window": 2})


def test_export_takes_the_stages_that_coexisted_and_refuses_versions_that_never_did(tmp_path: Path) -> None:
    for v in (40, 80):
        _save(tmp_path, 1, v, v)
    _save(tmp_path, 0, 40, 40)  # the power cut came before stage 0 saved 80
    out = tmp_path / "m.safetensors"
    info = export_cluster(tmp_path, out, 0)
    assert info["versions"] == [40, 40]
    for v in (120, 160):
        _save(tmp_path, 1, v, v)  # stage 1's two checkpoints are both newer than anything stage 0 has
    with pytest.raises(CheckpointError, match=r"never coexisted \(stage 0: v40 \(trained 40\); "
                                              r"stage 1: v160 \(trained 160\), v120") as err:
        export_cluster(tmp_path, out, 0)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- another run's checkpoints
def test_a_checkpoint_of_another_run_is_refused_in_one_line_or_set_aside_after_new_run(tmp_path: Path) -> None:
    _save(tmp_path, 0, 40, 40, run_id="old")
    _save(tmp_path, 0, 80, 80, run_id="old")
    with pytest.raises(CheckpointError, match="checkpoints of run old, but the broker runs new") as err:
        check_run(str(tmp_path), cluster=0, stage=0, run_id="new", explicit=False, name="n0")
    assert "\n" not in str(err.value) and "--new-run" in str(err.value)
    assert checkpoint.load_stage(tmp_path, 0, 0).meta["version"] == 80  # untouched
    assert check_run(str(tmp_path), cluster=0, stage=0, run_id="new", explicit=True, name="n0") == []
    kept = tmp_path / "cluster0" / "run-old"
    assert sorted(p.name for p in kept.iterdir()) == ["stage0.json", "stage0.prev.json", "stage0.prev.safetensors",
                                                      "stage0.safetensors"]
    assert json.loads((kept / "stage0.json").read_text())["version"] == 80
    _save(tmp_path, 0, 10, 10, run_id="new")
    assert check_run(str(tmp_path), cluster=0, stage=0, run_id="new", explicit=False,
                     name="n0") == [{"version": 10, "trained": 10, "window": 2}]


def test_a_resumed_stage_exports_its_version_and_samples_before_its_first_step(tmp_path: Path) -> None:
    from ravq.swarm.resume import load
    from tests import models_for_tests as skipnet
    from tests.pipeline_harness import make_workers, run_workers

    trained = make_workers(skipnet, 1, steps=7, max_inflight=1, cluster=0)
    run_workers(trained)
    w = trained[0]
    checkpoint.save_stage(tmp_path, cluster=0, stage=0, num_stages=1, node="n0", module=w.module,
                          optimizer=w.optimizer, version=w.version, data_position=w.trained_prefix, run_id="r",
                          extra={"trained": w.trained})
    fresh = make_workers(skipnet, 1, steps=20, max_inflight=1, cluster=0)[0]
    metrics = Metrics("n0")
    assert load(fresh, str(tmp_path), cluster=0, stage=0, update_every=1, name="n0", run_id="r", version=None,
                metrics=metrics, micro_batch=4)
    assert fresh.version == 7
    assert metrics.total("ravq_weight_version") == 7 and metrics.total("ravq_samples_total") == 7 * 4
    assert not load(fresh, str(tmp_path), cluster=0, stage=0, update_every=1, name="n0", run_id="other",
                    version=None, metrics=Metrics("n1"), micro_batch=4)


# ---------------------------------------------------------------- leaving is not finishing
def _started(**kw: float) -> Book:
    book = Book(PLAN, lost_s=5.0, now=0.0, **kw)
    for n in ("a0", "a1", "b0", "b1"):
        book.register(n, f"i-{n}", 0.0)
    for n in ("a0", "a1", "b0", "b1"):
        book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="training", generation=0), 1.0)
    book.check(1.0)
    return book


def test_a_node_that_leaves_pauses_its_cluster_at_once_and_rejoins_when_back() -> None:
    book = _started()
    # the leave arrives at t=1.2: the cluster pauses in that very heartbeat, not lost_s later
    assert book.heartbeat("b1", Heartbeat(incarnation="i-b1", phase="leaving", generation=0, left=True), 1.2)
    assert book.members["b1"].state == "left" and book.clusters[1].state == "paused"
    assert book.clusters[1].reason == "b1 left" and book.excluded() == [1]
    assert book.clusters[0].state == "training"
    for n in ("a0", "a1", "b0"):
        book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="paused" if n == "b0" else "training",
                                    generation=1 if n == "b0" else 0), 59.0)
    book.check(60.0)  # silent since, but it said goodbye: left, never lost
    assert book.members["b1"].state == "left"
    book.register("b1", "i-b1-new", 61.0)  # it comes back (a new process)
    book.check(61.0)
    assert book.clusters[1].state == "recovering"
    assert not any(c.state == "done" for c in book.clusters)


def test_a_standby_takes_the_stage_of_a_node_that_left() -> None:
    book = _started(replace_s=3.0)
    book.standbys.append("spare")
    book.register("spare", "i-spare", 1.0)
    book.heartbeat("spare", Heartbeat(incarnation="i-spare", phase="standby", memory_bytes=1 << 30), 1.0)
    book.heartbeat("b1", Heartbeat(incarnation="i-b1", phase="leaving", generation=0, left=True), 1.5)
    book.check(2.0)
    assert book.plan.clusters[1].nodes == ["b0", "b1"]  # it may come back within replace_s
    for n in ("a0", "a1", "b0", "spare"):
        book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="standby" if n == "spare" else "training"),
                       4.6)
    book.check(4.6)
    assert book.plan.clusters[1].nodes == ["b0", "spare"] and "spare replaces b1" in book.clusters[1].reason


def test_a_stage_that_kept_its_own_weights_is_in_its_clusters_status() -> None:
    book = _started()
    book.heartbeat("b1", Heartbeat(incarnation="i-b1", left=True), 2.0)
    book.register("b1", "i-b1-new", 3.0)
    book.check(3.0)
    gen = book.clusters[1].generation
    kept = "kept its own weights (version 130): no holder is fresher (a1 at 45)"
    book.heartbeat("b1", Heartbeat(incarnation="i-b1-new", phase="paused", generation=gen, ready=gen, kept=kept),
                   4.0)
    assert book.clusters[1].public()["note"] == f"b1 {kept}"
