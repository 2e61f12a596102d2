"""Topology schema: the YAML a user writes (training settings, timeouts, limits, security, the broker
and the nodes), validated into typed objects.

The YAML file is a thin loader into these models (``ravq.config.loading``); there is no second schema.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ravq.config.averaging import AveragingConfig
from ravq.config.backup import BackupConfig
from ravq.config.base import ConfigError, UserModel
from ravq.config.batch import check_declared as check_declared_batch
from ravq.config.batch import check_fields as check_batch_fields
from ravq.config.compress import CompressConfig
from ravq.config.recipe import LRScheduleConfig

Port = int


def _check_port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"port must be 1..65535, got {value}")
    return value


PREDICT_WEIGHTS = 2.0
"""Default horizon factor of weight prediction (measured on the demo task: bench_convergence.py)."""

EXTRAPOLATE_GRADIENTS = 2.0
"""Default delay compensation (ravq.stage.delay; measured in docs/convergence.md)."""

INFLIGHT_WARMUP_STEPS = 20
"""Default optimizer steps a cluster trains synchronously before it opens its pipeline
(docs/convergence.md)."""


class TrainingConfig(UserModel):
    micro_batch: int = Field(16, ge=1)
    """Samples per micro-batch."""
    steps: int = Field(200, ge=1)
    """Micro-batches each cluster trains on."""
    max_inflight: int | None = Field(None, ge=1)
    """Micro-batches in flight per cluster; bounds memory and staleness.  Default: the number of stages, with
    a stated batch at most ``update_every`` (less than one update stale; ``ravq.config.batch``)."""
    update_every: int = Field(1, ge=1)
    """Backwards accumulated before each optimizer step of a stage (derived from ``batch`` when it is set)."""
    batch: int | None = Field(None, ge=1)
    """Samples per optimizer step over all clusters, as one process would train: a stage's step sums batch /
    (micro_batch x clusters) micro-batches (``update_every``; ``ravq.config.batch``).  None: update_every."""
    _batch = model_validator(mode="after")(check_batch_fields)
    predict_weights: float = Field(PREDICT_WEIGHTS, ge=0, le=8)
    """Weight prediction: each forward runs at the weights extrapolated along the stage's last update
    by this many times its measured staleness, so the gradient is taken near the weights it is applied
    to.  0 runs forwards at the current weights (plain weight stashing).  No effect without staleness
    (max_inflight 1) or a momentum.  The last update is not checkpointed: a stale resume is not exact."""
    extrapolate_gradients: float = Field(EXTRAPOLATE_GRADIENTS, ge=0, le=8)
    """Delay compensation: a stale update hands the optimizer its gradient extrapolated by this many times its
    staleness along the change since the stage's previous update (``ravq.stage.delay``; 0: off).  None without
    staleness or a momentum, nor on Adam under PipeNAG after the warm-up (``compensates``); else after the
    warm-up Adam's second moment takes the raw gradient (``raw_second_moment``; docs/convergence.md)."""
    stale_correction: Literal["auto", "none", "pipenag"] = "auto"
    """How a stale stage's optimizer steps: ``none``, its own step; ``pipenag``, Nesterov's look-ahead with
    the momentum raised towards 0.99 with the stage's staleness (PipeNAG, ``ravq.stage.pipenag``; SGD with
    momentum, Adam, AdamW, ClusterAdam); ``auto`` (default), ``pipenag`` with an update per micro-batch
    (a whole update stale) when the optimizer is one of those, else ``none``.  No effect without staleness
    (max_inflight 1)."""
    schedule: Literal["async", "sync", "zero_bubble"] = "async"
    """``sync``: 1F1B with a flush per update, exactly synchronous; ``zero_bubble``: and split backwards."""
    inflight_warmup_steps: int = Field(INFLIGHT_WARMUP_STEPS, ge=0)
    """Asynchrony warm-up: the cluster's first this many optimizer steps train with one micro-batch in flight
    (synchronous pipeline training), then stage 0 opens the pipeline to ``max_inflight``.  Early on,
    while the loss falls fast, one step of delay made Adam overshoot on a small GPT-2 (docs/convergence.md);
    past that phase the same delay trains as well as synchronous training.  0 opens the pipeline at once."""
    sync_every: int = Field(10, ge=1)
    """Optimizer steps between parameter averages across clusters."""
    overlap_averaging: bool = True
    """Average a snapshot while training goes on and apply the difference; false waits for each round."""
    averaging_lead: int = Field(1, ge=1)
    """Optimizer steps a stage may train past the snapshot of its oldest unfinished averaging round
    before it waits for that round (overlapped averaging only; the in-flight micro-batches stay in
    flight).  Bounds how far a faster cluster runs ahead of the others: 1 lets the ring run during
    the next step and holds a stage only when another cluster is more than a step behind (on the demo
    task this cut the samples needed; bench_convergence.py).  Raise it when a round takes longer than
    a step, so the rings keep overlapping training."""
    outer_lr: float = Field(1.0, gt=0)
    """Step size of each average: 1 moves to the plain average; above 1 moves past it along the clusters'
    mean progress since the previous average (DiLoCo-style outer step)."""
    average_optimizer_state: bool = False
    """Also average floating-point optimizer state (e.g. Adam moments) across clusters."""
    checkpoint_every: int = Field(0, ge=0)
    """Optimizer steps between checkpoints of a stage; 0 writes only the final one."""
    checkpoint_dir: str | None = None
    """Directory for stage checkpoints; None disables checkpoints."""
    init_from: str | None = None
    """Weights a new run starts from instead of the seed's: what ``ravq export`` wrote (a ``.safetensors``
    file, or a directory of them such as a ``from_pretrained`` directory), read by each stage for its own
    tensors by name, whatever the cuts.  A stage that resumes from a checkpoint of the broker's run ignores
    it.  Re-planning keeps the trained weights this way (deploy/README.md); the optimizer state and the
    data position start afresh."""
    ring_chunk_bytes: int = Field(4 << 20, ge=1024)
    """Piece size in which ring all-reduce streams a chunk."""
    resume: bool | None = None
    """Deprecated and ignored: every node resumes from the newest checkpoint of the broker's run in
    checkpoint_dir (a restart never starts from the seed); a new run is started with `ravq broker
    --new-run` or a new checkpoint directory.  Setting it logs a warning."""
    log_every: int = Field(50, ge=1)
    """Optimizer steps between a node's progress lines at INFO (loss, samples/s, staleness, waits)."""
    compress: CompressConfig = CompressConfig()
    """Compression of pipeline and ring traffic (fewer bytes on slow links)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast of forwards and the loss on the stage's device (weights and optimizer state stay fp32):
    bf16, or fp16 with a dynamic loss scale the cluster's stages agree on (docs/training.md)."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """Learning-rate schedule, stepped by the cluster's optimizer step on every stage alike."""
    clip_grad_norm: float | None = Field(None, gt=0)
    """Clip each optimizer step's gradient to this global norm (over all stages of the cluster; the stages
    exchange their squared norms along the pipeline).  None: no clipping."""
    eval_every: int = Field(0, ge=0)
    """Optimizer steps between evaluations over the task's eval_batches; 0: never."""
    eval_batches: int = Field(8, ge=1)
    """Micro-batches of held-out data per evaluation."""


