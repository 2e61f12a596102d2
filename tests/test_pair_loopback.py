"""A Binary Star pair in one process on loopback (issue #37 part 3): two ``brokers.pair.Pair`` and a node's
broker client (``ravq.node.membership.Membership``); the primary stops; the client turns to the backup,
which takes over from the state it followed: the same run, a later plan epoch, a newer term; a node that
starts after the takeover asks the backup once it hears it publish."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq.asyncio

from brokers.pair import Pair, as_backup
from ravq.cli.demo import free_ports
from ravq.cli.main import plan_for
from ravq.config import Topology, parse_topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.security import keygen, socket_options_for
from ravq.net.wire import DecodeLimits
from ravq.node.membership import Membership
from tests.pair_watcher import follow_and_beat

INTERVAL_S = 0.2


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("curve", [False, True])
def test_a_node_turns_to_the_backup_which_takes_over_the_run(tmp_path: Path, curve: bool,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    p = free_ports(8)
    keys = {n: keygen(n, tmp_path / "keys") for n in ("broker", "s0", "s1")} if curve else {}
    topology = parse_topology({
        "task": "ravq.tasks.charlm", "timeouts": {"heartbeat_interval_s": INTERVAL_S, "lost_s": 1.0},
        "training": {"checkpoint_dir": str(tmp_path / "ckpt")},
        "security": {"curve": curve, "key_dir": str(tmp_path / "keys")},
        "broker": {"pub_port": p[0], "router_port": p[1], "public_key": keys.get("broker"),
                   "backup": {"host": "127.0.0.1", "pub_port": p[2], "router_port": p[3]}},
        "nodes": [{"name": f"s{i}", "pipeline_port": p[4 + 2 * i], "ring_port": p[5 + 2 * i], "cluster": 0,
                   "stage": i, "public_key": keys.get(f"s{i}")} for i in range(2)]}, resolve_task=False)
    plan = plan_for(topology, None)

    async def main() -> None:
        def opts(served: Topology) -> SocketOptions:  # each broker its own Curve (its ZAP handler)
            return socket_options_for(served, "broker", None, Metrics("broker")) if curve else SocketOptions()

        primary = Pair(topology, plan, Metrics("broker"), opts(topology), primary=True)
        backup = Pair(as_backup(topology, {}), plan, Metrics("broker"), opts(as_backup(topology, {})),
                      primary=False)
        clients: dict[str, Membership] = {}
        ctx = zmq.asyncio.Context()
        async with asyncio.TaskGroup() as tg:
            runs = [tg.create_task(primary.run()), tg.create_task(backup.run())]
            nodes = [tg.create_task(follow_and_beat(ctx, topology, n, clients)) for n in ("s0", "s1")]
            await _until("the pair", lambda: primary.star.active and backup.star.state == "passive"
                         and backup.replica.plan() is not None and len(clients) == 2
                         and all(m.plan is not None and m.members.get("s1") == "up"
                                 for m in clients.values()))
            assert primary.broker is not None
            run_id, epoch = primary.broker.run_id, primary.broker.plan.epoch
            await _until("the replica to hear both", lambda: backup.replica.values.get("member/s1", {})
                         .get("state") == "up")
            primary.stop()  # gone without a word, as a killed one
            await runs[0]
            await _until("the takeover", lambda: backup.star.active and backup.broker is not None
                         and all(m.on == 1 and m.incarnation == backup.broker.incarnation
                                 for m in clients.values()))
            assert backup.broker is not None and backup.broker.run_id == run_id
            assert backup.broker.plan.epoch > epoch and backup.star.term > primary.star.term
            assert backup.star.failovers == 1 and {m.term for m in clients.values()} == {backup.star.term}
            assert backup.broker.members["s0"].incarnation == clients["s0"].report.incarnation
            assert all(m.plan == backup.broker.plan for m in clients.values())
            # a node that starts now asks the dead primary first: it turns to the backup as soon as it hears
            # it publish, not after TURN_AFTER intervals of its own (here 40 s) with no reply
            slow = topology.model_copy(update={"timeouts": topology.timeouts.model_copy(
                update={"heartbeat_interval_s": 16.0, "request_s": 60.0})})
            with caplog.at_level(logging.INFO, logger="ravq.swarm.membership"):
                caplog.clear()
                late = Membership(ctx, slow, "s1", Metrics("node"), DecodeLimits(),
                                  socket_options_for(slow, "s1", None, Metrics("node")) if curve
                                  else SocketOptions(linger_ms=0))
                async with asyncio.timeout(30):
                    assert await late.join() == backup.broker.plan
            assert late.on == 1 and late.term == backup.star.term
            turns = [r.getMessage() for r in caplog.records if "turning to" in r.getMessage()]
            assert turns == ["s1: turning to the backup broker (it publishes)"], turns
            late.close()
            backup.stop()
            for task in nodes:
                task.cancel()
        for m in clients.values():
            m.close()
        ctx.term()

    asyncio.run(main())
