"""Catch-up: a stage that (re)joins a running swarm loads its weights from live holders in other clusters.

The holders of a stage's parameters in another cluster are its ring peers (cut points may differ, so
the names may be spread over several of them).  The stage asks each, over the ring sockets, for its
share: a CATCHUP_REQ names the tensors; the CATCHUP reply carries them as raw tensor frames (the wire
format; no pickle, no safetensors on the wire), together with the optimizer state of each parameter
(``name::key`` frames, Adam's moments and step).  The holder copies them in its compute thread, so a
reply is one consistent version of its stage, never a mix of two optimizer steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from ravq.average.segments import OPTIM_SEP
from ravq.config import Plan
from ravq.net.wire import Message, MsgType
from ravq.stage.pipeline import StageWorker

log = logging.getLogger(__name__)

MAX_NAMES_PER_REQUEST = 256
"""Keeps a request's header and a reply's frame count well inside the decode limits."""


class CatchupError(RuntimeError):
    """No complete copy of this stage could be fetched."""


class CatchupLink(Protocol):
    """A link to one holder that a request goes out on and its reply comes back on (a node's ring link:
    ``ravq.net.transport.Outlink``, or ``ravq.net.routed.RoutedLink`` over its own ROUTER)."""

    @property
    def peer(self) -> str:
        """The holder's name."""

    async def send(self, msg: Message) -> None:
        """Send one message to the holder."""

    async def recv(self, timeout_s: float) -> Message:
        """The holder's next reply; TimeoutError after ``timeout_s``."""


def stage_tensors(worker: StageWorker, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Copies (on cpu) of the stage's parameters and buffers named in ``names`` (all if None), each
    parameter followed by its tensor optimizer state as ``name::key``.  Compute thread only."""
    wanted = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in {**worker.params, **worker.buffers}.items():
            if wanted is not None and name not in wanted:
                continue
            out[name] = value.detach().to("cpu").contiguous().clone()
            state = worker.optimizer.state.get(value, {}) if name in worker.params else {}
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    out[f"{name}{OPTIM_SEP}{key}"] = state[key].detach().to("cpu").contiguous().clone()
    return out


def apply_tensors(worker: StageWorker, tensors: Mapping[str, torch.Tensor]) -> int:
    """Load fetched tensors into the stage (compute thread): weights, buffers and optimizer state.
    Returns how many tensors it loaded."""
    loaded = 0
    worker.before_weight_change()
    with torch.no_grad():
        for name, value in tensors.items():
            base, _, key = name.partition(OPTIM_SEP)
            if key:
                param = worker.params[base]
                worker.optimizer.state.setdefault(param, {})[key] = value.to(param.device).clone()
            else:
                target: torch.Tensor = worker.params[base] if base in worker.params else worker.buffers[base]
                target.copy_(value.to(target.device))
            loaded += 1
    worker.forget_weight_history()
    return loaded


def holders(plan: Plan, me_cluster: int, owners: Sequence[Mapping[str, str]],
            names: Sequence[str], source: int | None = None) -> dict[str, list[str]]:
    """Node -> the names it holds, in cluster ``source`` (the broker's choice: the freshest training
    cluster) when it trains, else in the first training cluster other than ``me_cluster``."""
    sources = [c for c in range(len(plan.clusters)) if c != me_cluster and c not in plan.excluded]
    if not sources:
        raise CatchupError("no other cluster is training")
    if source in sources:
        sources.insert(0, sources.pop(sources.index(source)))
    by_node: dict[str, list[str]] = {}
    for name in names:
        by_node.setdefault(owners[sources[0]][name], []).append(name)
    return by_node


async def fetch(outlinks: Mapping[str, CatchupLink], me: str, by_node: Mapping[str, Sequence[str]],
                timeout_s: float, lineages: dict[str, dict[str, Any]] | None = None,
                ) -> dict[str, torch.Tensor]:
    """Ask every holder for its names (all at once); CatchupError if any part does not arrive.  What
    each holder says of its copy (run id, version: ``ravq.persist.lineage``) goes into ``lineages``: the
    oldest part it sent, when a holder answered several requests."""

    async def one(node: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for i in range(0, len(names), MAX_NAMES_PER_REQUEST):
            part = list(names[i:i + MAX_NAMES_PER_REQUEST])
            tensors, lineage = await _request(outlinks[node], me, part, timeout_s)
            got.update(tensors)
            if lineages is not None:
                held = lineages.get(node)
                if held is None or not isinstance(held.get("version"), int) or (
                        isinstance(lineage.get("version"), int) and lineage["version"] < held["version"]):
                    lineages[node] = lineage
        return got

    try:
        parts = await asyncio.gather(*(one(n, names) for n, names in by_node.items()))
    except TimeoutError as err:
        raise CatchupError(str(err)) from None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


async def _request(link: CatchupLink, me: str, names: list[str],
                   timeout_s: float) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    request_id = os.urandom(6).hex()
    await link.send(Message(type=MsgType.CATCHUP_REQ, sender=me, meta={"id": request_id, "names": names}))
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        reply = await link.recv(max(0.01, deadline - asyncio.get_running_loop().time()))
        if reply.type == MsgType.CATCHUP and reply.meta.get("id") == request_id:
            break  # anything else is a late reply to an earlier request that timed out
    if reply.meta.get("error"):
        raise CatchupError(f"{link.peer}: {reply.meta['error']}")
    missing = [n for n in names if n not in reply.tensors]
    unasked = [n for n in reply.tensors if n.partition(OPTIM_SEP)[0] not in set(names)]
    if missing or unasked:
        raise CatchupError(f"{link.peer}: reply lacks {missing[:3]} or adds {unasked[:3]}")
    lineage = reply.meta.get("lineage")
    return dict(reply.tensors), (dict(lineage) if isinstance(lineage, dict) else {})


def reply_for(me: str, request: Message, tensors: dict[str, torch.Tensor] | None, error: str = "",
              lineage: dict[str, Any] | None = None) -> Message:
    """A CATCHUP reply: the tensors and, with ``lineage``, what the copy is (run id, version)."""
    meta: dict[str, Any] = {"id": str(request.meta.get("id", ""))[:32]}
    if error:
        meta["error"] = error[:200]
    if lineage is not None:
        meta["lineage"] = lineage
    return Message(type=MsgType.CATCHUP, sender=me, meta=meta, tensors=tensors or {})


def requested_names(request: Message, worker: StageWorker) -> list[str] | None:
    """The names a CATCHUP_REQ asks for, if they are a list of this stage's tensors (else None)."""
    names = request.meta.get("names")
    if not isinstance(names, list) or not names or len(names) > MAX_NAMES_PER_REQUEST:
        return None
    held = set(worker.params) | set(worker.buffers)
    if not all(isinstance(n, str) and n in held for n in names):
        return None
    return names