class TimeoutConfig(UserModel):
    connect_s: float = Field(120.0, gt=0)
    """How long a node waits for the broker's plan and its cluster's peers at start."""
    request_s: float = Field(5.0, gt=0)
    """Timeout of one request to the broker."""
    peer_s: float = Field(120.0, gt=0)
    """A node whose cluster has been paused this long logs a warning (it keeps waiting; see give_up_s)."""
    ring_step_s: float = Field(30.0, gt=0)
    """Longest wait for one ring all-reduce step before the round is aborted."""
    drain_s: float = Field(20.0, gt=0)
    """On SIGTERM/SIGINT: how long a node may drain before it is forced to exit."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    """Interval of node heartbeats (with live statistics) to the broker."""
    lost_s: float = Field(6.0, gt=0)
    """A node silent this long is lost: its cluster pauses and leaves the rings (>= 2 heartbeats)."""
    give_up_s: float | None = Field(None, gt=0)
    """A node whose cluster has been paused this long exits 1; None: it waits for as long as it takes."""
    reach_s: float = Field(3.0, gt=0)
    """How long the broker's dial-back of a starting node's ports may take before it counts as behind NAT."""
    replace_s: float = Field(30.0, gt=0)
    """A lost node not back this long has its stage handed to a standby node whose memory fits."""

    @model_validator(mode="after")
    def _lost_after_heartbeats(self) -> TimeoutConfig:
        if self.lost_s < 2 * self.heartbeat_interval_s:
            raise ValueError(f"lost_s: must be at least 2 heartbeats (2 x heartbeat_interval_s = "
                             f"{2 * self.heartbeat_interval_s:g}s), got {self.lost_s:g}")
        return self


class LimitConfig(UserModel):
    max_message_bytes: int | None = Field(None, ge=1024)
    """ZMQ_MAXMSGSIZE: the largest single frame a socket accepts (ZeroMQ drops a connection that announces
    a larger one before allocating it).  Default: derived from the model, twice the largest tensor frame
    the stage can legitimately receive (activations, gradients, targets, ring pieces), at least 1 MiB;
    set it when a task's tensor shapes vary between micro-batches."""
    max_header_bytes: int = Field(64 << 10, ge=256)
    """Largest accepted header frame."""
    max_frames: int = Field(1024, ge=2)
    """Most frames accepted in one message."""


