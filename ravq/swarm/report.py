"""What a node tells the broker about itself, beyond each beat's progress: written only through methods.

The node's parts each say their piece once (the root which checkpoints its stage holds, churn that it
stands by or kept its own weights, stopping that it leaves); every heartbeat (``heartbeat``) puts that
together with the beat's progress into one ``ravq.net.protocol.Heartbeat``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ravq.net.protocol import Heartbeat


@dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    """Where the node is, read afresh for every heartbeat."""

    generation: int
    """The cluster generation it runs in (``ravq.swarm.churn.Churn.generation``)."""
    phase: str
    ready: int
    """The last generation it reported itself ready to resume in."""
    trained: int
    """Micro-batches its stage counts as finished."""
    stage_bytes: int
    """Memory its stage takes (0 before it is built)."""


class NodeReport:
    def __init__(self) -> None:
        self.incarnation = os.urandom(8).hex()
        """This process's id: a restarted node has a new one, so the broker knows it lost its state."""
        self._checkpoints: list[dict[str, int]] | None = None
        self._kept: str | None = None
        self._left = False
        self._memory_bytes = 0

    def checkpoints(self, held: list[dict[str, int]]) -> None:
        """Its stage's checkpoints of this run, newest first (``ravq.swarm.resume.check_run``)."""
        self._checkpoints = list(held)

    def kept(self, reason: str) -> None:
        """It kept its own weights in this generation's recovery, and why."""
        self._kept = reason

    def forget_kept(self) -> None:
        """A new generation: what it kept was said of the previous one."""
        self._kept = None

    def left(self) -> None:
        """It stops while the run goes on."""
        self._left = True

    def standing_by(self, memory_bytes: int) -> None:
        """It stands by, with ``memory_bytes`` usable for a lost node's stage."""
        self._memory_bytes = memory_bytes

    def heartbeat(self, progress: Progress, stats: dict[str, Any], *, done: bool) -> Heartbeat:
        return Heartbeat(incarnation=self.incarnation, phase=progress.phase, generation=progress.generation,
                         ready=progress.ready, trained=progress.trained, stage_bytes=progress.stage_bytes,
                         memory_bytes=self._memory_bytes, checkpoints=self._checkpoints, kept=self._kept,
                         left=self._left, done=done, stats=stats)
