"""How silent a live ring member looks to the others: the broker's loops and two nodes' memberships,
in process and on a virtual clock (``tests.virtual_time``), so the silences read are exact.

A stage stops holding back for an averaging round once a member of its rings looks silent for 1.5
heartbeat intervals (``Averager.hold_s``).  With the full state published once an interval, a member
that beat just after each publication read up to two intervals silent, and fast clusters trained past
rounds of slow live ones (issue #14: six clusters, a full-core PC skipping rounds of 0.14-core PCs).
Now the broker publishes a member's silence once it passes ``SILENT_AFTER`` intervals (a threshold
event, issue #37), and a member it did not publish reads as the time since the broker's last message less
the period of its ticks (one an interval: ``TICK_INTERVALS``).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from brokers.topology import Broker
from ravq.cli.main import plan_for
from ravq.config import Topology, parse_topology
from ravq.metrics import Metrics
from ravq.net.security import socket_options_for
from ravq.net.wire import DecodeLimits, Message
from ravq.node.membership import Membership, beat_on_cadence
from ravq.swarm.report import Progress
from tests.swarm import local_topology
from tests.virtual_time import now, run_virtual

INTERVAL_S = 0.4
STARTING = Progress(generation=0, phase="starting", ready=-1, trained=0, stage_bytes=0)


def _topology() -> Topology:
    data = local_topology("tests.sgd_task", [1, 1], {"steps": 10},
                          timeouts={"heartbeat_interval_s": INTERVAL_S, "lost_s": 4 * INTERVAL_S})
    return parse_topology(data)


class _BrokerSockets:
    """The broker's PUB and ROUTER, in process: every update reaches every member at once, a member's
    request reaches ``Broker._handle`` at once and the reply comes straight back to that member."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.updates: dict[str, asyncio.Queue[Message]] = {}
        self.replies: dict[str, asyncio.Queue[Message]] = {}

    def attach(self, m: Membership) -> None:
        """Put ``m``'s SUB and DEALER on these queues (its real sockets are closed unused)."""
        m.sub.close()
        m.link.close()
        self.updates[m.name], self.replies[m.name] = asyncio.Queue(), asyncio.Queue()
        m.sub = _Queue(self.updates[m.name])  # type: ignore[assignment]
        m.links = [_Dealer(self, m.name)]  # type: ignore[list-item]

    async def publish(self, msg: Message, topic: str = "") -> None:
        for queue in self.updates.values():  # every member follows every topic here
            queue.put_nowait(msg)

    async def reply(self, identity: bytes, msg: Message, peer: str = "") -> None:
        self.replies[identity.decode()].put_nowait(msg)

    def recv_queued(self) -> None:
        return None  # members' messages are handled as they send them (``_Dealer.send``)


class _Queue:
    def __init__(self, queue: asyncio.Queue[Message]) -> None:
        self.queue = queue
        self.topics: set[str] = set()
        self.oversized = 0

    def subscribe(self, topic: str) -> None:
        self.topics.add(topic)

    def unsubscribe(self, topic: str) -> None:
        self.topics.discard(topic)

    async def recv(self, timeout_s: float | None = None) -> Message:
        async with asyncio.timeout(timeout_s):
            return await self.queue.get()

    def close(self) -> None:
        pass


class _Dealer(_Queue):
    def __init__(self, sockets: _BrokerSockets, name: str) -> None:
        super().__init__(sockets.replies[name])
        self.sockets, self.name = sockets, name

    async def send(self, msg: Message) -> None:
        await self.sockets.broker._handle(self.sockets, self.sockets, self.name.encode(), msg)  # type: ignore[arg-type]