class BrokerConfig(UserModel):
    host: str = Field("127.0.0.1", min_length=1)
    """Address the nodes connect to (and the broker binds, unless bind_host says otherwise)."""
    bind_host: str | None = Field(None, min_length=1)
    """Address the broker binds (default: host), e.g. 0.0.0.0 behind a port forward."""
    pub_port: Port
    """PUB socket: plan and membership updates."""
    router_port: Port
    """ROUTER socket: register, heartbeat, snapshot, status."""
    metrics_port: Port | None = None
    """Prometheus HTTP port of the broker; None: no metrics server."""
    public_key: str | None = None
    """CURVE public key (Z85, 40 characters) of the broker."""
    relay_port: Port | None = None
    """The broker's PC also relays (``ravq.net.relay``) on this port, as the relay named ``broker`` (with
    the broker's key): traffic between two nodes behind NAT goes through it.  None: no relay here."""
    state_dir: str | None = None
    """Directory where the broker keeps the training run (its id, plan epoch and membership), so that a
    restarted broker continues the same run and every node resumes from that run's checkpoints
    (``brokers.run``).  None: ``broker/`` in the unit's ``StateDirectory=`` (``$STATE_DIRECTORY``), else
    ``broker/`` next to the checkpoints (``training.checkpoint_dir``); without checkpoints the run lasts
    as long as the broker process (there is nothing to resume)."""
    backup: BackupConfig | None = None
    """A backup broker that takes over when this one fails (Binary Star); None: this broker alone."""

    _ports = field_validator("pub_port", "router_port", "metrics_port", "relay_port")(
        lambda v: v if v is None else _check_port(v)
    )
    _key = field_validator("public_key")(lambda v: _check_key(v))


class NodeConfig(UserModel):
    name: str
    """Unique node name: 1-64 letters, digits, '_', '.' or '-' (it names files and systemd units)."""
    host: str = Field("127.0.0.1", min_length=1)
    """Address other nodes use to reach this node."""
    bind_host: str | None = Field(None, min_length=1)
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
    standby: bool = False
    """A spare in no cluster: it waits and takes the stage of a node lost for ``timeouts.replace_s`` (its
    memory must fit).  No ``cluster`` with it; the other nodes' clusters need no plan file."""
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
    reachable: bool | None = None
    """Whether other PCs can dial this node's ports.  None: measured when the node starts (the broker
    dials its advertised address back); false: behind NAT (or a firewall), never dialled: the node
    dials out to reachable peers, and reaches other unreachable ones through a relay."""

    _ports = field_validator("pipeline_port", "ring_port", "metrics_port")(
        lambda v: v if v is None else _check_port(v)
    )

    _name = field_validator("name")(lambda v: _check_name(v))

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", v):
            raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {v!r}")
        return v

    _key = field_validator("public_key")(lambda v: _check_key(v))


def _check_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
        raise ValueError(f"name must be 1-64 letters, digits, '_', '.' or '-', got {v!r}")
    return v


def _check_key(v: str | None) -> str | None:
    if v is not None and not _is_z85_key(v):
        # Never echo the value: a secret key pasted here by mistake must not end up in logs.
        got = f"{len(v)} characters" if len(v) != 40 else "characters outside the Z85 alphabet"
        raise ValueError(f"must be a 40-character Z85 CURVE public key from `ravq keygen` (got {got})")
    return v


def _is_z85_key(v: str) -> bool:
    return len(v) == 40 and re.fullmatch(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}", v) is not None


