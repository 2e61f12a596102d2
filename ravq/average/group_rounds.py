"""A node's rounds under group averaging: the rings of its round's group, and what a plan change touches.

The averager plans its segments over every live cluster as before (so a segment names the same tensors
in every round, whatever the group: the corrections of ``ravq.average.correction`` key on them), then
keeps, in each segment's ring, the holders in its round's group (``ravq.average.groups``): every group
is its own set of rings, all running at once.  A plan change aborts only the open (and queued) rounds
whose rings reach a cluster the change touched; in global mode, as always, every open round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from torch import Tensor

from ravq.average.groups import group_of
from ravq.average.rounds import FINAL_ROUND, ROUNDS_PER_EPOCH
from ravq.average.segments import Segment
from ravq.config import Plan
from ravq.config.averaging import AveragingConfig
from ravq.metrics import Metrics
from ravq.planner.pacing import (
    due_on_entry,
    effective_clusters,
    mix_steps,
    round_by_time,
    round_groups,
    round_lead,
    round_plan,
    round_steps,
    send_scale,
)


def live_clusters(plan: Plan) -> list[int]:
    """The clusters in the rings (every cluster of the plan not excluded), in cluster order."""
    return [c for c in range(len(plan.clusters)) if c not in plan.excluded]


STAMP_SPAN_S = 86400.0
"""An epoch read as a time stamp (``epoch_began``) names no instant further than this ahead of now (a clock
far behind the broker's, or a test's own)..."""
STAMP_MIN_MS = 1_577_836_800_000
"""...and is at least this (2020-01-01 in ms): small epochs are plans' own counts.  A stamp may be any age
(an epoch lasts as long as the membership does)."""


def epoch_began(epoch: int, now: float) -> float | None:
    """The instant plan epoch ``epoch`` names: the broker stamps every epoch with its clock in milliseconds
    (``brokers/run.py``, ``brokers/book.py``: round ids start from the epoch, so they grow across broker
    restarts), so rounds by time count from the epoch's own start and their indices stay small; None for
    an epoch that is no such stamp (a plan written by hand, or a test's)."""
    began = epoch / 1000
    return began if epoch >= STAMP_MIN_MS and began - now < STAMP_SPAN_S else None


class RoundClock:
    """Which optimizer step ends which round: every ``period``-th step since the stage saw the plan epoch
    ends round k of it (compute thread): ``sync_every``, or under rate pacing the cluster's own share of it
    (``ravq.planner.pacing``).  Every member of a ring counts alike, so all agree on round ids without
    talking to the broker (``ravq.average.averager``).  Under rate pacing by time (``period_s``) round k
    is ended by the first step once (k + 1) x ``period_s`` seconds have passed since the instant the
    epoch names (``epoch_began``: the broker's stamp, so every node counts from the same instant whatever
    its start-up took; NTP-synchronised clocks are assumed, off by far less than ``timeouts.ring_step_s``),
    or since the stage's first step in it for an epoch that is no stamp (``now``: the wall clock; tests pass
    their own).  Rounds already due when the stage first steps in an epoch are not its to run: it tells
    its peers of the newest (``OPEN_ROUNDS``), which they may hold open."""

    def __init__(self, sync_every: int, now: Callable[[], float] = time.time) -> None:
        self.sync_every, self.now = sync_every, now
        self.epoch, self.steps = -1, 0
        self.started_at = 0.0
        """When this stage first stepped in the epoch (rounds by time)."""
        self.due = 0
        """Rounds by time: rounds of the epoch this stage has ended or skipped."""
        self.skipped: range = range(0)
        """Rounds by time: the round indices the newest ``step`` passed over (a step spanned them)."""
        self.by_time = False
        """Whether the newest ``step`` counted rounds by time."""

    def step(self, epoch: int, period: int | None = None, period_s: float | None = None) -> int | None:
        """Count one optimizer step under plan epoch ``epoch``; the index in it of the round it ends."""
        period = period or self.sync_every
        self.skipped, self.by_time = range(0), period_s is not None
        if epoch != self.epoch:
            now = self.now()
            self.epoch, self.steps, self.started_at = epoch, 0, epoch_began(epoch, now) or now
            self.due = self._due(now, period_s) if period_s is not None else 0
            self.skipped = due_on_entry(self.due)
        self.steps += 1  # every step counts, or this stage's round ids drift from its peers'
        if period_s is not None:
            due = self._due(self.now(), period_s)
            index, passed = round_by_time(self.due, due)
            if index is not None:
                self.skipped, self.due = passed, due
            return index
        if self.steps % period:
            return None
        return min(self.steps // period - 1, FINAL_ROUND - 1)

    def _due(self, now: float, period_s: float) -> int:
        """Rounds by time: how many rounds of the epoch have fallen due by ``now`` (none before its instant,
        and never the final round's index)."""
        return min(max(0, int((now - self.started_at) / period_s)), FINAL_ROUND)

    def ended(self, period: int) -> int:
        """Rounds of the current epoch this stage has ended (or skipped) so far."""
        return self.due if self.by_time else self.steps // period


class RoundGroups:
    """Which clusters one node's rounds run over: every live one (global) or the round's group; and, when
    the plan changes, which rounds of the old epoch still run (groups the change did not touch)."""

    def __init__(self, config: AveragingConfig, cluster: int, sync_every: int, metrics: Metrics | None = None,
                 skip: Callable[[int, list[Segment]], None] = lambda round_id, rings: None,
                 rates: Callable[[Plan], Mapping[int, float] | None] = lambda plan: None,
                 now: Callable[[], float] = time.time) -> None:
        self.config, self.cluster = config, cluster
        """The topology's averaging; a plan that names its own (``Plan.averaging``, the planner's) wins."""
        self.clock, self.metrics, self.skip = RoundClock(sync_every, now), metrics, skip
        """``skip(round id, rings)``: tell a round's ring peers this node will not run it (compute thread)."""
        self.rates = rates
        """Each cluster's rate under a plan, the same on every node (the planner's), or None: the grid's
        places are shuffled instead.  Plans carry no per-cluster rate yet, so nodes pass none."""
        self._plan: Plan | None = None
        """The newest plan ``touched`` compared against (event loop)."""
        self._spare: tuple[int, set[str]] | None = None
        """The epoch the newest plan replaced and the nodes that change touched (event loop)."""
        self._stepped: Plan | None = None
        """The plan of the previous optimizer step (compute thread)."""
        self.last: tuple[int, ...] = ()
        """The group of the newest round ``step`` planned (for the node's stats)."""

    def averaging(self, plan: Plan) -> AveragingConfig:
        """How the plan's clusters average: the plan's own choice, else the topology's."""
        return plan.averaging or self.config

    def round_steps(self, plan: Plan) -> list[int]:
        """Each plan cluster's optimizer steps between its rounds: ``sync_every``, or its share of it when the
        plan's averaging paces rounds by rate (``ravq.planner.pacing``)."""
        mode, count = self.averaging(plan), len(plan.clusters)
        if mode.pace != "rate" or mode.rates is None or len(mode.rates) != count:
            return [self.clock.sync_every] * count
        return round_steps(self.clock.sync_every, mode.rates)

    def period_s(self, plan: Plan) -> float | None:
        """Seconds between rounds when the plan's rate pacing goes by time (``AveragingConfig.period_s``)."""
        mode = self.averaging(plan)
        return mode.period_s if mode.pace == "rate" and mode.rates is not None else None

    def every(self, plan: Plan) -> list[int] | None:
        """Pacing by link: each plan cluster takes part in every k-th round only (``AveragingConfig.every``),
        or None (every round; also when it does not name one k per cluster of the plan)."""
        every = self.averaging(plan).every
        return every if every is not None and len(every) == len(plan.clusters) else None

    def mix_steps(self, plan: Plan) -> list[int]:
        """Each plan cluster's steps since its last mix when it takes part: its round's steps times its k."""
        return mix_steps(self.round_steps(plan), self.every(plan))

    def effective_clusters(self, plan: Plan) -> float:
        """How many clusters' gradient noise this node's rounds average away under the plan, for ClusterAdam:
        the live clusters, fewer in effect under rate pacing (``ravq.planner.pacing.effective_clusters``); 1
        once this node's own cluster is dropped."""
        live = live_clusters(plan)
        if self.cluster not in live:
            return 1.0
        steps = self.mix_steps(plan)
        return effective_clusters([steps[c] for c in live])

    def scale(self, plan: Plan, round_index: int) -> float:
        """What this node multiplies its snapshot by before round ``round_index``'s rings, so that their plain
        mean weighs each cluster by the samples it trained since its last mix (1.0 under steps pacing)."""
        group = self.group(plan, round_index)
        if self.cluster not in group or len(group) < 2:
            return 1.0
        every = self.every(plan)
        if every is None:
            return send_scale(self.cluster, group, self.mix_steps(plan))
        mode, steps = self.averaging(plan), self.round_steps(plan)  # by link: samples since each last mix
        since = round_plan(plan.epoch, round_index, live_clusters(plan), mode.mode, mode.group_size,
                           self.rates(plan), every).since
        return send_scale(self.cluster, group, {c: since[c] * steps[c] for c in group})

    def extra_lead(self, plan: Plan, round_index: int) -> int:
        """Steps beyond ``averaging_lead`` this node trains past round ``round_index``'s snapshot before
        holding back for it: its own rounds' steps for the rounds its group's ring has beyond one (pacing by
        link: the span, ``ravq.planner.pacing.round_lead``); 0 otherwise."""
        every = self.every(plan)
        if every is None or self.cluster not in live_clusters(plan):
            return 0
        mode = self.averaging(plan)
        span = round_plan(plan.epoch, round_index, live_clusters(plan), mode.mode, mode.group_size,
                          self.rates(plan), every).span.get(self.cluster, 1)
        return round_lead(0, self.period(plan), span)

    def weighed(self, plan: Plan, round_id: int, snapshots: dict[int, Tensor]) -> dict[int, Tensor]:
        """The flats this node sends into round ``round_id``'s rings: its snapshots, scaled (a copy) when the
        round mixes clusters by samples (rate pacing); the snapshots themselves stay for the round's apply."""
        scale = self.scale(plan, round_id % ROUNDS_PER_EPOCH)
        return snapshots if scale == 1.0 else {r: flat * scale for r, flat in snapshots.items()}

    def period(self, plan: Plan) -> int:
        """This node's cluster's optimizer steps between its rounds under ``plan``."""
        steps = self.round_steps(plan)
        return steps[self.cluster] if self.cluster < len(steps) else self.clock.sync_every

    def group(self, plan: Plan, round_index: int) -> tuple[int, ...]:
        """The clusters this node's cluster averages with in round ``round_index`` of the plan's epoch; ()
        when its cluster skips the round (pacing by link)."""
        live = live_clusters(plan)
        if self.cluster not in live:
            return (self.cluster,)
        mode = self.averaging(plan)
        groups = round_groups(plan.epoch, round_index, live, mode.mode, mode.group_size, self.rates(plan),
                              self.every(plan))
        return group_of(self.cluster, groups)

    def step(self, plan: Plan, segments: Callable[[Plan], list[Segment]]) -> tuple[int, list[Segment]] | None:
        """Count one optimizer step (compute thread): (round id, this node's rings in it) when the step ends
        a round this node averages in.  Seeing a new epoch, a node tells its group of the old epoch's next
        round that it will not run it: members of an untouched group that started it (they were a step
        ahead) then stop at once rather than wait for the ring's timeout."""
        old, self._stepped = self._stepped, plan
        if old is not None and old.epoch != plan.epoch and self.averaging(old).mode == "groups":
            k = self.clock.ended(self.period(old))
            if k < FINAL_ROUND and (rings := self.rings(segments(old), old, k)):
                self.skip(old.epoch * ROUNDS_PER_EPOCH + k, rings)
        index = self.clock.step(plan.epoch, self.period(plan), self.period_s(plan))
        for passed in self.clock.skipped:  # rounds by time: a step spanning several runs the newest
            if rings := self.rings(segments(plan), plan, passed):
                self.skip(plan.epoch * ROUNDS_PER_EPOCH + passed, rings)
        if index is None:
            return None
        self.last = self.group(plan, index)
        if self.metrics is not None:  # a round this cluster skips (pacing by link): group size 0
            self.metrics.averaging_group.set(min(self.last, default=self.cluster))
            self.metrics.averaging_group_size.set(len(self.last))
        rings = self.rings(segments(plan), plan, index)
        return (plan.epoch * ROUNDS_PER_EPOCH + index, rings) if rings else None

    def rings(self, segments: list[Segment], plan: Plan, round_index: int) -> list[Segment]:
        """``segments`` (planned over every live cluster, rings in cluster order) with each ring cut to the
        holders in this round's group; none when the group is this cluster alone or it skips the round."""
        if self.averaging(plan).mode == "global" and self.every(plan) is None:
            return segments
        group = set(self.group(plan, round_index))
        if len(group) < 2:
            return []
        keep = [i for i, c in enumerate(live_clusters(plan)) if c in group]
        return [replace(seg, ring=tuple(seg.ring[i] for i in keep)) for seg in segments]

    def touched(self, plan: Plan) -> set[str] | None:
        """The nodes of the clusters a new plan changed since the last one seen here (dropped, readmitted,
        other nodes or cuts); None: every open round is touched (global mode, or the first plan)."""
        old, self._plan, self._spare = self._plan, plan, None
        if old is None or "global" in (self.averaging(old).mode, self.averaging(plan).mode) \
                or len(old.clusters) != len(plan.clusters):
            return None
        changed = [c for c, (was, now) in enumerate(zip(old.clusters, plan.clusters))
                   if was != now or (c in old.excluded) != (c in plan.excluded)]
        if self.cluster in changed:
            return None
        nodes = {n for c in changed for n in (*old.clusters[c].nodes, *plan.clusters[c].nodes)}
        self._spare = (old.epoch, nodes)
        return nodes

    def spared(self, round_id: int, rings: list[Segment]) -> bool | None:
        """Whether a queued round of an older epoch still runs (event loop): one of the epoch the newest plan
        replaced, whose rings reach no node that change touched.  None in global mode: every node drops
        every such round, so none need be told (``ravq.average.round_queue``)."""
        if self._plan is None or self.averaging(self._plan).mode == "global":
            return None
        if self._spare is None:
            return False
        epoch, touched = self._spare
        return round_id // ROUNDS_PER_EPOCH == epoch and all(touched.isdisjoint(seg.ring) for seg in rings)