async def _max_silence(watch_s: float) -> tuple[float, int, float, float]:
    """Node c1s0 beats every interval (20 ms after ... the first tick it follows) for ``watch_s``, then
    stops; c0s0 samples c1s0's silence every 10 ms.  Returns the largest silence read while it beat, how
    many times it beat, and, once it stopped, the largest reading beyond its true silence and its true
    silence when it first read above ``Averager.hold_s``."""
    clock = asyncio.get_running_loop().time
    topology = _topology()
    broker_metrics = Metrics("broker")
    broker = Broker(topology, plan_for(topology, None), broker_metrics,
                    socket_options_for(topology, "broker", None, broker_metrics), clock=clock)
    sockets = _BrokerSockets(broker)
    limits = DecodeLimits(max_header_bytes=topology.limits.max_header_bytes, max_frames=topology.limits.max_frames)
    ctx = zmq.asyncio.Context()
    members = {}
    for name in ("c0s0", "c1s0"):
        metrics = Metrics("node")
        members[name] = Membership(ctx, topology, name, metrics, limits,
                                   socket_options_for(topology, name, None, metrics), clock=clock)
        sockets.attach(members[name])
    beats = 0

    last_beat = 0.0

    async def beat_regularly(m: Membership) -> None:
        nonlocal beats, last_beat
        await asyncio.sleep(0.02)
        while True:
            await m.heartbeat(STARTING, {}, done=False)
            beats, last_beat = beats + 1, now()
            await asyncio.sleep(INTERVAL_S)

    async def keep_alive(m: Membership) -> None:
        while True:
            await m.heartbeat(STARTING, {}, done=False)
            await asyncio.sleep(INTERVAL_S / 2)

    worst, over, detected = 0.0, 0.0, float("inf")
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(broker._watch_heartbeats(sockets)),  # type: ignore[arg-type]
                     tg.create_task(broker._publish_silence(sockets, sockets))]  # type: ignore[arg-type]
            for m in members.values():
                await m.join()
            tasks += [tg.create_task(m.follow()) for m in members.values()]
            beating = tg.create_task(beat_regularly(members["c1s0"]))
            tasks += [beating, tg.create_task(keep_alive(members["c0s0"]))]
            await asyncio.sleep(2 * INTERVAL_S)  # settled: both follow the publications
            end = now() + watch_s
            while now() < end:
                worst = max(worst, members["c0s0"].silent_s("c1s0"))
                await asyncio.sleep(0.01)
            beating.cancel()  # c1s0 dies
            end = now() + 3 * INTERVAL_S
            while now() < end:
                read, true = members["c0s0"].silent_s("c1s0"), now() - last_beat
                over = max(over, read - true)
                if read > 1.5 * INTERVAL_S:
                    detected = min(detected, true)
                await asyncio.sleep(0.01)
            for t in tasks:
                t.cancel()
    finally:
        for m in members.values():
            m.close()
        ctx.term()
    return worst, beats, over, detected


def test_a_live_member_never_looks_silent_for_much_more_than_its_heartbeat_interval() -> None:
    worst, beats, over, detected = run_virtual(_max_silence(watch_s=12 * INTERVAL_S))
    assert beats >= 12, f"the node beat only {beats} times"
    # a live member is never published silent: it reads as the time since the broker's last message less
    # the tick period; with the silence published once an interval only, this read two intervals
    assert worst <= 0.25 * INTERVAL_S + 1e-6, f"a live member looked {worst:.3f}s silent (interval {INTERVAL_S}s)"
    # a dead one reads its true silence once published (SILENT_AFTER intervals, found within a sixteenth
    # of one), and above Averager.hold_s within a sixteenth of an interval of truly being so
    assert over <= 0.25 * INTERVAL_S + 1e-6, over
    assert 1.5 * INTERVAL_S <= detected <= (1.5 + 1 / 16) * INTERVAL_S + 0.011, detected


def test_heartbeats_keep_their_cadence_when_sending_one_takes_time() -> None:
    """Every heartbeat takes 60 ms here (statistics, encoding, CURVE and an event loop sharing a small CPU
    with the compute thread).  Sleeping an interval after each send made the period interval + send time
    (0.26 s here, more on a slow PC); a beat asked for early (``beat_now``) does not move the cadence.
    On a virtual clock (``tests.virtual_time``), so the send times are exact."""
    sent: list[float] = []

    async def slow_beat() -> None:
        sent.append(now())
        await asyncio.sleep(0.06)

    async def run() -> None:
        beat_now = asyncio.Event()
        task = asyncio.create_task(beat_on_cadence(slow_beat, 0.2, beat_now))
        await asyncio.sleep(1.1)
        beat_now.set()  # an extra beat at once, between two regular ones
        await asyncio.sleep(0.95)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run_virtual(run())
    regular = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0]  # none skipped, added or moved
    assert sent == pytest.approx(sorted([*regular, 1.1]), abs=1e-6), sent


def test_a_rejoining_node_takes_its_peers_verdicts_before_it_links_to_them() -> None:
    """A node rejoining waits only for its own verdict; the verdicts of its peers in other clusters ride on
    their clusters' topics, which it does not follow: it takes them with one whole snapshot, or a node
    behind NAT dials its relayed ring peers directly and never averages (test_nat_netns under load)."""
    async def main() -> tuple[dict[str, bool], int]:
        topology = _topology()
        metrics = Metrics("node")
        limits = DecodeLimits(max_header_bytes=topology.limits.max_header_bytes,
                              max_frames=topology.limits.max_frames)
        m = Membership(zmq.asyncio.Context(), topology, "c0s0", metrics, limits,
                       socket_options_for(topology, "c0s0", None, metrics))
        m.reach = {"c0s0": "behind_nat"}  # its own verdict came on its cluster's topic
        snapshots = 0

        async def whole_snapshot(*, mine: bool = False) -> None:
            nonlocal snapshots
            snapshots += 1
            m.reach = {**m.reach, "c1s0": "behind_nat"}

        m._snapshot = whole_snapshot  # type: ignore[method-assign]
        verdicts = await m.wait_reach(["c0s0"], ["pipeline", "ring"], 5.0, others=["c1s0"])
        await m.wait_reach(["c0s0"], ["pipeline", "ring"], 5.0, others=["c1s0"])  # known now: no snapshot
        m.close()
        return verdicts, snapshots

    verdicts, snapshots = asyncio.run(main())
    assert verdicts == {"c0s0": False, "c1s0": False} and snapshots == 1


