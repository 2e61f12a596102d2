"""``ravq check``: what will break, found on one PC before a swarm starts (docs/tasks.md, "Writing a
task")."""

from ravq.preflight.report import Finding, Report, StageMemory
from ravq.preflight.run import (
    CheckSettings,
    PlacedMemory,
    check_at_start,
    interface_checks,
    run_checks,
    start_problems,
)

__all__ = [
    "CheckSettings",
    "Finding",
    "PlacedMemory",
    "Report",
    "StageMemory",
    "check_at_start",
    "interface_checks",
    "run_checks",
    "start_problems",
]
