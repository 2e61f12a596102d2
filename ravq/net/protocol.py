"""The node -> broker control messages, typed: a heartbeat, a registration, a reachability request.

Each is a frozen dataclass, encoded into a ``Message``'s meta (``meta()``) and decoded from it once
(``from_meta``), by node and broker alike.  Decoding validates like ``ravq.net.wire.decode``: a missing
field raises ``WireError("missing_field")``, an unknown field or a value of the wrong JSON type
``WireError("bad_field")``; the broker counts such a message (``ravq_bad_messages_total{socket="broker"}``)
and drops it rather than guess.  A heartbeat's ``stats`` stay one free-form field (the node's
statistics, shown by ``ravq status``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ravq.net.wire import WireError

NODE_PHASES = ("starting", "training", "paused", "catching_up", "finishing", "standby", "leaving")
"""What a node says it is doing (``ravq.swarm.churn`` moves it along; ``ravq status`` shows it)."""

_Kind = type | tuple[type, ...]


def _fields(meta: dict[str, Any], schema: dict[str, tuple[_Kind, bool]]) -> dict[str, Any]:
    """``meta``'s fields, each present and of its JSON type (``(kind, nullable)``; a bool is not an int).
    On the broker's path of every heartbeat (10,000 a second at 10,000 members): the key sets compared
    at once, each value's type looked at once."""
    if meta.keys() != schema.keys():
        unknown = sorted(set(meta) - set(schema))
        if unknown:
            raise WireError("bad_field", f"unknown {unknown[0][:32]}")
        raise WireError("missing_field", next(key for key in schema if key not in meta))
    for key, (kind, nullable) in schema.items():
        value = meta[key]
        if type(value) is not kind and not (value is None and nullable) and not (
                isinstance(kind, tuple) and type(value) in kind):
            raise WireError("bad_field", key)
    return dict(meta)


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """What a node tells the broker every heartbeat interval (``ravq.swarm.report.NodeReport`` writes it,
    ``brokers.book.Book.heartbeat`` reads it)."""

    incarnation: str
    """This node process's random id: a new one means the process restarted."""
    phase: str = "starting"
    """One of ``NODE_PHASES``."""
    generation: int = 0
    """The cluster generation the node runs in."""
    ready: int = -1
    """The generation the node is ready to resume in (in-flight work dropped, caught up)."""
    trained: int = 0
    """Micro-batches its cluster finished, as its stage counts them."""
    stage_bytes: int = 0
    """Memory its stage takes (what a standby replacing it needs)."""
    memory_bytes: int = 0
    """A standby's usable memory (0 for a node of the plan)."""
    checkpoints: list[dict[str, int]] | None = None
    """Its stage's checkpoints of this run, newest first (``ravq.persist.lineage.Point.public``); None: not
    known yet."""
    kept: str | None = None
    """Why this stage kept its own weights in this generation's recovery (no holder was fresher)."""
    left: bool = False
    """It stops while the run goes on (``ravq.node.stopping``)."""
    done: bool = False
    """Its training is over."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Its statistics, free-form (numbers and strings, by name)."""

    _SCHEMA: ClassVar[dict[str, tuple[type, bool]]] = {
        "incarnation": (str, False), "phase": (str, False), "generation": (int, False),
        "ready": (int, False), "trained": (int, False), "stage_bytes": (int, False),
        "memory_bytes": (int, False), "checkpoints": (list, True), "kept": (str, True),
        "left": (bool, False), "done": (bool, False), "stats": (dict, False)}

    def meta(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self._SCHEMA}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Heartbeat:
        values = _fields(meta, cls._SCHEMA)
        if values["phase"] not in NODE_PHASES:
            raise WireError("bad_field", "phase")
        for point in values["checkpoints"] or ():  # plain loops: two generators a point cost more
            if type(point) is not dict:
                raise WireError("bad_field", "checkpoints")
            for v in point.values():
                if type(v) is not int:
                    raise WireError("bad_field", "checkpoints")
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class Register:
    """A node (re)started and joins: REGISTER."""

    incarnation: str
    """This node process's random id (``Heartbeat.incarnation``)."""

    def meta(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Register:
        return cls(**_fields(meta, {"incarnation": (str, False)}))


@dataclass(frozen=True, kw_only=True, slots=True)
class ReachRequest:
    """A node asks the broker to dial its ports back (REACH_REQ, ``ravq.net.reach``)."""

    ports: list[str]
    """Which of its ports: ``pipeline``, ``ring``."""

    def meta(self) -> dict[str, Any]:
        return {"ports": list(self.ports)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ReachRequest:
        ports = _fields(meta, {"ports": (list, False)})["ports"]
        if not all(type(p) is str for p in ports):
            raise WireError("bad_field", "ports")
        return cls(ports=ports)


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotRequest:
    """A node asks for the broker's state (SNAPSHOT_REQ), in parts (``ravq.net.clone``)."""

    mine: bool = False
    """Only the topics the node follows (the global one and its cluster's): after a gap in their updates.
    Else the whole state (every member: a node waiting for its peers at start)."""

    def meta(self) -> dict[str, Any]:
        return {"mine": self.mine}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> SnapshotRequest:
        return cls(**_fields(meta, {"mine": (bool, False)})) if meta else cls()