class _HeldInbox:
    """The broker's ROUTER with messages queued that its loop has not read yet (held by a collection or a
    long handler), and a PUB that records what the broker publishes."""

    def __init__(self, queued: list[tuple[bytes, Message]]) -> None:
        self.queued, self.published = list(queued), []

    def recv_queued(self) -> tuple[bytes, Message] | None:
        return self.queued.pop(0) if self.queued else None

    async def publish(self, msg: Message, topic: str) -> None:
        self.published.append(msg)

    async def reply(self, identity: bytes, msg: Message, peer: str = "") -> None:
        pass


def test_a_beat_queued_while_the_broker_was_held_is_read_before_it_publishes_silences() -> None:
    """A member beat on time, but the broker's loop was held past the member's deadline (a long collection
    pass at 10,000 members): the beat waits in the queue.  The broker reads what is queued before it looks
    at the deadlines, so the member is not published silent (before, thousands of members were, and their
    silences to every subscriber held the broker's I/O thread, which made more beats late: a storm)."""
    from ravq.net.protocol import Heartbeat, Register
    from ravq.net.wire import MsgType

    async def scenario() -> tuple[list[str], float]:
        topology = _topology()
        broker = Broker(topology, plan_for(topology, None), Metrics("broker"), socket_options_for(
            topology, "broker", None, Metrics("broker")), clock=now, new_run=True)
        beat = Heartbeat(incarnation="1", phase="starting")
        sockets = _HeldInbox([])
        for name in ("c0s0", "c1s0"):  # both registered and heard at 0
            await broker._handle(sockets, sockets, name.encode(),  # type: ignore[arg-type]
                                 Message(type=MsgType.REGISTER, sender=name, meta=Register(incarnation="1").meta()))
        await asyncio.sleep(INTERVAL_S)
        for name in ("c0s0", "c1s0"):
            await broker._handle(sockets, sockets, name.encode(),  # type: ignore[arg-type]
                                 Message(type=MsgType.HEARTBEAT, sender=name, meta=beat.meta()))
        sockets.published.clear()
        # c0s0's next beat came an interval later but sits unread; c1s0 is truly silent from now on
        held = _HeldInbox([(b"c0s0", Message(type=MsgType.HEARTBEAT, sender="c0s0", meta=beat.meta()))])
        task = asyncio.create_task(broker._publish_silence(held, held))  # type: ignore[arg-type]
        await asyncio.sleep(1.5 * INTERVAL_S)  # past both deadlines (1.4 intervals after the beat)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        silent = [k.removeprefix("silent/") for m in held.published if m.meta.get("kind") == "delta"
                  for k, v in m.meta["items"] if k.startswith("silent/") and v is not None]
        return silent, broker.silences.last["c0s0"]

    silent, c0_heard = run_virtual(scenario())
    assert silent == ["c1s0"], silent
    assert INTERVAL_S < c0_heard <= (1 + 1.4) * INTERVAL_S, c0_heard  # read by the deadline it would have missed


def test_a_broker_whose_queue_never_empties_still_gets_to_its_other_work() -> None:
    """Beats arrive faster than the broker handles them: a drain stops after its budget and says the queue was
    not emptied (``_serve`` then only yields), so the silence task, which drains before its deadlines, still
    ticks and publishes.  Unbounded, one drain held the reading lock for as long as the queue grew."""
    from ravq.net.protocol import Heartbeat
    from ravq.net.wire import MsgType

    class _Endless(_HeldInbox):
        handed = 0

        def recv_queued(self) -> tuple[bytes, Message] | None:
            if self.handed >= 100_000:  # "endless": seconds of beats to the broker, far over the budget
                return None
            self.handed += 1
            meta = Heartbeat(incarnation="1", phase="starting").meta()
            return b"c0s0", Message(type=MsgType.HEARTBEAT, sender="c0s0", meta=meta)

    async def scenario() -> tuple[bool, bool, int]:
        topology = _topology()
        broker = Broker(topology, plan_for(topology, None), Metrics("broker"), socket_options_for(
            topology, "broker", None, Metrics("broker")), clock=asyncio.get_running_loop().time, new_run=True)
        endless, empty = _Endless([]), _HeldInbox([])
        behind = await broker._drain(endless, endless, 0.01)  # type: ignore[arg-type]
        caught_up = await broker._drain(empty, empty, 0.01)  # type: ignore[arg-type]
        return behind, caught_up, endless.handed

    behind, caught_up, handed = asyncio.run(scenario())
    assert not behind and 2 <= handed < 100_000, (behind, handed)
    assert caught_up
