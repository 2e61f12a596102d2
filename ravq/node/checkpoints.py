"""A node's checkpoints of its stage: every ``training.checkpoint_every`` optimizer steps (a subscriber to
the worker's updates, in the compute thread, after the averaging round) and the final one at shutdown.

Each records where the stage's weights come from (``ravq.swarm.resume.lineage``): the run, the holders
it last caught up from, the plan epoch and how many averaging rounds it completed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ravq.config import Plan
from ravq.metrics import Metrics
from ravq.stage.build import save
from ravq.stage.pipeline import StageWorker
from ravq.swarm import resume


class StageCheckpoints:
    def __init__(self, *, root: str, every: int | None, name: str, cluster: int, stage: int,
                 run_id: str | None, metrics: Metrics, plan: Callable[[], Plan], rounds: Callable[[], int],
                 caught_up_from: Callable[[], dict[str, int] | None]) -> None:
        self.root, self.every, self.name, self.cluster, self.stage = root, every, name, cluster, stage
        self.run_id, self.metrics = run_id, metrics
        self._plan = plan
        """The broker's plan now (its epoch and the clusters in the rings go into the lineage)."""
        self._rounds = rounds
        """Averaging rounds completed so far."""
        self._caught_up_from = caught_up_from
        """The holders (node -> version) the stage last caught up from, if it did."""

    def on_update(self, worker: StageWorker) -> None:
        """After each optimizer step (and its averaging round), in the compute thread: every ``every``."""
        if self.every and worker.version % self.every == 0 and not worker.paused:
            t0 = time.monotonic()
            self.save(worker)
            worker.waited("checkpoint", time.monotonic() - t0)

    def save(self, worker: StageWorker) -> None:
        """In the compute thread (from ``on_update``) or after it ended."""
        t0 = time.monotonic()
        plan = self._plan()
        extra = resume.lineage(worker, self.run_id, caught_up_from=self._caught_up_from(), epoch=plan.epoch,
                               clusters_in_rings=len(plan.clusters) - len(plan.excluded),
                               rounds=self._rounds())
        save(worker, self.root, cluster=self.cluster, stage=self.stage, node=self.name, run_id=self.run_id,
             cluster_nodes=list(plan.clusters[self.cluster].nodes), extra=extra)
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(time.monotonic() - t0)
