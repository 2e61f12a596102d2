"""The node -> broker control messages (``ravq.net.protocol``): decoded once, validated like the wire."""

from __future__ import annotations

import pytest

from ravq.net.protocol import Heartbeat, ReachRequest, Register
from ravq.net.wire import WireError

BEAT = Heartbeat(incarnation="i-a0", phase="training", generation=2, ready=2, trained=40, stage_bytes=1 << 20,
                 checkpoints=[{"version": 40, "trained": 40, "window": 2}], stats={"loss": 1.5, "name": "a0"})


def test_a_heartbeat_register_and_reach_request_decode_to_what_was_encoded() -> None:
    assert Heartbeat.from_meta(BEAT.meta()) == BEAT
    assert Register.from_meta(Register(incarnation="i").meta()) == Register(incarnation="i")
    assert ReachRequest.from_meta({"ports": ["pipeline", "ring"]}).ports == ["pipeline", "ring"]


@pytest.mark.parametrize(("change", "reason"), [
    ({"ready": None}, "bad_field"), ({"generation": True}, "bad_field"), ({"phase": "dancing"}, "bad_field"),
    ({"checkpoints": [{"version": "40"}]}, "bad_field"), ({"gen": 2}, "bad_field"), ({"done": 0}, "bad_field"),
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
