"""A node's side of the durable run: which checkpoint its stage resumes from, and what it saves.

Every node resumes by default: its stage loads the newest checkpoint *of the broker's run*
(``brokers.run``) in ``training.checkpoint_dir``; a restart never starts from the seed.  Checkpoints
of another run are never loaded: when the broker's run was started with ``--new-run`` they are set
aside in ``cluster{c}/run-{RUN}/`` (kept, never deleted); otherwise the node refuses to start with one
line (the broker lost its state, or the directory belongs to another swarm), since training on would
rotate that run's checkpoints away.

When a whole cluster starts (a power cut, a restart of everything), its members agree on one
consistent point: each reports its stage's checkpoints of the run in its heartbeats, the broker relays
them, and every member picks the newest set that coexisted (``ravq.persist.lineage``), so a power cut
between two stages' saves never resumes a pipeline from two moments.  A single node that restarts
while its cluster is paused loads its own newest checkpoint and catches up (``ravq.swarm.churn``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from ravq.config import Plan
from ravq.metrics import Metrics
from ravq.persist import checkpoint
from ravq.persist.checkpoint import CheckpointError
from ravq.persist.lineage import Point, consistent_choice, describe
from ravq.stage.build import resume
from ravq.stage.pipeline import StageWorker

log = logging.getLogger(__name__)


class CheckpointReports(Protocol):
    """What the cluster's members reported of their checkpoints, as the broker relays them
    (``ravq.node.membership.Membership``)."""

    @property
    def checkpoints(self) -> dict[str, Any]:
        """Node -> its stage's checkpoints of the run, newest first."""

    async def poll_snapshot(self) -> Plan | None:
        """Refresh from the broker's state now."""


def check_run(root: str, *, cluster: int, stage: int, run_id: str | None, explicit: bool,
              name: str) -> list[dict[str, int]]:
    """Refuse (CheckpointError, one line) or set aside this stage's checkpoints of other runs; returns
    this run's, newest first, as a heartbeat reports them."""
    metas = checkpoint.stage_metas(root, cluster, stage)
    other = sorted({str(m.get("run_id") or "without a run id") for m in metas if m.get("run_id") != run_id})
    if other and run_id is not None:
        where = f"{root}/cluster{cluster}/stage{stage}"
        if not explicit:
            raise CheckpointError(
                f"{name}: {where}: checkpoints of run {', '.join(other)}, but the broker runs {run_id}; "
                "refusing to load or overwrite them: restart the broker with that run's state directory to "
                "continue it, or start a new run with `ravq broker --new-run` (or give this node a new "
                "checkpoint_dir)")
        moved = checkpoint.set_aside(root, cluster, stage, run_id)
        log.warning("%s: the broker started run %s with --new-run: set aside %d checkpoint file(s) of run %s "
                    "in %s (never loaded)", name, run_id, len(moved), ", ".join(other),
                    moved[0].parent if moved else where)
        metas = checkpoint.stage_metas(root, cluster, stage)
    return [Point.of(m).public() for m in metas if m.get("run_id") == run_id]


async def agree(membership: CheckpointReports, nodes: list[str], me: str, timeout_s: float) -> int | None:
    """The version this stage resumes from so that the cluster's stages resume from one moment: the
    newest set of its members' checkpoints that coexisted.  None: load the newest (no consistent set;
    logged) or, with no checkpoint at all, start from the seed."""
    deadline = time.monotonic() + timeout_s
    while not all(n in membership.checkpoints for n in nodes):
        if time.monotonic() > deadline:
            missing = [n for n in nodes if n not in membership.checkpoints]
            raise TimeoutError(f"{', '.join(missing)} never reported their checkpoints within "
                               f"{timeout_s:.0f}s")
        await membership.poll_snapshot()
        await asyncio.sleep(0.2)
    candidates = [[Point.of(p) for p in membership.checkpoints[n] if isinstance(p, dict)] for n in nodes]
    mine = candidates[nodes.index(me)]
    if not any(candidates):
        return None
    choice = consistent_choice(candidates)
    if choice is None:
        log.warning("%s: the cluster's checkpoints never coexisted (%s); each stage resumes from its newest",
                    me, describe(candidates))
        return None
    point = mine[choice[nodes.index(me)]]
    if point != mine[0]:
        log.info("%s: resuming from version %d, not the newest %d: the cluster's newest consistent "
                 "checkpoint",
                 me, point.version, mine[0].version)
    return point.version


def load(worker: StageWorker, root: str, *, cluster: int, stage: int, update_every: int, name: str,
         run_id: str | None, version: int | None, metrics: Metrics, micro_batch: int) -> bool:
    """Load this run's checkpoint (at ``version``, else the newest that checks out) into the stage, in
    the calling thread; exports version and samples at once, so the first scrape after a restart reads
    the resumed values, not 0.  False when there was none (the stage starts from the seed)."""
    got = resume(worker, root, cluster=cluster, stage=stage, update_every=update_every, name=name,
                 run_id=run_id, version=version)
    if got is None and version is not None:  # the agreed one does not check out here: take the newest
        got = resume(worker, root, cluster=cluster, stage=stage, update_every=update_every, name=name,
                     run_id=run_id)
    metrics.version.set(worker.version)
    if got is not None and worker.trained:
        metrics.samples.inc(worker.trained * micro_batch)
    return got is not None


def lineage(worker: StageWorker, run_id: str | None, *, caught_up_from: dict[str, Any] | None,
            epoch: int, clusters_in_rings: int, rounds: int) -> dict[str, Any]:
    """What a stage's checkpoint records of where its weights come from (``ravq.persist.lineage``)."""
    return {"window": worker.options.max_inflight,
            "lineage": {"run_id": run_id, "version": worker.version, "caught_up_from": caught_up_from,
                        "averaged_with": {"plan_epoch": epoch, "clusters_in_rings": clusters_in_rings,
                                          "rounds": rounds}}}
