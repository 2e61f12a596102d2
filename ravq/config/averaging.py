"""How clusters average with one another: all at once in one set of rings, or in groups (issue #38)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ravq.config.base import UserModel


class AveragingConfig(UserModel):
    mode: Literal["global", "groups"] = "global"
    """``global``: every round's rings run over every live cluster, so every cluster trains at the slowest
    one's pace.  ``groups``: each round the clusters average in groups of at most ``group_size`` that
    every node derives alone (a Moshpit grid, ``ravq.average.groups``): C = M^d clusters reach the
    exact average in d rounds, and a slow or lost cluster holds back, or aborts, only its round's group."""
    group_size: int = Field(2, ge=2)
    """Most clusters in one group (groups mode only)."""
    pace: Literal["steps", "rate"] = "steps"
    """``steps``: every cluster ends a round every ``sync_every`` optimizer steps, so a fast cluster holds
    back for the slow ones of its round.  ``rate``: each ends a round after its own share of ``sync_every``
    steps by ``rates`` (``ravq.planner.pacing``: the fastest ``sync_every``, a cluster 3x slower a third of
    it), so round k falls due on every cluster together and each trains at its own rate; a round then mixes
    each cluster by the samples it trained since its last.  Without ``rates``, as ``steps``."""
    rates: list[float] | None = None
    """Per cluster of the plan, its rate (samples/s) that ``rate`` pacing follows, the same on every node: the
    planner's prediction in a plan's averaging (``Plan.averaging``)."""
    period_s: float | None = Field(None, gt=0)
    """``rate`` pacing only: rounds fall due by time, not by step count.  Round k of a plan epoch is ended by
    a stage's first optimizer step once (k + 1) x ``period_s`` seconds have passed since its first step in the
    epoch, so clusters whose real rates differ from ``rates`` still reach each round together (counted in
    steps, a cluster 10% slower than planned falls a round behind in ten, and its rings time out).  A stage
    whose step spans several due rounds takes the newest and tells its peers it skips the others.  The
    planner sets it to the fastest cluster's planned round (``sync_every`` of its steps); ``rates`` still
    weigh each cluster's samples.  None: each cluster's share of ``sync_every`` steps."""
    every: list[int] | None = None
    """Per cluster of the plan, pacing by link: it takes part in every ``every[c]``-th round of an epoch only
    (round r when r % k == k - 1, after k rounds of training: ``ravq.planner.pacing.takes_part``), for a
    cluster whose round of averaging outlasts the round period (a slow uplink); the others form their groups
    without it and it mixes with its samples since its last mix.  The planner records it beside ``rates``; a
    user may state it.  None: every round."""

    @model_validator(mode="after")
    def _every(self) -> AveragingConfig:
        if self.period_s is not None and self.pace != "rate":
            raise ValueError(f"averaging.period_s: rounds by time are a way of pacing by rate; set pace: "
                             f"rate (got pace: {self.pace})")
        if self.period_s is not None and self.rates is None:
            raise ValueError("averaging.period_s: rounds by time weigh each cluster by its rate; give rates "
                             "(one per cluster of the plan, samples/s)")
        if self.every is None:
            return self
        if any(k < 1 for k in self.every):
            raise ValueError(f"averaging.every: each cluster's k is a round count >= 1, got {self.every}")
        if self.rates is not None and len(self.rates) != len(self.every):
            raise ValueError(f"averaging.every: one k per cluster of the plan, as in rates "
                             f"({len(self.rates)}), got {len(self.every)}")
        return self
