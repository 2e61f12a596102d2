"""Topology schema: the YAML a user writes, validated into typed objects with one-line errors.

The YAML file is a thin loader into these models; there is no second schema.  Every model forbids
unknown fields so a typo (``micro_bach``) is an error instead of a silently ignored setting.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Port = int


class ConfigError(ValueError):
    """A topology the user got wrong; ``str()`` is one line naming the field and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _check_port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"port must be 1..65535, got {value}")
    return value


class TrainingConfig(_Strict):
    micro_batch: int = Field(16, ge=1)
    """Samples per micro-batch."""
    steps: int = Field(200, ge=1)
    """Micro-batches each cluster trains on."""
    max_inflight: int | None = Field(None, ge=1)
    """Micro-batches in flight per cluster; bounds memory and staleness. Default: number of stages."""
    update_every: int = Field(1, ge=1)
    """Backwards accumulated before each optimizer step of a stage."""
    sync_every: int = Field(10, ge=1)
    """Optimizer steps between parameter averages across clusters."""
    average_optimizer_state: bool = False
    """Also average floating-point optimizer state (e.g. Adam moments) across clusters."""
    checkpoint_every: int = Field(0, ge=0)
    """Optimizer steps between checkpoints of a stage; 0 writes only the final one."""
    checkpoint_dir: str | None = None
    """Directory for stage checkpoints; None disables checkpoints."""
    ring_chunk_bytes: int = Field(4 << 20, ge=1024)
    """Piece size in which ring all-reduce streams a chunk."""
    resume: bool = False
    """Resume every stage from the newest checkpoint in checkpoint_dir."""


