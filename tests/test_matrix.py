"""Every feature with every other (issue #41 item 3): the all-pairs cells of thirteen on/off features,
each a small swarm of real node processes training ``tests.matrix_task``.

``by_time`` paces the two clusters' rounds by the clock (``averaging.period_s``, rate pacing): its cells must
train, learn and recover as the others (whether a round completes in a run of 48 micro-batches with a kill
depends on timing, so it is not asserted: 2 of 3 runs of a standby cell had none).

A fourteenth feature, ``sync``, is the mode: a sync cell (``max_inflight`` 1, averaging every step, so
never with int8 compression, a kill or a standby) must end with each cluster's export equal to one
process trained on the clusters' micro-batches with the same recipe (``_reference``), and its evaluation
equal to the exported model's in one process; being a feature, it meets every other feature that
allows it in some cell.  The other cells train asynchronously and must train and learn: every process
that should finish finishes, the loss falls, and the fault did what it says (a killed node resumed
from its checkpoint of the same run, a standby took the stage, a link went through the relay).
Processes, not threads: resume, standby and relay are the node's and the broker's.  A cell's cost is
starting its interpreters (torch's import), so a cell is small: one cluster of two stages, or two
clusters cut differently as two stages beside one; the spare of a standby cell is one more.
"""

from __future__ import annotations

import math
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from ravq.cli.demo import free_ports
from ravq.config import TrainingConfig
from ravq.cut.split import build_task_model
from ravq.stage.clip import clip_factor, squared_norm
from ravq.stage.precision import autocast_for
from ravq.stage.recipe import build_optimizer, recipe_options
from tests import matrix_task
from tests.allpairs import Row, all_pairs, coverable_pairs, covered
from tests.swarm import Swarm, export, local_topology

pytestmark = pytest.mark.multiprocess

FEATURES = ("sync", "tied", "pretrained", "eval", "metrics_fn", "bf16", "clip", "lr_schedule", "update_every",
            "int8", "two_clusters", "resume", "relay", "standby", "by_time")
TASK_SIDE = {"tied": "tied", "pretrained": "pretrained", "eval": "eval", "metrics_fn": "metrics"}
VICTIM, KILL_AT = "c0s0", 4
"""The node a cell with ``resume`` or ``standby`` kills (SIGKILL) right after its checkpoint of version 4."""
MICRO_BATCH, EVAL_BATCHES = 4, 3
PERIOD_S = 0.05
"""A ``by_time`` cell's round period: the one-stage cluster trains its 48 micro-batches in about 0.1 s."""


def _allowed(row: Row) -> bool:
    # one fault a cell: a cell with both would kill the victim for good (the standby) and restart it
    one_fault = not (row.get("resume") and row.get("standby"))
    faulty_or_lossy = row.get("int8") or row.get("resume") or row.get("standby")
    # rounds by time (rate pacing with ``averaging.period_s``) need clusters to pace and are not one process
    timed = not (row.get("by_time") and (row.get("two_clusters") is False or row.get("sync")))
    return one_fault and not (row.get("sync") and faulty_or_lossy) and timed


CELLS = all_pairs(FEATURES, _allowed)


def _cell_id(row: Row) -> str:
    return "+".join(f for f in FEATURES if row[f]) or "async"


def test_the_cells_hold_every_pair_of_features() -> None:
    assert CELLS == all_pairs(FEATURES, _allowed)  # deterministic: the same cells every run
    held = set().union(*(covered(row, FEATURES) for row in CELLS))
    assert coverable_pairs(FEATURES, _allowed) <= held
    assert all(_allowed(row) for row in CELLS) and len(CELLS) <= 10


def _exact(row: Row) -> bool:
    """Whether the cell is checked against one process (sync mode: no compression, no fault)."""
    return row["sync"]


