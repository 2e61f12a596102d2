"""ravq's training as discrete events: asynchronous pipelines, credits, per-stage updates, overlapped
averaging with hold-back, rings streamed in pieces, and (optionally) failures and recovery.

What each node does, as ``ravq.stage.pipeline`` and ``ravq.average.averager`` do it:

- one compute thread per node takes a waiting backward before a waiting forward (in arrival order);
  stage 0 starts a new micro-batch only while fewer than ``max_inflight`` of its micro-batches await
  their backward (the credits; 1 for its first ``inflight_warmup_steps`` versions); the last stage runs
  forward, loss and backward in one go;
- activations go downstream and gradients upstream as messages on one stream per neighbour, over the
  sender's uplink, which its ring streams share (``engine``);
- after every ``update_every`` backwards the stage steps (version + 1), then, overlapped: waits while its
  oldest unfinished round's snapshot is its lead (``averaging_lead``, longer for a slow ring's round) or
  more versions old; every ``sync_every`` steps since it saw the plan epoch snapshots and queues a round
  (round k of epoch e, as ``ravq.average.averager`` counts them) (its compute thread waits when
  ``pending_rounds`` are queued behind the running one).  Not overlapped: it waits for the round it just
  queued.  A node runs its rounds one after another, all its rings at once;
- a round's rings run over the clusters in the plan epoch's rings: all of them ("global"), or the node's
  group of that round (``ravq.average.groups``: a grid, a new axis each round);
- a ring (one per segment: the holders of a run of blocks, one per cluster) runs in pieces or as flows
  (``ravq.simulate.rings``); a member starts when its own node starts that round, so a ring finishes
  only once its slowest cluster has reached the round's version;
- a failure stops the node's whole cluster (its in-flight micro-batches are lost and redone); ``lost_s``
  later the broker takes the cluster out of the rings: a new plan epoch, and every node abandons every
  open round at once (queued ones too) and counts rounds from the new epoch.  After ``restart_s`` the
  cluster's nodes fetch their stages' weights from the holders in another cluster (catch-up: the stage's
  bytes over that link) and rejoin at that cluster's version: the rings take it back, another epoch;
- a later stage done with its micro-batches ends when it next wakes after stage 0 is done (``finish_poll_s``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from ravq.planner.pacing import group_and_lead
from ravq.simulate.churn import Churn
from ravq.simulate.engine import INF, Connection, EventQueue, SharedResource
from ravq.simulate.rings import Ring, skip_round
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
        self.churn = Churn(self)
        self.plan_epoch, self.epoch_at = 0, {0: 0.0}
        """``epoch_at``: plan epoch -> when it began; ``epoch_live`` -> the clusters in its rings."""
        self.epoch_live: dict[int, tuple[int, ...]] = {0: tuple(range(len(self.clusters)))}
        self.changed: dict[int, set[int]] = {}
        """Plan epoch -> the clusters that left or came back at its start."""
        self.inflight = [s.window(len(stages)) for stages in world.clusters]
        self.uplinks = {name: SharedResource(self.q, world.network.uplink[name]) for name in self.nodes}
        self.cpus = {host: SharedResource(self.q, cores) for host, cores in world.host_cores.items()}
        self._conns: dict[tuple[str, str, str], Connection] = {}
        self.node_segments: dict[str, list[SegmentSpec]] = {n: [] for n in self.nodes}
        for seg in world.segments:
            for holder in seg.holders:
                self.node_segments[holder].append(seg)
        self.rings: dict[tuple[int, ...], Ring] = {}
        """(segment, plan epoch, round, group's first cluster) -> its ring in that round."""
        self.closed: set[tuple[int, ...]] = set()
        self.cluster_done_at: list[float | None] = [None] * len(self.clusters)
        self.cluster_start: list[float | None] = [None] * len(self.clusters)
        self.seg_index = {id(seg): i for i, seg in enumerate(world.segments)}
        self.period = list(s.round_steps or [s.sync_every] * len(self.clusters))
        """Per cluster, optimizer steps between its rounds (rate pacing: ``ravq.planner.pacing``)."""
        self.cluster_steps = [max(1, round(s.steps * p / s.sync_every)) for p in self.period]
        """Per cluster, micro-batches it trains: ``steps``, or under rate pacing its share of as many
        rounds."""

    # ------------------------------------------------------------------ running
    def run(self, until: float = INF) -> None:
        for node in self.nodes.values():
            ready = self.world.start_at.get(node.name, 0.0)
            if ready > 0:
                node.blocked = "start"
                self.q.at(ready, self._ready, node)
        for stages in self.clusters:
            self.dispatch(stages[0])
        self.churn.start()
        self.q.run(until)

    @property
    def up(self) -> list[bool]:
        """Per cluster: whether it is running (not failed)."""
        return self.churn.up

    def _ready(self, node: Node) -> None:
        node.blocked = None
        self.dispatch(node)

    # ------------------------------------------------------------------ transfers
    def _conn(self, a: str, b: str, kind: str) -> Connection:
        key = (a, b, kind)
        conn = self._conns.get(key)
        if conn is None:
            n = self.world.network
            conn = self._conns[key] = Connection(self.q, self.uplinks[a], n.bandwidth(a, b), n.latency(a, b))
        return conn

    def ring_messages(self, src: Node, dst: Node) -> int:
        return self._conn(src.name, dst.name, "ring").messages

    def ring_send(self, src: Node, dst: Node, nbytes: float, arrive: Callable[..., None], *args: Any) -> None:
        src.ring_bytes += nbytes
        self._conn(src.name, dst.name, "ring").send(nbytes, arrive, *args)

    def _pipe_send(self, src: Node, dst: Node, nbytes: float, arrive: Callable[..., None], *a: Any) -> None:
        src.pipe_bytes += nbytes
        self._conn(src.name, dst.name, "pipe").send(nbytes, arrive, *a)

    # ------------------------------------------------------------------ the compute thread
    def dispatch(self, node: Node) -> None:
        if node.busy or node.blocked is not None or not self.up[node.cluster]:
            return
        if node.bwd_queue:
            self._compute(node, "bwd", node.bwd_queue.popleft())
        elif node.fwd_queue:
            self._compute(node, "last" if node.last else "fwd", node.fwd_queue.popleft())
        elif (node.stage == 0 and node.started < self.cluster_steps[node.cluster]
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
        node.idle_since = self.q.now
        node.end = max(node.end, self.q.now)
        clusters = self.clusters[node.cluster]
        if kind in ("fwd", "last"):
            node.forwards_total += 1
            node.stash[mb] = node.version
        if kind == "fwd":
            nxt = clusters[node.stage + 1]
            self._pipe_send(node, nxt, node.spec.act_bytes, self._arrive, nxt, "fwd", mb, nxt.epoch)
            self.dispatch(node)
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
            and node.backwards >= self.cluster_steps[node.cluster]
            and self.cluster_done_at[node.cluster] is None
        ):
            self.cluster_done_at[node.cluster] = self.q.now
            self._later_stages_notice(node.cluster)
            self.churn.finished(node.cluster)
        self.dispatch(node)

    def _later_stages_notice(self, c: int) -> None:
        """Stage 0 finished: each later stage's compute thread, idle since its last backward, sees it when its
        wait for work times out (``finish_poll_s``), unless a finishing round wakes it sooner."""
        poll = self.settings.finish_poll_s
        if poll <= 0:
            return
        for n in self.clusters[c][1:]:
            waits = max(1, math.ceil((self.q.now - n.idle_since) / poll - 1e-9))
            self.q.at(n.idle_since + waits * poll, self._noticed_done, n, self.q.now)

    def _noticed_done(self, node: Node, done_at: float) -> None:
        if node.end <= done_at:                          # nothing woke it since
            node.end = self.q.now

    def _arrive(self, node: Node, kind: str, mb: int, epoch: int) -> None:
        if epoch != node.epoch:
            return
        (node.fwd_queue if kind == "fwd" else node.bwd_queue).append(mb)
        self.dispatch(node)

    def _step(self, node: Node) -> None:
        for used in node.pending_staleness:
            staleness = node.version - used
            node.staleness_sum += staleness
            node.staleness_max = max(node.staleness_max, staleness)
        node.pending_staleness.clear()
        node.version += 1
        node.updates += 1
        node.accumulated = 0
        if node.plan_epoch != self.plan_epoch:          # every step counts from the epoch the node sees
            e = self.plan_epoch
            node.enter_epoch(e, self.epoch_at[e], self.q.now, self.settings.round_period_s)
            self._moved_on(node)
        node.steps_in_epoch += 1
        for gone in node.round_ended(self.period[node.cluster], self.settings.round_period_s, self.q.now):
            skip_round(self, node, gone, self._round(node.cluster, NodeRound(gone, 0, node.plan_epoch))[0])

    # ------------------------------------------------------------------ averaging
    def _gate(self, node: Node) -> bool:
        """``Averager.on_update``: True when the compute thread goes on at once; else it waits and
        ``_resume`` continues later."""
        s = self.settings
        if s.overlap_averaging:
            while node.pending and node.version - node.pending[0].version >= node.pending[0].lead:
                oldest = node.pending[0]
                if not oldest.done:
                    if self._member_gone(node, oldest):  # silent member: train on (``Averager._gone``)
                        break
                    self._block(node, oldest)
                    return False
                node.pending.pop(0)
        live = self.epoch_live[node.plan_epoch]
        if (node.step_round is None or len(live) < 2 or node.cluster not in live
                or not self.node_segments[node.name] or node.snapshot_version == node.version):  # or queued
            return True
        if len(node.queued) >= s.pending_rounds:
            self._block(node, "queue")
            return False
        nr = NodeRound(round_id=node.step_round, version=node.version, plan_epoch=node.plan_epoch)
        group, nr.lead = self._round(node.cluster, nr)
        if s.every is not None and not group:
            return True                                  # pacing by link: it sits the round out, as nodes do
        node.snapshot_version = node.version
        node.pending.append(nr)
        node.queued.append(nr)
        self._next_round(node)
        if not s.overlap_averaging and not nr.done:
            self._block(node, nr)
            return False
        return True

    def _member_gone(self, node: Node, nr: NodeRound) -> bool:
        """A cluster of the round's group has been down ``hold_s`` or longer (its nodes send no heartbeat)."""
        since = self.q.now - self.settings.hold_s * (1 - 1e-9)     # its timer fires at exactly hold_s
        group = self._round(node.cluster, nr)[0]
        return any(not self.up[c] and self.churn.failed_at[c] <= since for c in group)

    def release_holds(self) -> None:
        """``hold_s`` after a failure: nodes holding back for a round with the silent cluster train on."""
        for n in self.nodes.values():
            if isinstance(n.blocked, NodeRound) and self._member_gone(n, n.blocked):
                self._resume(n)

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
        group = self._round(node.cluster, nr)[0]
        if self._abandoned(nr, group):                  # skipped in turn
            self.q.after(0.0, self._round_done, node, nr, True, node.epoch)
            return
        rings, abandoned = [], False
        for seg in self.node_segments[node.name] if len(group) > 1 else ():
            key = (self.seg_index[id(seg)], nr.plan_epoch, nr.round_id, group[0])
            if key in self.closed:                      # aborted before this node got to it
                abandoned = True
                continue
            ring = self.rings.get(key)
            if ring is None:
                members = [self.nodes[seg.holders[c]] for c in group]
                ring = self.rings[key] = Ring(self, seg, key, members)
            rings.append(ring)
        nr.rings_left = len(rings)
        if not rings:
            self.q.after(0.0, self._round_done, node, nr, abandoned, node.epoch)
            return
        for ring in rings:
            ring.open(ring.rank(node))

    def _round(self, cluster: int, nr: NodeRound) -> tuple[tuple[int, ...], int]:
        """``cluster``'s group in round ``nr`` (() if it sits it out) and its lead (``group_and_lead``)."""
        s = self.settings
        rates = None if s.group_rates is None else dict(enumerate(s.group_rates))
        mode, live = ("groups" if s.averaging_mode == "groups" else "global"), self.epoch_live[nr.plan_epoch]
        return group_and_lead(cluster, nr.plan_epoch, nr.round_id, live, mode, s.group_size, rates, s.every,
                              s.averaging_lead, self.period[cluster])

    def _moved_on(self, node: Node) -> None:
        """``node`` counts steps in a newer epoch: rounds of older ones it has not snapshotted never get its
        part, so their rings abort (in ravq its peers see pieces of its newer rounds, "peer_moved_on", or
        time out).  Only groups mode keeps such rings open across an epoch change."""
        mine = {(nr.plan_epoch, nr.round_id) for nr in (*node.queued, node.running) if nr is not None}
        for key, ring in list(self.rings.items()):
            stale = key[1] < node.plan_epoch and key[1:3] not in mine
            if stale and node in ring.members and not ring.opened.get(ring.rank(node)):
                ring.abort()

    def _abandoned(self, nr: NodeRound, group: tuple[int, ...]) -> bool:
        """A queued round of an older epoch: every one in global mode; in groups mode one whose group a later
        change touched (its ring would wait for a member that left or restarted)."""
        if nr.plan_epoch == self.plan_epoch:
            return False
        if self.settings.averaging_mode == "global":
            return True
        return any(c in self.changed[e] for e in range(nr.plan_epoch + 1, self.plan_epoch + 1) for c in group)

    def new_epoch(self, live: tuple[int, ...]) -> None:
        """The broker changed the rings' membership to ``live``: a new plan epoch.  Every open round of an
        older one is abandoned at once on every node (``Averager.on_plan``); in groups mode only the rounds
        whose rings reach a cluster that left or came back (``RoundGroups.touched``)."""
        before = self.epoch_live[self.plan_epoch]
        self.plan_epoch += 1
        self.epoch_live[self.plan_epoch], self.epoch_at[self.plan_epoch] = live, self.q.now
        changed = self.changed[self.plan_epoch] = set(before) ^ set(live)
        for key, ring in list(self.rings.items()):
            if self.settings.averaging_mode == "global" or any(m.cluster in changed for m in ring.members):
                ring.abort()
                self.rings.pop(key, None)
                self.closed.add(key)

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
        self.rings.pop(ring.key, None)
        self.closed.add(ring.key)
