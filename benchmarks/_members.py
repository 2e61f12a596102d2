"""Emulated members for ``bench_broker_scale.py``: thousands per process, each with its own DEALER and SUB to
the broker (CURVE on, its own key), on plain ZeroMQ sockets read by one epoll loop.

An asyncio task per member spent more on its event-loop wake-ups than the broker spent on it: at 10,000
members the emulator processes took both cores (four ticks a second to each SUB) and joined 2,326.  Here
one loop per process reads whichever socket is ready (drained until EAGAIN, every socket swept once a
second in case an edge was missed), parses the JSON header only, and keeps each member's timers in a heap.
A member registers (retrying after ``REQUEST_S`` as a node does), follows the published state as a node
does (its topics' sequence numbers, a snapshot of its topics on a gap; the old tree: every whole-state
update) without applying it, and beats on a fixed cadence with three checkpoint points (a new one every
``checkpoint_s``) and the generation of its cluster it last saw, ready for it, as a node that caught up;
it says it trains once the broker's ``start`` key says every member is up (the old tree: at once).
"""

from __future__ import annotations

import bisect
import heapq
import os
import random
import selectors
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import zmq

REQUEST_S = 60.0
"""A registration or snapshot request not answered within this is sent again."""


@dataclass(slots=True)
class _Member:
    name: str
    cluster: int
    dealer: zmq.Socket[Any] | None = None
    sub: zmq.Socket[Any] | None = None
    incarnation: str = ""
    broker: Any = None
    """The broker process whose state this member holds (its incarnation)."""
    held: dict[str, int] = field(default_factory=dict)
    seq: int = -1
    synced: float = 0.0
    generation: int = 0
    joined: bool = False
    asked_at: float | None = None
    """When its pending request (a registration or a snapshot) was sent; None: none pending."""
    points: list[dict[str, int]] = field(default_factory=list)
    next_point: float = 0.0
    unsent: tuple[Any, dict[str, Any]] | None = None
    """A request its DEALER could not send yet (no connection): sent again shortly."""
    frames: list[bytes] | None = None
    """Its heartbeat, encoded: the same until its checkpoints or generation change (encoding one per beat
    was most of the emulator's time at 10,000 members)."""


