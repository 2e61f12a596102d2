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
