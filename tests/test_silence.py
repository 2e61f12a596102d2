"""How silent a live ring member looks to the others: a real broker and a node's membership over loopback.

A stage stops holding back for an averaging round once a member of its rings looks silent for 1.5
heartbeat intervals (``Averager.hold_s``).  A node reads a member's silence as the broker's last
published figure plus the time since that publication, so the publication period adds to what a live
member's heartbeat interval alone would give.  With the full state published once an interval, a member
that beats just after each publication read up to two intervals silent, and fast clusters trained past
rounds of slow live ones (issue #14: six clusters, a full-core PC skipping rounds of 0.14-core PCs).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq.asyncio

from brokers.topology import Broker
from ravq.cli.main import plan_for
from ravq.config import Topology, parse_topology
from ravq.swarm.membership import Membership
from ravq.metrics import Metrics
from ravq.net.security import socket_options_for
from ravq.net.wire import DecodeLimits
from tests.swarm import local_topology

INTERVAL_S = 0.4


def _topology() -> Topology:
    data = local_topology("tests.sgd_task", [1, 1], {"steps": 10},
                          timeouts={"heartbeat_interval_s": INTERVAL_S, "lost_s": 4 * INTERVAL_S})
    return parse_topology(data)


async def _max_silence(watch_s: float) -> tuple[float, int]:
    """Node c1s0 beats 20 ms after each full-state publication it receives (the worst phase: the
    broker's next publication finds it almost an interval silent); c0s0 samples c1s0's silence every
    10 ms.  Returns the largest silence seen and how many full-state updates c1s0 acted on."""
    topology = _topology()
    broker_metrics = Metrics("broker")
    broker = Broker(topology, plan_for(topology, None), broker_metrics,
                    socket_options_for(topology, "broker", None, broker_metrics))
    limits = DecodeLimits(max_header_bytes=topology.limits.max_header_bytes, max_frames=topology.limits.max_frames)
    ctx = zmq.asyncio.Context()
    members = {}
    for name in ("c0s0", "c1s0"):
        metrics = Metrics("node")
        members[name] = Membership(ctx, topology, name, metrics, limits,
                                   socket_options_for(topology, name, None, metrics))
    beats = 0

    async def beat_after_updates(m: Membership) -> None:
        nonlocal beats
        while True:
            m.changed.clear()
            await m.changed.wait()
            await asyncio.sleep(0.02)
            await m.heartbeat({}, done=False)
            beats += 1

    async def keep_alive(m: Membership) -> None:
        while True:
            await m.heartbeat({}, done=False)
            await asyncio.sleep(INTERVAL_S / 2)

    worst = 0.0
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(broker.run())
            for m in members.values():
                await m.join()
            tasks = [tg.create_task(m.follow()) for m in members.values()]
            tasks += [tg.create_task(beat_after_updates(members["c1s0"])),
                      tg.create_task(keep_alive(members["c0s0"]))]
            await asyncio.sleep(2 * INTERVAL_S)  # settled: both follow the publications
            deadline = time.monotonic() + watch_s
            while time.monotonic() < deadline:
                worst = max(worst, members["c0s0"].silent_s("c1s0"))
                await asyncio.sleep(0.01)
            broker.stop()
            for t in tasks:
                t.cancel()
    finally:
        for m in members.values():
            m.close()
        ctx.term()
    return worst, beats


@pytest.mark.timeout(60)
def test_a_live_member_never_looks_silent_for_much_more_than_its_heartbeat_interval() -> None:
    worst, beats = asyncio.run(_max_silence(watch_s=12 * INTERVAL_S))
    assert beats >= 8, f"the node beat only {beats} times after full-state updates"
    # its heartbeat interval, a quarter of one between silence updates, and loopback's scheduling;
    # once the state was published once an interval only, this read ~2 intervals (0.78 s here)
    assert worst <= 1.3 * INTERVAL_S + 0.05, f"a live member looked {worst:.3f}s silent (interval {INTERVAL_S}s)"
    assert worst < 1.5 * INTERVAL_S  # below Averager.hold_s: never taken for dead


class _SlowBeats:
    """What ``Node._heartbeats`` reads of a node, with a membership whose every heartbeat takes 60 ms
    (statistics, encoding, CURVE and an event loop sharing a small CPU with the compute thread)."""

    def __init__(self, interval_s: float) -> None:
        self.topology = type("T", (), {"timeouts": type("O", (), {"heartbeat_interval_s": interval_s})()})()
        self.worker, self.generation, self.phase, self.ready, self._stage_bytes = None, 0, "training", 0, 0
        self._beat_now = asyncio.Event()
        self.sent: list[float] = []
        self.membership = self
        self.report: dict[str, object] = {}

    def stats(self) -> dict[str, object]:
        return {}

    async def heartbeat(self, stats: dict[str, object], done: bool) -> None:
        self.sent.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.06)


def test_heartbeats_keep_their_cadence_when_sending_one_takes_time() -> None:
    """Sleeping an interval after each send made the period interval + send time (1.06 intervals here,
    more on a slow PC); a beat asked for early (``_beat_now``) does not move the cadence."""
    from ravq.node import Node

    async def run() -> list[float]:
        node = _SlowBeats(0.2)
        task = asyncio.create_task(Node._heartbeats(node))  # type: ignore[arg-type]
        await asyncio.sleep(1.1)
        node._beat_now.set()  # an extra beat at once, between two regular ones
        await asyncio.sleep(0.95)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return node.sent

    sent = asyncio.run(run())
    start = sent[0]
    regular = [t - start for t in sent if abs((t - start) / 0.2 - round((t - start) / 0.2)) < 0.15]
    extra = [t - start for t in sent if t - start not in regular]
    assert len(extra) == 1 and 1.08 <= extra[0] < 1.15, [round(t - start, 3) for t in sent]
    assert len(regular) == 11, [round(t, 3) for t in regular]  # 0, 0.2, ..., 2.0: none skipped or added
    assert regular[-1] == pytest.approx(2.0, abs=0.05)
