"""A node's pipeline links: the ROUTER it binds and a DEALER to each stage of its cluster it sends to.

Owns the sockets of the pipeline (docs/design.md, sockets set 1) and which peer is which stage.  It turns
the compute thread's ``Outbound`` work into FORWARD/BACKWARD messages (and TIED ones between the stages
holding copies of a tied weight, ``ravq.stage.tied_step``) and hands what arrives to the
stage, dropping (and counting) whatever belongs to another generation of the cluster or to nobody.
When a standby replaces a lost peer, ``replace`` re-points the links at it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from ravq.codec.compress import Packed
from ravq.config import Topology
from ravq.config.routes import DIAL, RELAY, relays, route
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions, endpoint
from ravq.net.routed import Links, RoutedLink
from ravq.net.transport import Context, Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType
from ravq.stage.pipeline import StageWorker
from ravq.stage.types import Outbound

log = logging.getLogger(__name__)

_KINDS = {"fwd": MsgType.FORWARD, "bwd": MsgType.BACKWARD, "tied": MsgType.TIED, "eval": MsgType.FORWARD}


class StageLinks:
    def __init__(self, *, ctx: Context, topology: Topology, name: str, metrics: Metrics, limits: DecodeLimits,
                 sock_opts: SocketOptions, generation: Callable[[], int]) -> None:
        self.ctx, self.topology, self.name, self.metrics = ctx, topology, name, metrics
        self.limits, self.sock_opts, self.generation = limits, sock_opts, generation
        self.outlinks: dict[int, Outlink | RoutedLink] = {}
        self.stage_of: dict[str, int] = {}
        """Stage index of every node of this cluster, by name: who may send to this stage."""
        self.inbox: Inbox | None = None
        self.outbound: asyncio.Queue[Outbound] = asyncio.Queue()
        """What the compute thread produced, in order; ``send_loop`` sends it."""
        self._loop = asyncio.get_running_loop()
        """The event loop these links live on (``emit`` hands work to it from the compute thread)."""
        self.reach: dict[str, bool] = {}
        """Who can be dialled (``ravq.config.routes``), as ``open`` was told."""
        self._links: Links | None = None

    def bind(self) -> None:
        """Bind this node's pipeline port (before the broker dials it back)."""
        config = self.topology.node(self.name)
        bind = config.bind_host or config.host
        self.inbox = Inbox.bind(self.ctx, endpoint(bind, config.pipeline_port), "pipeline", self.metrics,
                                self.limits, self.sock_opts, me=self.name)
        self._links = Links(ctx=self.ctx, inbox=self.inbox, me=self.name, socket="pipeline",
                            metrics=self.metrics, limits=self.limits, opts=self.sock_opts,
                            port_of={n.name: (n.host, n.pipeline_port) for n in self.topology.nodes})

    def open(self, cluster_nodes: Sequence[str], peers: Iterable[int], *, reach: dict[str, bool]) -> None:
        """Link to the stages ``peers`` of the cluster (and to stage 0, which may send here: a peer
        behind NAT or a relay must be dialled even by a stage that only receives from it); ``reach``:
        who can be dialled."""
        if self.inbox is None:
            self.bind()
        self.reach = dict(reach)
        self.stage_of = {n: i for i, n in enumerate(cluster_nodes)}
        me = self.stage_of.get(self.name, -1)
        for s in sorted(set(peers) - {me}):
            self.outlinks[s] = self._connect(cluster_nodes[s])
        if me > 0 and 0 not in self.outlinks and \
                route(self.name, cluster_nodes[0], self.reach, relays(self.topology)).kind in (DIAL, RELAY):
            self.outlinks[0] = self._connect(cluster_nodes[0])

    @property
    def routes(self) -> dict[str, str]:
        """Route of each pipeline link, by peer (``ravq.net.routed.Links.routes``)."""
        return dict(self._links.routes) if self._links is not None else {}

    def _connect(self, node: str) -> Outlink | RoutedLink:
        assert self._links is not None
        return self._links.open(node, route(self.name, node, self.reach, relays(self.topology)))

    def replace(self, renamed: dict[str, str], cluster_nodes: Sequence[str]) -> None:
        """Standbys took over lost peers (``renamed``: old name -> new): link to them instead."""
        self.stage_of = {n: i for i, n in enumerate(cluster_nodes)}
        for s, link in list(self.outlinks.items()):
            if link.peer in renamed:
                link.close()
                if self._links is not None:
                    self._links.forget(link.peer)
                self.outlinks[s] = self._connect(cluster_nodes[s])

    def emit(self, out: Outbound) -> None:
        """The compute thread's hand-off: ``out`` joins the send queue on the links' event loop."""
        self._loop.call_soon_threadsafe(self.outbound.put_nowait, out)

    async def drained(self) -> None:
        """Return once everything emitted so far has been sent (or dropped as of another generation)."""
        await self.outbound.join()

    async def send_loop(self) -> None:
        while True:
            out = await self.outbound.get()
            try:
                if out.generation != self.generation():
                    continue  # work of a generation the cluster dropped
                kind = _KINDS[out.kind]
                tensors = {n: t for n, t in out.tensors.items() if not isinstance(t, Packed)}
                packed = {n: t for n, t in out.tensors.items() if isinstance(t, Packed)}
                msg = Message(type=kind, sender=self.name, micro_batch=out.micro_batch, version=out.version,
                              meta={**out.meta, "gen": out.generation}, tensors=tensors, packed=packed)
                await self.outlinks[out.dest].send(msg)
            finally:
                self.outbound.task_done()

    async def read_loop(self, worker: StageWorker) -> None:
        assert self.inbox is not None
        while True:
            _, msg = await self.inbox.recv()
            source = self.stage_of.get(msg.sender)
            kind = next((k for k, t in _KINDS.items() if t == msg.type), None)
            if kind is None or source is None or msg.micro_batch is None:
                self.metrics.bad_messages.labels("pipeline", "unexpected_message").inc()
                continue
            if msg.meta.get("gen", 0) != self.generation():
                self.metrics.bad_messages.labels("pipeline", "other_generation").inc()
                continue
            reason = worker.deliver(kind, msg.micro_batch, source, {**msg.tensors, **msg.packed}, msg.meta)
            if reason is not None:
                self.metrics.bad_messages.labels("pipeline", reason).inc()
            for queue, depth in worker.queue_depths().items():
                self.metrics.queue_depth.labels(queue).set(depth)

    def close(self) -> None:
        for link in self.outlinks.values():
            link.close()
        if self.inbox is not None:
            self.inbox.close()
