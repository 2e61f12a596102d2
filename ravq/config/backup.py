"""The backup broker's place in the topology (``broker.backup``): a second broker on another PC that
takes over when the first one fails (ZeroMQ's Binary Star, ``brokers.binarystar``).

It serves the same nodes with the same key (its PC holds a copy of the broker's secret key), so a node
authenticates either one as ``broker``; only the address and ports differ.
"""

from __future__ import annotations

from pydantic import Field

from ravq.config.base import UserModel


class BackupConfig(UserModel):
    host: str = Field(min_length=1)
    """Address the nodes and the primary broker connect to (the backup binds it, unless bind_host says
    otherwise).  Another PC than the primary's, ideally on another power and internet line."""
    bind_host: str | None = Field(None, min_length=1)
    """Address the backup binds (default: host)."""
    pub_port: int = Field(ge=1, le=65535)
    """The backup's PUB socket: updates while it is active, its Binary Star state always."""
    router_port: int = Field(ge=1, le=65535)
    """The backup's ROUTER socket: node requests (its votes), snapshot and status requests."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Prometheus HTTP port of the backup; None: no metrics server."""
    state_dir: str | None = None
    """Where the backup keeps the run once it is active; None: ``broker-backup/`` where the primary's
    default would be (``brokers.run.state_dir_for``)."""
