"""What a stage is (its place in the pipeline) and what it holds between micro-batches (its state).

``StagePlace`` is fixed when the stage is built; ``StageState`` changes as it trains: the weight version,
the cluster generation its messages carry, the micro-batches finished, the stash of those in flight and
the tensors it expects from each producer.  ``StageWorker`` (``ravq.stage.pipeline``) owns both and
hands them to its collaborators (recipe, evaluation, tied weights, arrivals) at construction, so
they read what they use without the worker.  ``Outbox`` stamps and hands on what the stage sends;
``OpTimer`` times an operation less the waits inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ravq.codec import compress
from ravq.codec.compress import Format, Packed
from ravq.cut.split import StageSpec
from ravq.stage.stash import Stashed
from ravq.stage.tensors import Expected
from ravq.stage.types import MicroBatch, Outbound

Emit = Callable[[Outbound], None]
"""Hands a message the stage wants sent to the node's sockets (``StageWorker.run``'s ``emit``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlace:
    """Where a stage sits: its spec, the pipeline's length, its cluster and device."""

    spec: StageSpec
    num_stages: int
    cluster: int
    device: torch.device
    model_input_needs: dict[int, list[int]] = field(default_factory=dict)
    """Stage -> indices of the model inputs it reads (``ravq.stage.tensors.model_input_needs``)."""

    @property
    def is_first(self) -> bool:
        return self.spec.index == 0

    @property
    def is_last(self) -> bool:
        return self.spec.index == self.num_stages - 1

    def first_destinations(self) -> list[int]:
        """Stages stage 0 sends to: consumers of its outputs, of model inputs, and the last stage."""
        return sorted(set(self.spec.consumer_stages) | {self.num_stages - 1} | set(self.model_input_needs))


@dataclass(kw_only=True, slots=True)
class StageState:
    """A stage's training state besides its weights and optimizer (compute thread, unless the
    scheduler's lock is held)."""

    expected_fwd: dict[int, Expected]
    """Producer stage -> the tensors its FORWARD messages must carry (names, shapes, dtypes)."""
    version: int = 0
    """Optimizer steps applied to the weights (checkpointed; an adopted copy brings its own)."""
    generation: int = 0
    """The cluster generation the stage's work belongs to (``ravq.swarm.churn``)."""
    trained: int = 0
    """Micro-batches finished (backward done here); set to stage 0's count at every resume."""
    stash: dict[MicroBatch, Stashed] = field(default_factory=dict)
    """The micro-batches between their forward and their backward (``ravq.stage.stash``)."""

    def count_trained(self) -> None:
        """A micro-batch's backward is done here."""
        self.trained += 1

    def count_step(self) -> None:
        """An optimizer step was applied."""
        self.version += 1

    def set_counts(self, *, version: int | None = None, trained: int | None = None) -> None:
        """The version or count of another origin: a checkpoint, a holder's copy, a resume."""
        self.version = self.version if version is None else version
        self.trained = self.trained if trained is None else trained

    def set_generation(self, generation: int) -> None:
        """The work from now on belongs to cluster generation ``generation``."""
        self.generation = generation


class Outbox:
    """What the stage sends, stamped with its version and generation at the moment it is sent."""

    def __init__(self, state: StageState, cluster: int, fmt: Format, block: int) -> None:
        self._state, self._cluster, self._format, self._block = state, cluster, fmt, block
        self._emit: Emit = lambda out: None

    def connect(self, emit: Emit) -> None:
        """From now on messages go to ``emit`` (each ``StageWorker.run``)."""
        self._emit = emit

    def message(self, kind: str, dest: int, micro_batch: MicroBatch,
                tensors: dict[str, torch.Tensor | Packed], meta: dict[str, object] | None = None) -> Outbound:
        return Outbound(kind, dest, micro_batch, self._state.version, tensors, self._state.generation,
                        {} if meta is None else meta)

    def send(self, kind: str, dest: int, index: int, tensors: dict[str, torch.Tensor | Packed],
             meta: dict[str, object] | None = None) -> None:
        """A message of this stage's cluster about data index ``index`` to the connected ``emit``."""
        self._emit(self.message(kind, dest, (self._cluster, index), tensors, meta))

    def pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | Packed]:
        """Activations or gradients as they leave this stage: compressed unless the format is none."""
        return {name: compress.pack(t, self._format, self._block) for name, t in tensors.items()}


class OpTimer:
    """Compute time of the current forward, backward or step: the clock's time less what it waited."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._waited = 0.0

    def waited(self, seconds: float) -> None:
        """The compute thread waited ``seconds`` (an update hook held back for an averaging round)."""
        self._waited += seconds

    def restart(self) -> float:
        """Start timing with nothing waited yet; the start time."""
        self._waited = 0.0
        return self.clock()

    def clear(self) -> None:
        """Between operations: nothing to take out."""
        self._waited = 0.0

    def elapsed(self, t0: float) -> float:
        """Seconds computed since ``t0``, less the waits since the last ``elapsed`` or ``clear``."""
        seconds = max(0.0, self.clock() - t0 - self._waited)
        self._waited = 0.0
        return seconds