def _training(row: Row, ckpt: Path) -> dict[str, Any]:
    exact = _exact(row)
    update_every = 2 if row["update_every"] else 1
    steps = 24 if exact else 48
    training: dict[str, Any] = {"steps": steps, "micro_batch": MICRO_BATCH, "checkpoint_dir": str(ckpt),
                                "update_every": update_every}
    if exact:
        training.update(max_inflight=1, sync_every=1, overlap_averaging=False)
    else:
        training.update(sync_every=3, checkpoint_every=2)
    if row["bf16"]:
        training["precision"] = "bf16"
    if row["clip"]:
        training["clip_grad_norm"] = 0.5
    if row["lr_schedule"]:
        training["lr_schedule"] = {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
    if row["int8"]:
        training["compress"] = {"pipeline": "int8", "ring": "int8"}
    if row["eval"]:
        training.update(eval_every=steps // update_every // 2, eval_batches=EVAL_BATCHES)
    return training


def _topology(row: Row, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The topology and the plan (two clusters cut in different places)."""
    clusters = [2, 1] if row["two_clusters"] else [2]  # cut once and not at all: a process less than 2x2
    task = matrix_task.name(TASK_SIDE[f] for f in TASK_SIDE if row[f])
    timeouts = {"connect_s": 120.0, "lost_s": 30.0, "request_s": 1.0}  # a node asks again each second
    if row["resume"] or row["standby"]:
        timeouts = {"connect_s": 120.0, "request_s": 1.0, "heartbeat_interval_s": 0.5, "lost_s": 2.0,
                    "replace_s": 1.0, "ring_step_s": 5.0}
    spare = [1] if row["standby"] else []  # a one-node "cluster" for the spare's free ports
    averaging = ({"mode": "global", "pace": "rate", "rates": [2.0, 1.0], "period_s": PERIOD_S}
                 if row["by_time"] else None)  # the cut cluster planned at twice the other's rate
    topo = local_topology(f"tests.matrix_task:{task}", clusters + spare, _training(row, tmp / "ckpt"),
                          timeouts=timeouts, **({"averaging": averaging} if averaging else {}))
    if row["relay"]:
        topo["broker"]["relay_port"] = free_ports(1)[0]
        for node in topo["nodes"]:  # c0s0 alone reachable with two clusters: links dialled out and relayed
            node["reachable"] = len(clusters) > 1 and node["name"] == "c0s0"
    if row["standby"]:
        spare = topo["nodes"][-1]
        spare.update(name="spare", standby=True, reachable=not row["relay"])
        del spare["cluster"], spare["stage"]
    cuts = [["b1"], []] if len(clusters) > 1 else [["b2"]]
    plan = {"clusters": [{"nodes": [f"c{c}s{s}" for s in range(size)], "cuts": cuts[c]}
                         for c, size in enumerate(clusters)]}
    return topo, plan


def _pretrained(row: Row, tmp: Path) -> Path:
    """A checkpoint unlike the seed's start: the model built under another seed, each tensor its own."""
    from safetensors.torch import save_file

    torch.manual_seed(1234)
    model = matrix_task.MatrixLM(row["tied"])
    path = tmp / "pretrained.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize("row", CELLS, ids=[_cell_id(r) for r in CELLS])
def test_cell(tmp_path: Path, row: Row, monkeypatch: pytest.MonkeyPatch) -> None:
    if row["pretrained"]:
        monkeypatch.setenv(matrix_task.PRETRAINED_ENV, str(_pretrained(row, tmp_path)))
    topo, plan = _topology(row, tmp_path)
    task = getattr(matrix_task, topo["task"].split(":")[1])
    faults = {VICTIM: f"kill_after_checkpoint:{KILL_AT}"} if row["resume"] or row["standby"] else {}
    swarm = Swarm(tmp_path, topo, plan=plan, faults=faults)
    try:
        _run(swarm, row)
    finally:
        swarm.close()
    last = [swarm.summary(cluster["nodes"][-1]) for cluster in plan["clusters"]]
    # it learns (a sync cell's 24 micro-batches less, its reference checks the rest; by time, a cluster whose
    # partner paused is not held for it and may train its 48 micro-batches alone: 0.83 of its first loss)
    bound = 0.95 if _exact(row) else 0.9 if row["by_time"] else 0.8
    for summary in last:
        assert summary["loss_recent"] < bound * summary["loss_initial"], summary
    if row["pretrained"]:
        start = build_task_model(task, 0).state_dict()
        from safetensors.torch import load_file
        for name, value in load_file(str(tmp_path / "pretrained.safetensors")).items():
            assert torch.equal(start[name], value), name  # every cluster started from the checkpoint
    if row["relay"]:
        routes = [r for n in swarm.nodes if n != VICTIM for link in ("pipeline", "ring")
                  for r in swarm.summary(n)["routes"][link].values()]
        assert "relay:broker" in routes, routes
    if row["eval"]:
        for summary in last:
            assert summary["eval_history"] and math.isfinite(summary["eval_loss"]), summary
            assert ("accuracy" in summary["eval_metrics"]) == row["metrics_fn"], summary["eval_metrics"]
    if _exact(row):
        _equals_one_process(row, task, tmp_path, last)


def _run(swarm: Swarm, row: Row) -> None:
    others = [n for n in swarm.nodes if not (n == VICTIM and (row["resume"] or row["standby"]))]
    if row["resume"] or row["standby"]:
        code = swarm.nodes[VICTIM].wait(180)
        assert code == -signal.SIGKILL, swarm.log(VICTIM)
        if row["resume"]:
            del swarm.faults[VICTIM]
            swarm.start(VICTIM)  # as systemd's Restart= would
            others.append(VICTIM)
    codes = swarm.wait(others, timeout_s=240)
    assert all(c == 0 for c in codes.values()), {n: swarm.log(n) for n, c in codes.items() if c}
    if row["resume"]:
        text = (swarm.tmp / f"{VICTIM}.log").read_text(errors="replace")
        found = re.findall(r"resumed at version (\d+) \(run (\S+)\)", text)
        assert found and int(found[-1][0]) >= KILL_AT, swarm.log(VICTIM)
        runs = set(re.findall(r"\(run (\S+)\)", text))
        assert len(runs) == 1, runs  # the same run before and after the kill
    if row["standby"]:
        assert f"standby spare takes over the stage of {VICTIM}" in swarm.log("broker"), swarm.log("broker")
        assert swarm.summary("spare")["version"] > KILL_AT, swarm.summary("spare")


def _equals_one_process(row: Row, task: Any, tmp: Path, last: list[dict[str, Any]]) -> None:
    training = _training(row, tmp / "ckpt")
    want = _reference(task, training, shards=len(last))
    precision = training.get("precision", "fp32")
    atol = 1e-5
    for cluster, summary in enumerate(last):
        got = export(tmp / "ckpt", cluster, tmp / f"c{cluster}.safetensors")
        assert got, "nothing exported"
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=atol, msg=f"cluster {cluster} {name}")
        if row["eval"]:
            loss, accuracy = _one_process_eval(task, want, precision)
            assert summary["eval_loss"] == pytest.approx(loss, abs=1e-5), (summary["eval_history"], loss)
            if row["metrics_fn"]:
                assert summary["eval_metrics"]["accuracy"] == pytest.approx(accuracy, abs=1e-5)


def _reference(task: Any, training: dict[str, Any], *, shards: int) -> dict[str, torch.Tensor]:
    """One process, as sync mode defines training: each cluster (shard) an unsplit model that takes one
    optimizer step on its micro-batches (accumulated over ``update_every``, scaled by 1/update_every,
    clipped to its own global norm) under the same autocast and LR schedule, then the clusters' weights
    averaged.  For SGD with momentum that is data parallelism's mean gradient, except for float32
    rounding, which bf16 autocast can turn into a different bf16 weight (seen: 2e-4 after 24 steps),
    so the reference averages weights as the rings do."""
    recipe = recipe_options(task, TrainingConfig.model_validate(training))
    ue = training["update_every"]
    models = [build_task_model(task, 0) for _ in range(shards)]
    opts = [build_optimizer(task.make_optimizer, dict(m.named_parameters())) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, recipe.lr_lambda) if recipe.lr_lambda else None
              for o in opts]
    streams = [task.train_batches(MICRO_BATCH, s, shards, 0) for s in range(shards)]
    for _ in range(training["steps"] // ue):
        for model, opt, sched, stream in zip(models, opts, scheds, streams, strict=True):
            params = list(model.parameters())
            accumulated = [torch.zeros_like(p) for p in params]
            for _ in range(ue):
                inputs, targets = next(stream)
                for p in params:
                    p.grad = None
                with autocast_for(recipe.precision, "cpu"):
                    loss = task.loss_fn(model(*inputs), targets)
                loss.backward()
                for a, p in zip(accumulated, params, strict=True):
                    a.add_(p.grad, alpha=1.0 / ue)
            for p, a in zip(params, accumulated, strict=True):
                p.grad = a
            if recipe.clip_grad_norm is not None:  # as the stages clip (``ravq.stage.clip``): norms summed in
                # float64, not clip_grad_norm_'s float32 norm of norms, whose last bit bf16 turns into 2e-4
                coef = clip_factor(squared_norm({str(i): p.grad for i, p in enumerate(params)}),
                                   recipe.clip_grad_norm)
                for p in params:
                    if coef != 1.0:
                        p.grad.mul_(coef)
            opt.step()
            if sched is not None:
                sched.step()
        with torch.no_grad():
            for group in zip(*(m.parameters() for m in models), strict=True):
                mean = sum(group[1:], group[0].clone()) / shards
                for p in group:
                    p.add_(mean - p)  # what a ring round adds to the live weights: average - snapshot
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}


def _one_process_eval(task: Any, state: dict[str, torch.Tensor], precision: str) -> tuple[float, float]:
    model = build_task_model(task, 0)
    model.load_state_dict(state)
    model.eval()
    losses, accuracies = [], []
    batches = task.eval_batches(MICRO_BATCH, 0)
    with torch.no_grad(), autocast_for(precision, "cpu"):
        for _ in range(EVAL_BATCHES):
            inputs, targets = next(batches)
            outputs = model(*inputs)
            losses.append(float(task.loss_fn(outputs, targets)))
            accuracies.append(float(matrix_task.metrics_fn(outputs, targets)["accuracy"]))
    return sum(losses) / len(losses), sum(accuracies) / len(accuracies)