class RelayConfig(UserModel):
    """A reachable PC that forwards traffic between two nodes behind NAT (``ravq relay``)."""

    name: str
    """Unique among nodes and relays (names files and systemd units); ``broker`` is the broker's relay."""
    host: str = Field(min_length=1)
    """Address nodes dial to reach the relay."""
    bind_host: str | None = Field(None, min_length=1)
    """Address to bind (default: host)."""
    port: Port
    """ROUTER every node behind NAT dials."""
    metrics_port: Port | None = None
    """Prometheus HTTP port; None: no metrics server."""
    public_key: str | None = None
    """CURVE public key (Z85, 40 characters) from `ravq keygen`."""
    bandwidth_bytes_per_s: float | None = Field(None, gt=0)
    """Its uplink (= downlink) for the planner; None: as fast as the nodes' links."""
    queue_bytes: int = Field(64 << 20, ge=1 << 20)
    """Most bytes queued for one destination node; frames beyond are counted and dropped."""

    _ports = field_validator("port", "metrics_port")(lambda v: v if v is None else _check_port(v))
    _key = field_validator("public_key")(lambda v: _check_key(v))

    _name = field_validator("name")(lambda v: _check_name(v))


class SecurityConfig(UserModel):
    curve: bool = False
    """Encrypt and authenticate every socket with CURVE; requires public_key on broker and nodes."""
    key_dir: str | None = None
    """Directory holding NAME.key_secret files (from `ravq keygen`)."""


class Topology(UserModel):
    task: str
    """The task: an importable module, ``module:attribute``, or a file ``path/to/task.py[:attribute]``
    (relative to the current folder: a unit's ``WorkingDirectory=``); ``ravq.config.task``."""
    task_options: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    """Settings for the task (its data, its size): the task's ``configure(**task_options)`` returns the task
    trained; empty: the task as imported (docs/tasks.md)."""
    seed: int = 0
    """Seed for model initialisation and data order."""
    training: TrainingConfig = TrainingConfig()
    averaging: AveragingConfig = AveragingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    limits: LimitConfig = LimitConfig()
    security: SecurityConfig = SecurityConfig()
    broker: BrokerConfig
    nodes: list[NodeConfig] = Field(min_length=1)
    relays: list[RelayConfig] = Field(default_factory=list)
    """Relays for nodes behind NAT, besides the broker's (``broker.relay_port``)."""

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
        if self.broker.relay_port is not None:
            _claim(endpoints, (self.broker.host, self.broker.relay_port), "broker.relay_port")
        for i, relay in enumerate(self.relays):
            if relay.name in names or relay.name == "broker":
                raise ValueError(
                    f"relays[{i}].name: {relay.name!r} is already the name of a node or the broker"
                )
            names.add(relay.name)
            for field in ("port", "metrics_port"):
                if getattr(relay, field) is not None:
                    _claim(endpoints, (relay.host, getattr(relay, field)), f"relays[{i}].{field}")
        _check_clusters(self.nodes)
        check_declared_batch(self.training, self.nodes)
        if self.security.curve:
            if self.broker.public_key is None:
                raise ValueError("broker.public_key: required when security.curve is true")
            for i, node in enumerate(self.nodes):
                if node.public_key is None:
                    raise ValueError(f"nodes[{i}].public_key: required when security.curve is true")
            for i, relay in enumerate(self.relays):
                if relay.public_key is None:
                    raise ValueError(f"relays[{i}].public_key: required when security.curve is true")
        return self

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ConfigError(f"--name: no node named {name!r} in the topology (have: "
                          f"{', '.join(n.name for n in self.nodes)})")


def _check_clusters(nodes: list[NodeConfig]) -> None:
    for i, node in enumerate(nodes):
        if node.standby and (node.cluster is not None or node.stage is not None):
            raise ValueError(f"nodes[{i}]: a standby is in no cluster; remove its 'cluster' and 'stage' or "
                             "'standby: true'")
    training = [(i, n) for i, n in enumerate(nodes) if not n.standby]
    if not training:
        raise ValueError("nodes: every node is a standby; at least one must train")
    with_cluster = [i for i, n in training if n.cluster is not None]
    if with_cluster and len(with_cluster) < len(training):
        i = next(i for i, n in training if n.cluster is None)
        raise ValueError(f"nodes[{i}].cluster: missing, but nodes[{with_cluster[0]}] sets one; "
                         "set 'cluster' on every node or on none (then the planner chooses), or "
                         "'standby: true' on a spare")
    positions: dict[tuple[int, int], int] = {}
    for i, node in enumerate(nodes):
        if node.cluster is None or node.stage is None:
            continue
        key = (node.cluster, node.stage)
        if key in positions:
            raise ValueError(f"nodes[{i}].stage: stage {node.stage} of cluster {node.cluster} "
                             f"is already taken by nodes[{positions[key]}]")
        positions[key] = i


def _claim(seen: dict[tuple[str, int], str], endpoint: tuple[str, int], field: str) -> None:
    if endpoint in seen:
        raise ValueError(f"{field}: port {endpoint[1]} on {endpoint[0]} is already used by {seen[endpoint]}")
    seen[endpoint] = field
