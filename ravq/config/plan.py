"""The plan: what the planner (or the user) makes of a topology, and what the broker publishes.

Clusters, each a pipeline of named nodes with the module names where its stages begin, the clusters
left out of the rings, and an epoch that increases with every published change.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from ravq.config.averaging import AveragingConfig
from ravq.config.base import StrictModel


class ClusterPlan(StrictModel):
    nodes: list[str] = Field(min_length=1)
    """Node names in pipeline order: nodes[0] is stage 0 and reads data."""
    cuts: list[str] = Field(default=[])
    """Module names (in the unsplit model) where stages 1..n-1 begin; len(cuts) == len(nodes) - 1."""

    @model_validator(mode="after")
    def _shape(self) -> ClusterPlan:
        if len(self.cuts) != len(self.nodes) - 1:
            raise ValueError(
                f"cuts: {len(self.nodes)} stages need {len(self.nodes) - 1} cuts, got {len(self.cuts)}"
            )
        return self


class Plan(StrictModel):
    epoch: int = Field(0, ge=0)
    """Increases with every change the broker publishes."""
    clusters: list[ClusterPlan] = Field(min_length=1)
    excluded: list[int] = Field(default=[])
    """Clusters currently dropped from the all-reduce rings (dead member)."""
    predicted_samples_per_s: float | None = None
    """The planner's prediction, when the plan came from the planner."""
    averaging: AveragingConfig | None = None
    """The averaging the planner scored the plan with (issue #38: it picks global rings or groups, and the
    group size, per plan); None: the topology's ``averaging``."""

    def locate(self, name: str) -> tuple[int, int]:
        """(cluster, stage) of a node."""
        for c, cluster in enumerate(self.clusters):
            if name in cluster.nodes:
                return c, cluster.nodes.index(name)
        raise KeyError(name)
