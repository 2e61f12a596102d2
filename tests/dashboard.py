"""The dashboard's queries as a test asks a real Prometheus for them: every panel's, with Grafana's
variables filled in, and which of them do not answer."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "grafana" / "dashboards" / "ravq.json"
DOCUMENTED_ZERO = "Zero is normal"
"""Panels whose description carries this may read 0 while the swarm trains."""


def promql(expr: str) -> str:
    """A panel's expression as Prometheus takes it: Grafana's variables filled in."""
    return expr.replace("$__rate_interval", "10s").replace("$node", ".*")


def dashboard_queries() -> list[tuple[str, str, bool]]:
    """(where, PromQL, zero documented) of every panel query."""
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((f"panel {inner['title']!r} {target['refId']}", promql(target["expr"]),
                              DOCUMENTED_ZERO in inner.get("description", "")))
    return found


def unanswered(query: Callable[[str], list[dict[str, Any]]]) -> list[str]:
    """Dashboard queries that return nothing, or only zeros their panel does not document; ``query`` asks
    Prometheus's /api/v1/query and returns its ``data.result``."""
    problems = []
    for where, expr, zero_ok in dashboard_queries():
        values = [float(r["value"][1]) for r in query(expr)]
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            problems.append(f"{where}: no data ({expr})")
        elif not zero_ok and not any(v != 0 for v in finite):
            problems.append(f"{where}: only zeros, undocumented ({expr})")
    return problems
