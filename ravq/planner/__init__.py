"""The planner: which nodes form clusters, in which order, and where each stage begins.

Pure planning on plain data: node and block profiles in, a ``Plan`` and an ``Explanation`` out.  No
sockets, no torch.  Read in this order:

- ``types``: the profiles the planner takes and the reports it gives;
- ``problem``: the profiles as arrays, and the exact dynamic programme that cuts one cluster's pipeline;
- ``cost``: the cost model (docs/design.md, "Planner and profiler"): what a layout of clusters achieves;
- ``search``: the deterministic search over clusters and node orders behind ``make_plan``;
- ``plans``: the entry points (``make_plan``, ``cut_plan``, ``evaluate_plan``, ``even_plan``);
- ``regional``: plans for many PCs, region by region, and the best subset of the regions' clusters;
- ``baselines``: Ravnest's rule and the exhaustive optimum, to compare against;
- ``report``: layouts turned into a ``Plan``, an ``Explanation`` and memory errors.
"""

from ravq.planner.baselines import optimum_plan, ravnest_plan
from ravq.planner.plans import (
    cut_plan,
    evaluate_plan,
    even_plan,
    make_plan,
    plan_candidates,
    topology_clusters,
    training_settings,
)
from ravq.planner.regional import best_subset, regional_plan
from ravq.planner.types import (
    BlockProfile,
    ClusterReport,
    Explanation,
    NodeProfile,
    PlanError,
    StageReport,
    Wire,
)

__all__ = [
    "BlockProfile",
    "ClusterReport",
    "Explanation",
    "NodeProfile",
    "PlanError",
    "StageReport",
    "Wire",
    "best_subset",
    "cut_plan",
    "evaluate_plan",
    "even_plan",
    "make_plan",
    "optimum_plan",
    "plan_candidates",
    "ravnest_plan",
    "regional_plan",
    "topology_clusters",
    "training_settings",
]
