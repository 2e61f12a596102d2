"""Which checkpoints of a cluster's stages belong together, and whether one stage state is older than another.

A stage's checkpoint records its run, its version (optimizer steps applied), how many micro-batches
its cluster had finished (``trained``, counted in stage 0's numbering and realigned at every resume)
and its pipeline's window (``max_inflight``: the stages of a cluster training together are never more
than that many micro-batches apart).  Checkpoints of one cluster's stages *coexisted* when they are of
one run and their ``trained`` counts lie within that window: the weights of a pipeline at one moment.
A power cut between two stages' saves leaves one stage a save ahead; the previous checkpoint each
stage keeps (``.prev``) is then the consistent point.  Resuming (``ravq.swarm.resume``) and ``ravq
export`` both take the newest set that coexisted, never a mix of two moments.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Point:
    """One checkpoint of one stage, as far as consistency goes."""

    version: int
    trained: int
    window: int

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> Point:
        """From a checkpoint's JSON (or a node's report of it); older checkpoints lack ``trained`` and
        ``window``: their version and the stage count stand in."""
        version = int(meta.get("version", 0))
        trained = meta.get("trained")
        window = meta.get("window")
        return cls(version=version, trained=int(trained) if isinstance(trained, int) else version,
                   window=int(window) if isinstance(window, int) else int(meta.get("num_stages", 1)))

    def public(self) -> dict[str, int]:
        return {"version": self.version, "trained": self.trained, "window": self.window}


def coexisted(points: Sequence[Point]) -> bool:
    """Whether these stages' states can be the weights of one pipeline at one moment."""
    trained = [p.trained for p in points]
    return max(trained) - min(trained) <= max(p.window for p in points)


def consistent_choice(candidates: Sequence[Sequence[Point]]) -> list[int] | None:
    """Per stage, the index of its checkpoint in the newest set that coexisted (None: no such set).
    ``candidates[s]`` are stage s's checkpoints (a handful: the current and previous save)."""
    if not candidates or any(not c for c in candidates):
        return None
    best: tuple[tuple[int, int], list[int]] | None = None
    for combo in itertools.product(*(range(len(c)) for c in candidates)):
        points = [candidates[s][i] for s, i in enumerate(combo)]
        if not coexisted(points):
            continue
        key = (min(p.trained for p in points), sum(p.version for p in points))
        if best is None or key > best[0]:
            best = (key, list(combo))
    return None if best is None else best[1]


def describe(candidates: Sequence[Sequence[Point]]) -> str:
    """One line naming each stage's checkpoints: "stage 0: v80 (trained 80), v40 (trained 40); ..."."""
    return "; ".join(
        f"stage {s}: " + (", ".join(f"v{p.version} (trained {p.trained})" for p in points) or "none")
        for s, points in enumerate(candidates)
    )


def older(own: Mapping[str, Any], holders: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why the holders' copies must not replace ``own`` (a stage's lineage: run id and version), or None
    when every holder is of the same run and at least as far on.  Weights only move forward."""
    runs = {n: h.get("run_id") for n, h in holders.items()}
    if not holders:
        return "no holder said what its copy is"
    foreign = sorted(n for n, r in runs.items() if r != own.get("run_id"))
    if foreign:
        other, this = runs[foreign[0]], own.get("run_id")
        return f"holder(s) {', '.join(foreign)} are of another run ({other}, this is {this})"
    versions = {n: h.get("version") for n, h in holders.items()}
    if not all(isinstance(v, int) for v in versions.values()):
        return "a holder did not say its version"
    behind = {n: v for n, v in versions.items() if v < int(own.get("version", 0))}  # type: ignore[operator]
    if behind:
        held = ", ".join(f"{n} at {v}" for n, v in sorted(behind.items()))
        return f"no holder is fresher ({held})"
    return None
