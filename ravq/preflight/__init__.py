"""``ravq check``: what will break, found on one PC before a swarm starts (docs/tasks.md, "Writing a
task")."""

from ravq.preflight.report import Finding, Report, StageMemory
from ravq.preflight.run import CheckSettings, PlacedMemory, interface_checks, run_checks

__all__ = [
    "CheckSettings",
    "Finding",
    "PlacedMemory",
    "Report",
    "StageMemory",
    "interface_checks",
    "run_checks",
]
