"""ravq's training as discrete events: asynchronous pipelines, credits, per-stage updates, overlapped
averaging with hold-back, rings streamed in pieces, and (optionally) failures and recovery.

What each node does, as ``ravq.stage.pipeline`` and ``ravq.average.averager`` do it:

- one compute thread per node takes a waiting backward before a waiting forward (in arrival order);
  stage 0 starts a new micro-batch only while fewer than ``max_inflight`` of its micro-batches await
  their backward (the credits; 1 for its first ``inflight_warmup_steps`` versions); the last stage runs
  forward, loss and backward in one go;
- activations go downstream and gradients upstream as messages on one stream per neighbour, over the
  sender's uplink, which its ring streams share (``engine``);
- after every ``update_every`` backwards the stage steps (version + 1), then, overlapped: waits while
  its oldest unfinished round's snapshot is ``averaging_lead`` or more versions old; every
  ``sync_every`` versions snapshots and queues a round (its compute thread waits when
  ``pending_rounds`` are already queued behind the running one).  Not overlapped: it waits for the
  round it just queued.  A node runs its rounds one after another, all its rings at once;
- a ring (one per segment: the holders of a run of blocks, one per cluster) does reduce-scatter then
  all-gather, 2(C-1) steps; at step t a member sends chunk (rank - t) mod C to its successor in pieces
  of ``piece_bytes``, piece j of step t leaving once piece j of step t-1 has arrived.  A member starts
  when its own node starts that round, so a ring finishes only once its slowest cluster has reached
  the round's version.  Large rings are simulated as flows (see ``Ring``);
- a failure stops the node's whole cluster (its in-flight micro-batches are lost and redone), rings
  with a member there abort after ``ring_timeout_s`` and later rounds leave that cluster out; after
  ``restart_s`` the cluster's nodes fetch their stages' weights from the holders in another cluster
  (catch-up: the stage's bytes over that link) and rejoin at that cluster's version.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from ravq.simulate.engine import INF, Connection, EventQueue, SharedResource
from ravq.simulate.rings import Ring
from ravq.simulate.state import Node, NodeRound
from ravq.simulate.world import SegmentSpec, World


class Simulation:
    def __init__(self, world: World) -> None:
        self.world, self.settings = world, world.settings
        s = self.settings
        self.q = EventQueue()
        self.rng = random.Random(s.seed)
        self.clusters: list[list[Node]] = []
        for c, stages in enumerate(world.clusters):
            self.clusters.append([Node(spec=st, cluster=c, stage=j, last=j == len(stages) - 1)
                                  for j, st in enumerate(stages)])
        self.nodes = {n.name: n for nodes in self.clusters for n in nodes}
        self.up = [True] * len(self.clusters)
        self.inflight = [s.max_inflight or len(stages) for stages in world.clusters]
        self.uplinks = {name: SharedResource(self.q, world.network.uplink[name]) for name in self.nodes}
        self.cpus = {host: SharedResource(self.q, cores) for host, cores in world.host_cores.items()}
        self._conns: dict[tuple[str, str, str], Connection] = {}
        self.node_segments: dict[str, list[SegmentSpec]] = {n: [] for n in self.nodes}
        for seg in world.segments:
            for holder in seg.holders:
                self.node_segments[holder].append(seg)
        self.rings: dict[tuple[int, int], Ring] = {}
        self.closed: set[tuple[int, int]] = set()
        self.cluster_done_at: list[float | None] = [None] * len(self.clusters)
        self.cluster_start: list[float | None] = [None] * len(self.clusters)
        self.seg_index = {id(seg): i for i, seg in enumerate(world.segments)}

    # ------------------------------------------------------------------ running
    def run(self, until: float = INF) -> None:
        for node in self.nodes.values():
            ready = self.world.start_at.get(node.name, 0.0)
            if ready > 0:
                node.blocked = "start"
                self.q.at(ready, self._ready, node)
        for stages in self.clusters:
            self._dispatch(stages[0])
        if self.settings.churn_per_hour > 0:
            for node in self.nodes.values():
                self._schedule_failure(node)
        self.q.run(until)

    def _ready(self, node: Node) -> None:
        node.blocked = None
        self._dispatch(node)

    # ------------------------------------------------------------------ transfers
    def _conn(self, a: str, b: str, kind: str) -> Connection:
        key = (a, b, kind)
        conn = self._conns.get(key)
        if conn is None:
            net = self.world.network
            conn = self._conns[key] = Connection(
                self.q, self.uplinks[a], net.bandwidth(a, b), net.latency(a, b)
            )
        return conn

    def ring_send(self, src: Node, dst: Node, nbytes: float, arrive: Callable[..., None], *args: Any) -> None:
        src.ring_bytes += nbytes
        self._conn(src.name, dst.name, "ring").send(nbytes, arrive, *args)

    def _pipe_send(
        self, src: Node, dst: Node, nbytes: float, arrive: Callable[..., None], *args: Any
    ) -> None:
        src.pipe_bytes += nbytes
        self._conn(src.name, dst.name, "pipe").send(nbytes, arrive, *args)

    # ------------------------------------------------------------------ the compute thread
    def _dispatch(self, node: Node) -> None:
        if node.busy or node.blocked is not None or not self.up[node.cluster]:
            return
        if node.bwd_queue:
            self._compute(node, "bwd", node.bwd_queue.popleft())
        elif node.fwd_queue:
            self._compute(node, "last" if node.last else "fwd", node.fwd_queue.popleft())
        elif (node.stage == 0 and node.started < self.settings.steps
              and len(node.stash) < (1 if node.version < self.settings.inflight_warmup_steps
                                     else self.inflight[node.cluster])):
            mb = node.started
            node.started += 1
            self._compute(node, "last" if node.last else "fwd", mb)

    def _compute(self, node: Node, kind: str, mb: int) -> None:
        st, s = node.spec, self.settings
        parts = (st.fwd_s,) if kind == "fwd" else (st.bwd_s,) if kind == "bwd" else (st.fwd_s, st.bwd_s)
        cv = s.jitter if st.cv is None else st.cv
        seconds = 0.0
        for part in parts:
            part += s.message_overhead_s
            if cv > 0:                      # lognormal with mean ``part``
                sigma = math.sqrt(math.log1p(cv * cv))
                part *= self.rng.lognormvariate(-sigma * sigma / 2, sigma)
            seconds += part
        node.busy = True
        now = self.q.now
        if node.first_work is None:
            node.first_work = now
            if self.cluster_start[node.cluster] is None:
                self.cluster_start[node.cluster] = now
        host = self.world.hosts.get(node.name)
        if host is None:
            self.q.after(seconds, self._computed, node, kind, mb, node.epoch, now)
        else:
            epoch = node.epoch
            self.cpus[host].add(seconds, 1.0, lambda: self._computed(node, kind, mb, epoch, now))

    def _computed(self, node: Node, kind: str, mb: int, epoch: int, t0: float) -> None:
        if epoch != node.epoch:
            return
        node.busy = False
        node.busy_s += self.q.now - t0
        node.end = max(node.end, self.q.now)
        clusters = self.clusters[node.cluster]
        if kind in ("fwd", "last"):
            node.forwards_total += 1
            node.stash[mb] = node.version
        if kind == "fwd":
            nxt = clusters[node.stage + 1]
            self._pipe_send(node, nxt, node.spec.act_bytes, self._arrive, nxt, "fwd", mb, nxt.epoch)
            self._dispatch(node)
            return
        used = node.stash.pop(mb)
        if node.stage > 0:
            prev = clusters[node.stage - 1]
            self._pipe_send(node, prev, node.spec.grad_bytes, self._arrive, prev, "bwd", mb, prev.epoch)
        node.backwards += 1
        node.backwards_total += 1
        node.pending_staleness.append(used)
        node.accumulated += 1
        if node.accumulated >= self.settings.update_every:
            self._step(node)
            if not self._gate(node):
                return
        self._after_backward(node)

    def _after_backward(self, node: Node) -> None:
        if (
            node.stage == 0
            and node.backwards >= self.settings.steps
            and self.cluster_done_at[node.cluster] is None
        ):
            self.cluster_done_at[node.cluster] = self.q.now
        self._dispatch(node)

    def _arrive(self, node: Node, kind: str, mb: int, epoch: int) -> None:
        if epoch != node.epoch:
            return
        (node.fwd_queue if kind == "fwd" else node.bwd_queue).append(mb)
        self._dispatch(node)

    def _step(self, node: Node) -> None:
        for used in node.pending_staleness:
            staleness = node.version - used
            node.staleness_sum += staleness
            node.staleness_max = max(node.staleness_max, staleness)
        node.pending_staleness.clear()
        node.version += 1
        node.updates += 1
        node.accumulated = 0

    # ------------------------------------------------------------------ averaging
    def _live(self) -> list[int]:
        return [c for c, up in enumerate(self.up) if up]

    def _gate(self, node: Node) -> bool:
        """``Averager.on_update``: True when the compute thread goes on at once; else it waits and
        ``_resume`` continues later."""
        s = self.settings
        if s.overlap_averaging:
            while node.pending and node.version - node.pending[0].version >= s.averaging_lead:
                oldest = node.pending[0]
                if not oldest.done:
                    self._block(node, oldest)
                    return False
                node.pending.pop(0)
        if node.version % s.sync_every or len(self._live()) < 2 or not self.node_segments[node.name]:
            return True
        if node.snapshot_version == node.version:
            return True                                  # already queued (resumed after waiting)
        if len(node.queued) >= s.pending_rounds:
            self._block(node, "queue")
            return False
        nr = NodeRound(round_id=node.version // s.sync_every, version=node.version)
        node.snapshot_version = node.version
        node.pending.append(nr)
        node.queued.append(nr)
        self._next_round(node)
        if not s.overlap_averaging and not nr.done:
            self._block(node, nr)
            return False
        return True

    def _block(self, node: Node, what: Any) -> None:
        node.blocked, node.blocked_since = what, self.q.now

    def _resume(self, node: Node) -> None:
        node.wait_s += self.q.now - node.blocked_since
        node.blocked = None
        if not self.settings.overlap_averaging:
            node.pending = [p for p in node.pending if not p.done]
        if self._gate(node):
            self._after_backward(node)

    def _next_round(self, node: Node) -> None:
        if node.running is not None or not node.queued:
            return
        nr = node.queued.popleft()
        node.running, nr.started_at = nr, self.q.now
        if node.blocked == "queue":
            self.q.after(0.0, self._unqueue, node, node.epoch)
        live = self._live()
        rings = []
        for seg in self.node_segments[node.name]:
            key = (self.seg_index[id(seg)], nr.round_id)
            if key in self.closed:
                continue
            ring = self.rings.get(key)
            if ring is None:
                members = [self.nodes[seg.holders[c]] for c in live]
                if len(members) < 2:
                    continue
                ring = self.rings[key] = Ring(self, seg, nr.round_id, members)
            if node in ring.members:
                rings.append(ring)
        nr.rings_left = len(rings)
        if not rings:
            self.q.after(0.0, self._round_done, node, nr, False, node.epoch)
            return
        for ring in rings:
            ring.open(ring.rank(node))

    def _unqueue(self, node: Node, epoch: int) -> None:
        if epoch == node.epoch and node.blocked == "queue":
            self._resume(node)

    def member_done(self, node: Node, nr: NodeRound, aborted: bool) -> None:
        if node.running is not nr:
            return
        nr.rings_left -= 1
        nr.aborted = nr.aborted or aborted
        if nr.rings_left == 0:
            self._round_done(node, nr, nr.aborted, node.epoch)

    def _round_done(self, node: Node, nr: NodeRound, aborted: bool, epoch: int) -> None:
        if epoch != node.epoch or node.running is not nr:
            return
        nr.done = True
        node.running = None
        if aborted:
            node.rounds_aborted += 1
        else:
            node.rounds_done += 1
            node.round_s_sum += self.q.now - nr.started_at
        node.end = max(node.end, self.q.now)
        if node.blocked is nr:
            self._resume(node)
        elif nr in node.pending and node.pending[0] is nr and node.blocked is None:
            node.pending.pop(0)
        self._next_round(node)

    def ring_closed(self, ring: Ring) -> None:
        key = (self.seg_index[id(ring.seg)], ring.round_id)
        self.rings.pop(key, None)
        self.closed.add(key)

    # ------------------------------------------------------------------ churn
    def _schedule_failure(self, node: Node) -> None:
        rate = self.settings.churn_per_hour / 3600.0
        self.q.after(self.rng.expovariate(rate), self._fail, node)

    def _fail(self, node: Node) -> None:
        c = node.cluster
        if self.cluster_done_at[c] is not None:
            return
        if not self.up[c]:
            self._schedule_failure(node)
            return
        node.failures += 1
        self.up[c] = False
        self._schedule_failure(node)                    # each node's failures are one Poisson process
        stages = self.clusters[c]
        first = stages[0]
        first.started = first.backwards                 # everything in flight is lost and redone
        for n in stages:
            n.epoch += 1
            if n.busy:
                n.busy = False
            if n.blocked is not None:
                n.wait_s += self.q.now - n.blocked_since
                n.blocked = None
            n.fwd_queue.clear()
            n.bwd_queue.clear()
            n.stash.clear()
            n.pending.clear()
            n.queued.clear()
            n.running = None
            n.snapshot_version = -1
        failed_at = self.q.now
        for ring in list(self.rings.values()):
            if any(m.cluster == c for m in ring.members):
                self.q.after(self.settings.ring_timeout_s, ring.abort)
        self.q.after(self.settings.restart_s, self._restart, c, failed_at)

    def _restart(self, c: int, failed_at: float) -> None:
        donors = [d for d in self._live() if d != c]
        net = self.world.network
        catch_up, version = 0.0, None
        for n in self.clusters[c]:
            holders = [self.nodes[seg.holders[d]] for seg in self.node_segments[n.name] for d in donors]
            for h in holders:
                t = n.spec.param_bytes / min(net.bandwidth(h.name, n.name), net.uplink[h.name]) \
                    + net.latency(h.name, n.name)
                catch_up = max(catch_up, t)
                version = h.version if version is None else min(version, h.version)
        self.q.after(catch_up, self._rejoin, c, failed_at, version)

    def _rejoin(self, c: int, failed_at: float, version: int | None) -> None:
        self.up[c] = True
        s = self.settings
        for n in self.clusters[c]:
            n.down_s += self.q.now - failed_at
            if version is not None:
                n.version = max(n.version, version // s.sync_every * s.sync_every)
            n.accumulated = 0
            n.pending_staleness.clear()
        self._dispatch(self.clusters[c][0])