class TimeoutConfig(_Strict):
    connect_s: float = Field(60.0, gt=0)
    """How long a node waits for the broker's plan and its cluster's peers at start."""
    request_s: float = Field(5.0, gt=0)
    """Timeout of one request to the broker."""
    peer_s: float = Field(120.0, gt=0)
    """Longest wait for a pipeline message before the stage reports its peer as silent."""
    ring_step_s: float = Field(30.0, gt=0)
    """Longest wait for one ring all-reduce step before the round is aborted."""
    drain_s: float = Field(20.0, gt=0)
    """On SIGTERM/SIGINT: how long a node may drain before it is forced to exit."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    """Interval of node heartbeats (with live statistics) to the broker."""


class LimitConfig(_Strict):
    max_message_bytes: int = Field(1 << 30, ge=1024)
    """ZMQ_MAXMSGSIZE: the largest single frame a socket accepts."""
    max_header_bytes: int = Field(64 << 10, ge=256)
    """Largest accepted header frame."""
    max_frames: int = Field(1024, ge=2)
    """Most frames accepted in one message."""


class BrokerConfig(_Strict):
    host: str = "127.0.0.1"
    """Address the broker binds and nodes connect to."""
    pub_port: Port
    """PUB socket: plan and membership updates."""
    router_port: Port
    """ROUTER socket: register, heartbeat, snapshot, status."""
    metrics_port: Port | None = None
    """Prometheus HTTP port of the broker; None: no metrics server."""
    public_key: str | None = None
    """CURVE public key (Z85, 40 characters) of the broker."""

    _ports = field_validator("pub_port", "router_port", "metrics_port")(
        lambda v: v if v is None else _check_port(v)
    )


class NodeConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Unique node name."""
    host: str = "127.0.0.1"
    """Address other nodes use to reach this node."""
    bind_host: str | None = None
    """Address to bind (default: host)."""
    pipeline_port: Port
    """ROUTER for activations, gradients and targets."""
    ring_port: Port
    """ROUTER for all-reduce ring traffic."""
    metrics_port: Port | None = None
    """Prometheus HTTP port; None: no metrics server."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:N, mps."""
    cluster: int | None = Field(None, ge=0)
    """Cluster index; if no node sets it, the planner chooses."""
    stage: int | None = Field(None, ge=0)
    """Position in its cluster's pipeline; default: listing order."""
    public_key: str | None = None
    """CURVE public key (Z85, 40 characters) from `ravq keygen`."""
    memory_bytes: int | None = Field(None, ge=1)
    """Override the measured usable memory."""
    flops: float | None = Field(None, gt=0)
    """Override the measured compute speed (FLOP/s)."""
    bandwidth_bytes_per_s: float | None = Field(None, gt=0)
    """Override the measured link bandwidth to every peer."""

    _ports = field_validator("pipeline_port", "ring_port", "metrics_port")(
        lambda v: v if v is None else _check_port(v)
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", v):
            raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {v!r}")
        return v

    @field_validator("public_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not _is_z85_key(v):
            raise ValueError("public_key must be a 40-character Z85 CURVE key from `ravq keygen`")
        return v


def _is_z85_key(v: str) -> bool:
    return len(v) == 40 and re.fullmatch(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}", v) is not None


class SecurityConfig(_Strict):
    curve: bool = False
    """Encrypt and authenticate every socket with CURVE; requires public_key on broker and nodes."""
    key_dir: str | None = None
    """Directory holding NAME.key_secret files (from `ravq keygen`)."""


class Topology(_Strict):
    task: str
    """Importable module (or module:attribute) offering the task interface."""
    seed: int = 0
    """Seed for model initialisation and data order."""
    training: TrainingConfig = TrainingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    limits: LimitConfig = LimitConfig()
    security: SecurityConfig = SecurityConfig()
    broker: BrokerConfig
    nodes: list[NodeConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Topology:
        names: set[str] = set()
        endpoints: dict[tuple[str, int], str] = {
            (self.broker.host, self.broker.pub_port): "broker.pub_port",
        }
        _claim(endpoints, (self.broker.host, self.broker.router_port), "broker.router_port")
        if self.broker.metrics_port is not None:
            _claim(endpoints, (self.broker.host, self.broker.metrics_port), "broker.metrics_port")
        for i, node in enumerate(self.nodes):
            if node.name in names:
                raise ValueError(f"nodes[{i}].name: duplicate node name {node.name!r}")
            names.add(node.name)
            for field in ("pipeline_port", "ring_port", "metrics_port"):
                port = getattr(node, field)
                if port is not None:
                    _claim(endpoints, (node.host, port), f"nodes[{i}].{field}")
        clustered = [n.cluster is not None for n in self.nodes]
        if any(clustered) and not all(clustered):
            raise ValueError("nodes: set 'cluster' on every node or on none (then the planner chooses)")
        if self.security.curve:
            if self.broker.public_key is None:
                raise ValueError("broker.public_key: required when security.curve is true")
            for i, node in enumerate(self.nodes):
                if node.public_key is None:
                    raise ValueError(f"nodes[{i}].public_key: required when security.curve is true")
        return self

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ConfigError(f"--name: no node named {name!r} in the topology (have: "
                          f"{', '.join(n.name for n in self.nodes)})")


def _claim(seen: dict[tuple[str, int], str], endpoint: tuple[str, int], field: str) -> None:
    if endpoint in seen:
        raise ValueError(f"{field}: port {endpoint[1]} on {endpoint[0]} is already used by {seen[endpoint]}")
    seen[endpoint] = field


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in first["loc"]).replace(".[", "[")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field (typo?)"
    elif first["type"] == "missing":
        msg = "required field is missing"
    elif "input" in first and first["type"] not in ("value_error",):
        msg = f"{msg} (got {first['input']!r})"
    return f"{loc}: {msg}" if loc else msg


def parse_topology(data: Any, source: str = "topology") -> Topology:
    """Validate already-parsed YAML/JSON data; raise ConfigError with one line on failure."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at top level, got {type(data).__name__}")
    try:
        topo = Topology.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_error(err)}") from None
    try:
        resolve_task_module(topo.task)
    except ConfigError as err:
        raise ConfigError(f"{source}: task: {err}") from None
    return topo


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    return parse_topology(data, str(path))


def resolve_task_module(spec: str) -> Any:
    """Import ``module`` or ``module:attr`` and check it offers the task interface."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"cannot import task module {module_name!r}: {err}") from None
    if attr:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ConfigError(f"task module {module_name!r} has no attribute {attr!r}") from None
    missing = [f for f in TASK_FUNCTIONS if not callable(getattr(obj, f, None))]
    if missing:
        raise ConfigError(f"task {spec!r} lacks {', '.join(missing)}")
    return obj


TASK_FUNCTIONS = ("build_model", "example_inputs", "loss_fn", "train_batches", "make_optimizer")

DeviceKind = Literal["cpu", "cuda", "mps"]


class ClusterPlan(_Strict):
    nodes: list[str] = Field(min_length=1)
    """Node names in pipeline order: nodes[0] is stage 0 and reads data."""
    cuts: list[str] = []
    """Module names (in the unsplit model) where stages 1..n-1 begin; len(cuts) == len(nodes) - 1."""

    @model_validator(mode="after")
    def _shape(self) -> ClusterPlan:
        if len(self.cuts) != len(self.nodes) - 1:
            raise ValueError(f"cuts: {len(self.nodes)} stages need {len(self.nodes) - 1} cuts, got {len(self.cuts)}")
        return self


class Plan(_Strict):
    epoch: int = Field(0, ge=0)
    """Increases with every change the broker publishes."""
    clusters: list[ClusterPlan] = Field(min_length=1)
    excluded: list[int] = []
    """Clusters currently dropped from the all-reduce rings (dead member)."""
    predicted_samples_per_s: float | None = None
    """The planner's prediction, when the plan came from the planner."""

    def locate(self, name: str) -> tuple[int, int]:
        """(cluster, stage) of a node."""
        for c, cluster in enumerate(self.clusters):
            if name in cluster.nodes:
                return c, cluster.nodes.index(name)
        raise KeyError(name)


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read plan: {err}") from None
    if isinstance(data, dict) and "plan" in data:
        data = data["plan"]
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{path}: {_format_error(err)}") from None
