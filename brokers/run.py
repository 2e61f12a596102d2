"""The training run as a durable object: its id, plan epoch and membership, kept in the broker's state
directory so that a restarted broker (a reboot, a power cut, an upgrade) continues the same run.

``DIR/run.json`` holds the run id, whether the run was started by an explicit ``--new-run``, the plan
the run started with (its clusters and cut points: what the stages' checkpoints were cut from) and the
current plan (with standby replacements) and its epoch.  It is written atomically (temporary file,
fsync, rename) whenever the plan changes, so a power cut leaves the previous or the new state, never a
torn one.  Starting a new run is explicit: ``ravq broker --new-run`` (or an empty state directory).
The state directory is ``broker.state_dir`` when the topology names one, else a default the broker
always uses (``state_dir_for``): ``broker/`` in the unit's ``StateDirectory=`` (``$STATE_DIRECTORY``),
else ``broker/`` next to the checkpoints (``training.checkpoint_dir``), so that the topology a user
writes first survives a power cut.
A plan that cuts the model differently from the run's is a new run too: the broker refuses it
without ``--new-run``, since no stage's checkpoint would fit it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ravq.config import ConfigError, Plan

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
DEFAULT_SUBDIR = "broker"
"""The default state directory's name inside ``$STATE_DIRECTORY`` or ``training.checkpoint_dir``."""


@dataclass(kw_only=True, slots=True)
class Run:
    run_id: str
    explicit: bool
    """Started by ``--new-run``: nodes set aside checkpoints of older runs instead of refusing them."""
    base: Plan
    """The plan the run started with (clusters and cut points)."""
    plan: Plan
    """The current plan (standbys that took over stages), with its epoch, as saved; while the broker runs,
    its book owns the plan (``brokers.book.Book.plan``) and the broker saves each new one here."""
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "explicit": self.explicit, "created_at": self.created_at,
                "base": self.base.model_dump(), "plan": self.plan.model_dump()}


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)


def _cuts(plan: Plan) -> list[list[str]]:
    return [list(c.cuts) for c in plan.clusters]


def state_dir_for(configured: str | None, checkpoint_dir: str | None, env: Mapping[str, str]) -> str | None:
    """Where the broker keeps the run: ``broker.state_dir``; else ``broker/`` in the systemd unit's
    ``StateDirectory=`` (``$STATE_DIRECTORY``, its first entry); else ``broker/`` next to the checkpoints.
    None only without checkpoints, where a restart has nothing to continue from."""
    if configured is not None:
        return configured
    systemd = env.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return str(Path(systemd) / DEFAULT_SUBDIR)
    if checkpoint_dir is not None:
        return str(Path(checkpoint_dir) / DEFAULT_SUBDIR)
    return None


def next_epoch(last: int) -> int:
    """A new plan epoch: the broker's clock in ms, above ``last``.  Round ids start from the epoch (they must
    grow, across broker restarts too), and rounds paced by time count from the instant it names
    (``ravq.average.group_rounds.epoch_began``), so every epoch names its own start."""
    return max(last + 1, int(time.time() * 1000))


def open_run(state_dir: str | Path | None, plan: Plan, *, new_run: bool) -> Run:
    """The run this broker serves: the one in ``state_dir`` (continued), or a new one (written there).
    ConfigError (one line) for a state file that cannot be read or a plan that does not fit the run."""
    epoch = max(plan.epoch, int(time.time() * 1000))  # round ids start from the epoch: it must grow
    if state_dir is None:
        run = Run(run_id=new_run_id(), explicit=new_run, base=plan,
                  plan=plan.model_copy(update={"epoch": epoch}), created_at=time.time())
        log.info("run %s: no state directory (no broker.state_dir, no checkpoint_dir): a restart of this "
                 "broker starts a new run, from the seed as every node does", run.run_id)
        return run
    path = Path(state_dir) / RUN_FILE
    stored = None if new_run else _read(path)
    if stored is None:
        run = Run(run_id=new_run_id(), explicit=new_run, base=plan,
                  plan=plan.model_copy(update={"epoch": epoch}), created_at=time.time())
        log.info("run %s: new (%s); state in %s", run.run_id,
                 "--new-run" if new_run else "no run in the state directory yet", path)
    else:
        run = _continue(stored, plan, epoch, path)
    try:
        save_run(state_dir, run)
    except OSError as err:
        raise ConfigError(f"{path}: cannot keep the run's state there ({err}); set broker.state_dir (or "
                          "`ravq broker --state-dir`) to a directory the broker may write") from None
    return run


def _continue(stored: Run, plan: Plan, epoch: int, path: Path) -> Run:
    if _cuts(plan) != _cuts(stored.base):
        raise ConfigError(f"the plan cuts the model differently from run {stored.run_id}'s ({path}: "
                          f"{_cuts(stored.base)}, now {_cuts(plan)}): its checkpoints do not fit it; "
                          f"pass --new-run, or move {path.parent} aside (the units), to start a new run with "
                          "this plan")
    nodes_now, nodes_then = [c.nodes for c in plan.clusters], [c.nodes for c in stored.base.clusters]
    current = stored.plan if nodes_now == nodes_then else plan  # keep standby replacements unless re-assigned
    if nodes_now != nodes_then:
        log.warning("run %s: the plan assigns nodes differently from the run's (%s, was %s); following it",
                    stored.run_id, nodes_now, nodes_then)
    epoch = max(epoch, stored.plan.epoch + 1)
    run = Run(run_id=stored.run_id, explicit=stored.explicit, base=plan,
              plan=current.model_copy(update={"epoch": epoch, "excluded": []}), created_at=stored.created_at)
    log.info("run %s: continued from %s (plan epoch %d)", run.run_id, path, epoch)
    return run


def _read(path: Path) -> Run | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # no run yet (saving it names a directory that cannot be)
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read the run state ({err}); fix or remove it, or pass --new-run") \
            from None
    try:
        return Run(run_id=str(data["run_id"]), explicit=bool(data.get("explicit")),
                   created_at=float(data.get("created_at", 0.0)), base=Plan.model_validate(data["base"]),
                   plan=Plan.model_validate(data["plan"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{path}: not a ravq run state ({err}); fix or remove it, or pass --new-run") \
            from None


def save_run(state_dir: str | Path | None, run: Run) -> None:
    """Write the run's state atomically (no-op without a state directory)."""
    if state_dir is None:
        return
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path, tmp = directory / RUN_FILE, directory / f".{RUN_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(run.to_json(), indent=1))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
