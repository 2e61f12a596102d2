"""``ravq simulate``: a discrete-event model of what ravq does on a given set of PCs and plan.

Pure Python on plain data (no sockets, no torch): ``world`` holds the inputs (stages, network, hosts,
settings) and builds them from planner profiles and a plan; ``engine`` is the event queue and the
shared uplinks/cores; ``state`` is what each node knows; ``training`` is ravq's schedule (pipelines,
credits, updates, averaging, churn) and ``rings`` its averaging rings; ``report`` collects the results;
``worldwide`` makes large worlds from a published inter-region link table for projections (the command
is ``ravq.cli.simulate``).
"""

from ravq.simulate.report import ClusterResult, NodeResult, SimResult, collect, simulate
from ravq.simulate.training import Simulation
from ravq.simulate.world import (
    SegmentSpec,
    Settings,
    StageSpec,
    World,
    averaging_settings,
    build_world,
    ring_segments,
)

__all__ = ["ClusterResult", "NodeResult", "SegmentSpec", "Settings", "SimResult", "Simulation", "StageSpec",
           "World", "averaging_settings", "build_world", "collect", "ring_segments", "simulate"]
