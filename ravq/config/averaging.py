"""How clusters average with one another: all at once in one set of rings, or in groups (issue #38)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

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
