"""A node process with a fault installed, for the fault tests (``tests.swarm.Swarm(faults=...)``).

    python -m tests.faulty_node FAULT node --topology ... --name ...   (then the arguments of ``ravq``)

The fault wraps one method of the real class in this process only, as hivemind's fault tests subclass
theirs; nothing in ``ravq`` knows of it:

- ``kill_in_round:N``: the node dies (SIGKILL, as a crash would) right after sending a ring piece of a
  round numbered N or later within its plan epoch (``ravq.node.ring_port.RingLinks.send``);
- ``kill_in_catchup``: the node dies when a peer asks it for a valid catch-up, before it answers
  (``ravq.average.averager.Averager``'s catch-up answer);
- ``kill_after_checkpoint:N``: the node dies right after its stage saved a checkpoint of version N or
  later (``ravq.node.checkpoints.StageCheckpoints.save``): a crash with a checkpoint to resume from.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from ravq.average import catchup
from ravq.average.averager import Averager
from ravq.average.rounds import ROUNDS_PER_EPOCH
from ravq.cli.main import main
from ravq.codec.compress import Packed
from ravq.net.wire import Message
from ravq.node.checkpoints import StageCheckpoints
from ravq.node.ring_port import RingLinks
from ravq.stage.pipeline import StageWorker


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_round(first: int) -> None:
    send = RingLinks.send

    async def send_then_die(self: RingLinks, peer: str, meta: dict[str, int],
                            tensor: torch.Tensor | Packed) -> None:
        await send(self, peer, meta, tensor)
        if meta["round"] % ROUNDS_PER_EPOCH >= first:
            _die()

    RingLinks.send = send_then_die  # type: ignore[method-assign]


def kill_in_catchup() -> None:
    answer = Averager._answer_catchup

    async def die_when_asked(self: Averager, identity: bytes, msg: Message) -> None:
        if catchup.requested_names(msg, self.worker) is not None:  # a valid request: die mid-way
            _die()
        await answer(self, identity, msg)

    Averager._answer_catchup = die_when_asked  # type: ignore[method-assign]


def kill_after_checkpoint(version: int) -> None:
    save = StageCheckpoints.save

    def save_then_die(self: StageCheckpoints, worker: StageWorker) -> None:
        save(self, worker)
        if worker.version >= version:
            _die()

    StageCheckpoints.save = save_then_die  # type: ignore[method-assign]


def install(fault: str) -> None:
    """Install ``fault`` (see the module's doc) in this process."""
    kind, _, arg = fault.partition(":")
    if kind == "kill_in_round":
        kill_in_round(int(arg))
    elif kind == "kill_in_catchup":
        kill_in_catchup()
    elif kind == "kill_after_checkpoint":
        kill_after_checkpoint(int(arg))
    else:
        raise ValueError(f"fault: unknown {fault!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
