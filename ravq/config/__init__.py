"""The configuration every layer may use: the topology a user writes, the plan, and their loaders.

- ``base``: ``ConfigError`` and the strict model bases;
- ``topology``: the topology schema (training settings, timeouts, limits, security, broker, nodes);
- ``plan``: ``Plan`` and ``ClusterPlan``;
- ``task``: resolving the task module a topology names;
- ``loading``: reading YAML files into those models, with one-line errors.
"""

from ravq.config.base import ConfigError
from ravq.config.compress import CompressConfig
from ravq.config.loading import load_plan, load_topology, parse_topology
from ravq.config.plan import ClusterPlan, Plan
from ravq.config.recipe import LRScheduleConfig
from ravq.config.task import TASK_FUNCTIONS, portable_task_spec, resolve_task_module
from ravq.config.topology import (
    EXTRAPOLATE_GRADIENTS,
    INFLIGHT_WARMUP_STEPS,
    PREDICT_WEIGHTS,
    BrokerConfig,
    LimitConfig,
    NodeConfig,
    RelayConfig,
    SecurityConfig,
    TimeoutConfig,
    Topology,
    TrainingConfig,
)

__all__ = [
    "EXTRAPOLATE_GRADIENTS",
    "INFLIGHT_WARMUP_STEPS",
    "PREDICT_WEIGHTS",
    "TASK_FUNCTIONS",
    "BrokerConfig",
    "ClusterPlan",
    "CompressConfig",
    "ConfigError",
    "LRScheduleConfig",
    "LimitConfig",
    "NodeConfig",
    "Plan",
    "RelayConfig",
    "SecurityConfig",
    "TimeoutConfig",
    "Topology",
    "TrainingConfig",
    "load_plan",
    "load_topology",
    "parse_topology",
    "portable_task_spec",
    "resolve_task_module",
]