class Emulator:
    def __init__(self, *, tree: str, names: list[str], clusters: dict[str, int], keys: dict[str, tuple[str, str]],
                 broker_key: str, pub: str, router: str, new: bool, interval_s: float, checkpoint_s: float,
                 follow: int, trace: bool = False) -> None:
        sys.path.insert(0, tree)
        from ravq.net.wire import Message, MsgType, encode

        self.Message, self.MsgType, self.encode = Message, MsgType, encode
        self.keys, self.broker_key, self.pub, self.router = keys, broker_key, pub, router
        self.new, self.interval_s, self.checkpoint_s, self.follow = new, interval_s, checkpoint_s, follow
        self.members = {n: _Member(name=n, cluster=clusters[n]) for n in names}
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        self.selector = selectors.DefaultSelector()
        self.timers: list[tuple[float, int, str, str]] = []
        self._order = 0
        self.window_at = float("inf")
        self.stats = {"bytes": 0, "largest": 0, "stale": 0.0, "joined": 0, "gaps": 0, "late": 0, "retries": 0,
                      "beats": 0, "lag": 0.0, "cpu_s": 0.0, "unconnected": 0, "join_waits": []}
        self.started = False
        """Whether its members say they train: once one heard that every member of the plan is up (the
        ``start`` key), as nodes at a first start do; before, they say they are starting (a broker marks
        nobody lost before training began: members joining over a minute paused and recovered clusters)."""
        self.trace: list[float] | None = [] if trace else None
        """With ``trace``: when, at what CPU time and bytes read it last printed (``_trace``)."""
        self.sub_bytes = 0
        self._metas: dict[tuple[int, bytes], dict[str, Any]] = {}
        self.spy = min(names, key=lambda n: int(n[1:]))
        self.spied: dict[str, int] = {}
        self.seen: dict[str, dict[int, float]] = {}
        """Topic -> sequence number -> when a member of this process first heard of it (an update, or a tick
        saying it): when the broker published it, as far as this process can tell."""

    def at(self, when: float, what: str, name: str) -> None:
        self._order += 1
        heapq.heappush(self.timers, (when, self._order, what, name))

    def run(self, join_at: dict[str, float], window_at: float, end_at: float, register: Any, beat: Any) -> None:
        """Until ``end_at`` (wall clock): join each member at its time, then beat and follow."""
        self.register, self.beat_meta = register, beat
        self.window_at = time.monotonic() + window_at - time.time()
        end = time.monotonic() + end_at - time.time()
        for name, t in join_at.items():
            self.at(time.monotonic() + t - time.time(), "join", name)
        sweep = sample = time.monotonic()
        cpu0 = time.process_time()
        if self.trace is not None:
            self.trace = [sample, cpu0, 0]
        while (now := time.monotonic()) < end:
            timeout = max(0.0, min(self.timers[0][0] if self.timers else now + 0.1, now + 0.1) - now)
            for key, _ in self.selector.select(timeout):
                self._drain(key.data)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                when, _, what, name = heapq.heappop(self.timers)
                getattr(self, f"_{what}")(self.members[name], when, now)
            if now - sweep >= 1.0:
                sweep = now
                for m in self.members.values():
                    self._drain(m)
            if now - sample >= 0.5:
                sample = now
                if self.trace is not None and now - self.trace[0] >= 10.0:
                    self._trace(now)
                if now >= self.window_at:
                    self.stats["stale"] = max(self.stats["stale"], self._worst_view(now))
        self.stats["cpu_s"] = time.process_time() - cpu0
        self.ctx.destroy(linger=0)

    def _trace(self, now: float) -> None:
        """Every 10 s (``trace``): how far behind its timers it is, its CPU and the bytes its SUBs read, and what
        one member's SUB received by topic and key (what a storm of updates is made of)."""
        assert self.trace is not None
        t0, cpu0, bytes0 = self.trace
        behind = max(0.0, now - self.timers[0][0]) if self.timers else 0.0
        cpu = time.process_time()
        rss_mb = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        print(f"[emu {self.spy}] {now:.0f} joined {self.stats['joined']} behind {behind:.2f}s rss {rss_mb} MiB "
              f"cpu {(cpu - cpu0) / (now - t0):.2f} sub {(self.sub_bytes - bytes0) / (now - t0) / 1e6:.2f} MB/s "
              f"gaps {self.stats['gaps']} {sorted(self.spied.items())}", file=sys.stderr, flush=True)
        self.spied = {}
        self.trace = [now, cpu, self.sub_bytes]


    def _worst_view(self, now: float) -> float:
        """How long the worst member has lacked an update the broker published: its view is current when it
        holds every topic's number as of what was published (``seen``)."""
        worst = 0.0
        states = sorted(self.seen.get("", {}))  # the old tree: one number for every kind of message
        for m in self.members.values():
            if m.joined and m.sub is not None:
                if not self.new:  # the next whole state after the one it holds
                    i = bisect.bisect_right(states, m.seq)
                    first = self.seen[""][states[i]] if i < len(states) else None
                    worst = max(worst, now - first) if first is not None else worst
                    continue
                for topic, held in m.held.items():
                    first = self.seen.get(topic, {}).get(held + 1)
                    if first is not None:
                        worst = max(worst, now - first)
        return worst

    def _socket(self, m: _Member, kind: int) -> zmq.Socket[Any]:
        public, secret = self.keys[m.name]
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.curve_secretkey, sock.curve_publickey = secret.encode(), public.encode()
        sock.curve_serverkey = self.broker_key.encode()
        return sock

    def _join(self, m: _Member, when: float, now: float) -> None:
        m.incarnation = f"{m.name}-{random.random()}"
        if int(m.name[1:]) < self.follow:  # subscribe first, then register, as a node does
            m.sub = self._socket(m, zmq.SUB)
            m.sub.connect(self.pub)
            for topic in (["g.", f"c{m.cluster}."] if self.new else [""]):
                m.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self.selector.register(m.sub.getsockopt(zmq.FD), selectors.EVENT_READ, m)
        m.dealer = self._socket(m, zmq.DEALER)
        m.dealer.setsockopt(zmq.IDENTITY, m.name.encode())
        m.dealer.connect(self.router)
        self.selector.register(m.dealer.getsockopt(zmq.FD), selectors.EVENT_READ, m)
        self._ask(m, self.MsgType.REGISTER, self.register(m.incarnation), now)

    def _ask(self, m: _Member, kind: Any, meta: dict[str, Any], now: float) -> None:
        """Send a request; while the DEALER has no connection yet (its CURVE handshake waits on the broker)
        try again a tenth of a second later: a blocking send stalled every member of the process."""
        assert m.dealer is not None
        try:
            m.dealer.send_multipart(self.encode(self.Message(type=kind, sender=m.name, meta=meta)), zmq.NOBLOCK)
        except zmq.Again:
            self.stats["unconnected"] += 1
            m.unsent = (kind, meta)
            self.at(now + 0.1, "resend", m.name)
            return
        m.asked_at = now
        self.at(now + REQUEST_S, "retry", m.name)

    def _resend(self, m: _Member, when: float, now: float) -> None:
        if m.unsent is not None:
            kind, meta = m.unsent
            m.unsent = None
            self._ask(m, kind, meta, now)

    def _retry(self, m: _Member, when: float, now: float) -> None:
        if m.asked_at is not None and m.asked_at + REQUEST_S <= now:
            self.stats["retries"] += 1
            kind = self.MsgType.SNAPSHOT_REQ if m.joined else self.MsgType.REGISTER
            self._ask(m, kind, {"mine": True} if m.joined else self.register(m.incarnation), now)

    def _beat(self, m: _Member, due: float, now: float) -> None:
        if now >= m.next_point:
            v = m.points[0]["version"] + 10
            m.points = [{"version": v, "trained": v, "window": 2}, *m.points[:2]]
            m.next_point += self.checkpoint_s
            m.frames = None
        assert m.dealer is not None
        if m.frames is None:
            m.frames = self.encode(self.Message(type=self.MsgType.HEARTBEAT, sender=m.name,
                                                meta=self.beat_meta(m.incarnation, m.points, m.generation,
                                                                    self.started or not self.new)))
        try:
            m.dealer.send_multipart(m.frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no connection to the broker (its queue full, or the link went): not sent
            self.stats["unconnected"] += 1
        if now >= self.window_at:
            self.stats["beats"] += 1
            self.stats["lag"] = max(self.stats["lag"], now - due)
            if now - due > 0.25 * self.interval_s:
                self.stats["late"] += 1  # this emulator was late: the broker may see the member silent
        self.at(max(due + self.interval_s, now), "beat", m.name)

    def _drain(self, m: _Member) -> None:
        for sock, on in ((m.dealer, self._reply), (m.sub, self._update)):
            while sock is not None:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                on(m, frames)

    def _learn(self, m: _Member, items: list[Any]) -> None:
        mine = f"cluster/{m.cluster}"
        for key, value in items:
            if key == mine and isinstance(value, dict) and value["generation"] != m.generation:
                m.generation, m.frames = value["generation"], None
            elif key == "start" and isinstance(value, dict) and value.get("up") and not self.started:
                self.started = True  # every member of this process trains from now (those with no SUB too)
                for other in self.members.values():
                    other.frames = None

    def _reply(self, m: _Member, frames: list[bytes]) -> None:
        header = orjson.loads(frames[0])
        if header["type"] != "snapshot":
            return
        meta, now = header["meta"], time.monotonic()
        if self.new:
            self._learn(m, meta["items"])
            if meta["part"] == 0:
                m.held, m.broker = dict(meta["seqs"]), meta["incarnation"]
            if meta["part"] < meta["parts"] - 1:
                return
        else:
            m.seq, m.broker = meta["seq"], meta["incarnation"]
        if not m.joined and m.asked_at is not None:  # how long the broker took to answer its registration
            self.stats["join_waits"].append(now - m.asked_at)
        m.synced, m.asked_at = now, None
        if not m.joined:
            m.joined = True
            self.stats["joined"] += 1
            m.points = [{"version": v, "trained": v, "window": 2} for v in (30, 20, 10)]
            m.next_point = now + random.uniform(0, self.checkpoint_s)
            self.at(now + random.uniform(0, self.interval_s), "beat", m.name)

    def _parsed(self, frame: bytes) -> dict[str, Any]:
        """An update's meta, parsed once per process: every SUB of it receives the same message (its own copy),
        and parsing each copy made the emulator's work grow with members x updates (a storm of 10,000 silences
        to 2,500 members took a process 24 s), where a node parses its own.  Keyed by the header's length and
        head (its timestamp, topic and number)."""
        key = (len(frame), frame[:256])
        if (meta := self._metas.get(key)) is None:
            if len(self._metas) >= 1024:
                self._metas.clear()
            meta = self._metas[key] = orjson.loads(frame)["meta"]
        return meta

    def _update(self, m: _Member, frames: list[bytes]) -> None:
        now = time.monotonic()
        self.sub_bytes += len(frames[-1])
        if now >= self.window_at:
            size = sum(len(f) for f in frames)
            self.stats["bytes"] += size
            self.stats["largest"] = max(self.stats["largest"], *(len(f) for f in frames))
        meta = self._parsed(frames[-1])
        if not self.new:
            if meta.get("kind") != "silence" and isinstance(meta.get("state"), dict):
                self.seen.setdefault("", {}).setdefault(meta["seq"], now)
                if m.joined and meta["seq"] > m.seq:
                    m.seq, m.synced = meta["seq"], now
            return
        topic, seq = meta.get("topic"), meta.get("seq")
        if self.trace is not None and m.name == self.spy:
            kind = meta.get("kind")
            k = f"{topic}:{kind}"
            self.spied[k] = self.spied.get(k, 0) + len(frames[-1])
            for key, _ in meta.get("items") or ():
                k = f"{topic}:{key.split('/')[0]}"
                self.spied[k] = self.spied.get(k, 0) + 1
        self.seen.setdefault(topic, {}).setdefault(seq, now)
        if not m.joined:
            return
        held = m.held.get(topic)
        if held is None:
            return
        if meta.get("kind") == "tick":
            ok = seq <= held and meta.get("incarnation") == m.broker
            if seq == held and topic == "g.":
                m.synced = now
        elif seq <= held:
            ok = True
        else:
            ok = seq == held + 1
            if ok:
                m.held[topic] = seq
                self._learn(m, meta["items"])
        if not ok and m.asked_at is None:
            self.stats["gaps"] += 1
            self._ask(m, self.MsgType.SNAPSHOT_REQ, {"mine": True}, now)
