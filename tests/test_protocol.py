"""The node -> broker control messages (``ravq.net.protocol``): decoded once, validated like the wire."""

from __future__ import annotations

import asyncio

import pytest

from brokers.topology import Broker
from ravq.cli.main import plan_for
from ravq.config import parse_topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.protocol import Heartbeat, ReachRequest, Register
from ravq.net.wire import Message, MsgType, WireError
from tests.swarm import local_topology

BEAT = Heartbeat(incarnation="i-a0", phase="training", generation=2, ready=2, trained=40, stage_bytes=1 << 20,
                 checkpoints=[{"version": 40, "trained": 40, "window": 2}], stats={"loss": 1.5, "name": "a0"})


def test_a_heartbeat_register_and_reach_request_decode_to_what_was_encoded() -> None:
    assert Heartbeat.from_meta(BEAT.meta()) == BEAT
    assert Register.from_meta(Register(incarnation="i").meta()) == Register(incarnation="i")
    assert ReachRequest.from_meta({"ports": ["pipeline", "ring"]}).ports == ["pipeline", "ring"]


@pytest.mark.parametrize(("change", "reason"), [
    ({"ready": None}, "bad_field"), ({"generation": True}, "bad_field"), ({"phase": "dancing"}, "bad_field"),
    ({"checkpoints": [{"version": "40"}]}, "bad_field"), ({"gen": 2}, "bad_field"), ({"done": 0}, "bad_field"),
    ({"checkpoints": [{"version": 40}, [40]]}, "bad_field"), ({"checkpoints": [{"version": 4.0}]}, "bad_field"),
])
def test_a_heartbeat_with_a_wrong_or_unknown_field_is_refused(change: dict[str, object], reason: str) -> None:
    with pytest.raises(WireError) as err:
        Heartbeat.from_meta({**BEAT.meta(), **change})
    assert err.value.reason == reason


def test_a_heartbeat_missing_a_field_is_refused() -> None:
    meta = BEAT.meta()
    del meta["phase"]
    with pytest.raises(WireError) as err:
        Heartbeat.from_meta(meta)
    assert err.value.reason == "missing_field"
    with pytest.raises(WireError):
        Register.from_meta({})
    with pytest.raises(WireError):
        ReachRequest.from_meta({"ports": [1]})


def test_the_broker_counts_and_drops_a_heartbeat_of_another_shape() -> None:
    topology = parse_topology(local_topology("tests.sgd_task", [1, 1], {"steps": 10}))
    metrics = Metrics("broker")
    broker = Broker(topology, plan_for(topology, None), metrics, SocketOptions(), clock=lambda: 1.0)
    node = topology.nodes[0].name
    meta = {**BEAT.meta(), "incarnation": f"i-{node}", "gen": 0}  # an unknown field: never guessed at
    beat = Message(type=MsgType.HEARTBEAT, sender=node, meta=meta)
    asyncio.run(broker._handle(None, None, b"", beat))  # type: ignore[arg-type]
    assert metrics.registry.get_sample_value(
        "ravq_bad_messages_total", {"socket": "broker", "reason": "bad_field"}) == 1.0
    assert broker.members[node].incarnation is None and broker.members[node].state == "missing"
