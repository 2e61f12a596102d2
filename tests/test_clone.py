"""The broker's state as keyed updates (issue #37, ``ravq.net.clone``): the broker's side (``brokers.keyed``,
``Broker``'s handlers on an in-memory PUB and ROUTER) and a node's (``MembershipState``), no sockets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import orjson

from brokers.keyed import KeyedState, out_items, plan_head, plan_items, start_flags
from brokers.replica import Replica
from brokers.run import RUN_FILE
from brokers.topology import Broker
from ravq.cli.main import plan_for
from ravq.config import parse_topology
from ravq.metrics import Metrics
from ravq.net.clone import GLOBAL, SILENCES
from ravq.net.options import SocketOptions
from ravq.net.protocol import Heartbeat, Register, SnapshotRequest
from ravq.net.wire import DecodeLimits, Message, MsgType, decode, encode
from ravq.swarm.membership import MembershipState
from tests.swarm import local_topology

MAX_HEADER = 64 * 1024


class _Sockets:
    """The broker's PUB (every update, with its topic) and ROUTER (every reply), in memory."""

    def __init__(self) -> None:
        self.published: list[tuple[str, Message]] = []
        self.replies: list[Message] = []

    async def publish(self, msg: Message, topic: str = "") -> None:
        self.published.append((topic, msg))

    async def reply(self, identity: bytes, msg: Message, peer: str = "") -> None:
        self.replies.append(msg)


def _broker(clusters: int, stages: int = 2) -> tuple[Broker, list[str], list[float]]:
    topology = parse_topology(local_topology("tests.sgd_task", [stages] * clusters, {"steps": 10}))
    now = [1.0]
    broker = Broker(topology, plan_for(topology, None), Metrics("broker"), SocketOptions(), clock=lambda: now[0])
    return broker, [n.name for n in topology.nodes], now


def _send(broker: Broker, sockets: _Sockets, node: str, kind: MsgType, meta: dict[str, Any]) -> None:
    _sends(broker, sockets, [(node, kind, meta)])


def _sends(broker: Broker, sockets: _Sockets, messages: list[tuple[str, MsgType, dict[str, Any]]]) -> None:
    async def handle() -> None:
        for node, kind, meta in messages:
            await broker._handle(sockets, sockets, node.encode(), Message(type=kind, sender=node, meta=meta))  # type: ignore[arg-type]

    asyncio.run(handle())


def _join(broker: Broker, sockets: _Sockets, names: list[str]) -> None:
    _sends(broker, sockets, [m for n in names for m in ((n, MsgType.REGISTER, Register(incarnation=f"i-{n}").meta()),
                                                        (n, MsgType.HEARTBEAT, _beat(n)))])


def _beat(node: str, **fields: Any) -> dict[str, Any]:
    points = [{"version": 40 + i, "trained": 40 + i, "window": 2} for i in range(3)]
    return Heartbeat(**{"incarnation": f"i-{node}", "phase": "training", "checkpoints": points, **fields}).meta()


def test_a_key_is_published_once_per_change_on_its_topic_with_the_topics_next_number() -> None:
    keyed = KeyedState(limit=1000)
    keyed.put("member/a", "c0.", {"state": "up"})
    keyed.put("cluster/0", GLOBAL, {"state": "training"})
    first = keyed.flush()
    assert [(u.topic, u.seq, u.items) for u in first] == [
        ("c0.", 1, [("member/a", {"state": "up"})]), (GLOBAL, 1, [("cluster/0", {"state": "training"})])]
    keyed.put("member/a", "c0.", {"state": "up"})  # unchanged: nothing to send
    assert keyed.flush() == []
    keyed.put("member/a", "sb.", {"state": "up"})  # moved (a standby's key, say): deleted where it was
    assert [(u.topic, u.seq, u.items) for u in keyed.flush()] == [
        ("c0.", 2, [("member/a", None)]), ("sb.", 1, [("member/a", {"state": "up"})])]
    keyed.put("member/huge", "c0.", {"note": "x" * 2000})  # over the limit alone: never sent as it is
    (update,) = keyed.flush()
    assert update.items == [("member/huge", {"too_large": 2028})] and keyed.oversized == 1
    for i in range(100):  # one change set of many keys: updates under the limit, the last without "more"
        keyed.put(f"member/n{i}", "c0.", {"state": "up", "phase": "training"})
    updates = keyed.flush()
    assert len(updates) > 3 and [u.more for u in updates] == [True] * (len(updates) - 1) + [False]
    assert all(sum(len(orjson.dumps(i)) + 1 for i in u.items) <= 1000 for u in updates)
    assert [u.seq for u in updates] == list(range(4, 4 + len(updates)))


def test_a_heartbeat_that_changes_nothing_publishes_nothing_and_visits_no_other_member() -> None:
    """Every heartbeat ran ``Book.check`` over every member and changes re-published the whole state."""
    broker, names, now = _broker(clusters=60)
    sockets = _Sockets()
    _join(broker, sockets, names)
    asyncio.run(broker._flush(sockets))  # type: ignore[arg-type]
    sockets.published.clear()
    visited: list[str] = []
    real = broker.book.check
    broker.book.check = lambda t: visited.append("check") or real(t)  # type: ignore[method-assign]
    now[0] = 2.0
    _sends(broker, sockets, [(n, MsgType.HEARTBEAT, _beat(n)) for n in names])
    assert sockets.published == [] and visited == []
    _send(broker, sockets, "c7s1", MsgType.HEARTBEAT, _beat("c7s1", done=True))  # a change: its topic only
    ((topic, msg),) = sockets.published
    assert topic == "c7." and [k for k, _ in msg.meta["items"]] == ["member/c7s1"]


def test_a_node_follows_updates_fetches_a_snapshot_on_a_gap_and_no_frame_exceeds_the_header_limit() -> None:
    """500 members with three checkpoint points each: the whole state was one 130 KB update, over the 64 KiB
    a node decodes (dropped as header_too_large past about 245 members)."""
    broker, names, now = _broker(clusters=250)
    sockets = _Sockets()
    _join(broker, sockets, names)
    asyncio.run(broker._flush(sockets))  # type: ignore[arg-type]
    sockets.replies.clear()
    _send(broker, sockets, "c3s0", MsgType.SNAPSHOT_REQ, SnapshotRequest().meta())  # the whole state
    limits = DecodeLimits(max_header_bytes=MAX_HEADER, max_frames=4)
    parts = [decode(encode(r), limits).meta for r in sockets.replies]  # each a node decodes
    assert len(parts) > 2
    node = MembershipState(name="c3s0", metrics=Metrics("node"), clock=lambda: now[0])
    node.apply_snapshot(parts)
    assert len(node.members) == 500 and set(node.members.values()) == {"up"}
    assert node.plan == broker.plan and node.checkpoints["c200s1"][0]["version"] == 40
    assert node.topics() == {GLOBAL, "c3."} and node.seqs.keys() == {GLOBAL, SILENCES, "c3."}

    sockets.published.clear()
    _send(broker, sockets, "c3s1", MsgType.HEARTBEAT, _beat("c3s1", phase="paused"))
    _send(broker, sockets, "c3s1", MsgType.HEARTBEAT, _beat("c3s1", phase="training"))
    first, second = (m for t, m in sockets.published if t == "c3.")
    assert node.apply_update(second.meta) is False  # a gap: the first one never arrived
    assert node.apply_update(first.meta) and node.phases["c3s1"] == "paused"
    assert node.apply_update(second.meta) and node.phases["c3s1"] == "training"
    assert node.apply_update(first.meta) and node.phases["c3s1"] == "training"  # old news
    tick = {"kind": "tick", "incarnation": broker.incarnation, "topic": GLOBAL, "seq": node.seqs[GLOBAL]}
    assert node.apply_update(tick) and not node.apply_update({**tick, "seq": tick["seq"] + 1})
    assert node.apply_update({**tick, "seq": tick["seq"] - 1})  # queued while a snapshot came: no gap
    assert not node.apply_update({**tick, "incarnation": "another broker"})


def test_a_member_silent_past_the_threshold_is_published_once_and_cleared_when_it_beats() -> None:
    broker, names, now = _broker(clusters=2)
    sockets = _Sockets()
    for n in names:
        _send(broker, sockets, n, MsgType.REGISTER, Register(incarnation=f"i-{n}").meta())
    interval = broker.topology.timeouts.heartbeat_interval_s
    now[0] = 1.0 + 1.2 * interval
    _send(broker, sockets, "c0s0", MsgType.HEARTBEAT, _beat("c0s0"))
    assert broker.silences.due(1.0 + 1.5 * interval) == [n for n in names if n != "c0s0"]
    assert broker.silences.due(1.0 + 9 * interval) == ["c0s0"]  # once each, however long
    assert broker.silences.due(1.0 + 20 * interval) == []
    assert broker.silences.beat("c1s1", 1.0 + 20 * interval) and not broker.silences.beat("c1s1", 2.0)


def test_an_exclusion_republishes_the_plans_head_only_and_is_saved_on_the_timer(tmp_path: Path) -> None:
    """Each exclusion change re-put every cluster's and member's key and wrote and fsynced the whole plan
    to run.json: O(N) work per event at 10,000 members."""
    data = local_topology("tests.sgd_task", [2] * 20, {"steps": 10})
    data["broker"]["state_dir"] = str(tmp_path)
    topology = parse_topology(data)
    broker = Broker(topology, plan_for(topology, None), Metrics("broker"), SocketOptions(), clock=lambda: 1.0)
    names = [n.name for n in topology.nodes]
    sockets = _Sockets()
    _sends(broker, sockets, [m for n in names for m in (
        (n, MsgType.REGISTER, Register(incarnation=f"i-{n}").meta()), (n, MsgType.HEARTBEAT, _beat(n)))])
    asyncio.run(broker._flush(sockets))  # type: ignore[arg-type]
    saved = json.loads((tmp_path / RUN_FILE).read_text())["plan"]
    sockets.published.clear()
    _send(broker, sockets, "c4s1", MsgType.HEARTBEAT, _beat("c4s1", left=True))  # cluster 4 pauses
    asyncio.run(broker._flush(sockets))  # type: ignore[arg-type]
    keys = [k for _, m in sockets.published for k, _ in m.meta["items"]]
    assert sorted(keys) == ["cluster/4", "disrupted", "member/c4s1", "out/4", "plan"]
    assert broker.plan.excluded == [4] and "excluded" not in broker.keyed.values["plan"]
    assert json.loads((tmp_path / RUN_FILE).read_text())["plan"] == saved
    broker._sync_plan(save=True)  # the heartbeat-interval timer
    assert json.loads((tmp_path / RUN_FILE).read_text())["plan"]["excluded"] == [4]


def test_a_registration_at_scale_gets_its_own_clusters_state_and_parts_cut_once_per_change() -> None:
    """At 10,000 emulated members each registration's snapshot carried 5,000 clusters' states and 10,000
    never-started members' silences (over 1 MB), re-cut per request; a snapshot's silences were cut on the
    sizes of their first figures, so a part outgrew the 64 KiB a node decodes."""
    broker, names, now = _broker(clusters=1000)
    sockets = _Sockets()
    now[0] = 100.0  # long after the broker started: nobody registered yet
    assert broker.silences.due(now[0]) == []  # a first start times only those it heard from
    _send(broker, sockets, "c7s0", MsgType.REGISTER, Register(incarnation="i-c7s0").meta())
    keys = [k for r in sockets.replies for k, _ in r.meta["items"]]
    assert "cluster/7" in keys and not [k for k in keys if k.startswith("cluster/") and k != "cluster/7"]
    assert not [k for k in keys if k.startswith("silent/")]
    assert broker.keyed.parts(GLOBAL) is broker.keyed.parts(GLOBAL)  # kept between requests
    kept = broker.keyed.parts(GLOBAL)
    broker.keyed.put("disrupted", GLOBAL, True)
    assert broker.keyed.parts(GLOBAL) is not kept and ("disrupted", True) in broker.keyed.parts(GLOBAL)[-1]

    _join(broker, sockets, names)  # then every one falls silent
    asyncio.run(broker._flush(sockets))  # type: ignore[arg-type]
    silent = broker.silences.due(now[0] + 2.0)
    for name in silent:
        broker.keyed.put(f"silent/{name}", SILENCES, 1.4)
    assert len(silent) == len(names)
    now[0] += 12345.0  # each figure now five characters longer than the one its key was put with
    sockets.replies.clear()
    _send(broker, sockets, "c3s0", MsgType.SNAPSHOT_REQ, SnapshotRequest(mine=True).meta())
    limits = DecodeLimits(max_header_bytes=MAX_HEADER, max_frames=4)
    parts = [decode(encode(r), limits).meta for r in sockets.replies]  # each a node decodes
    figures = [v for p in parts for k, v in p["items"] if k.startswith("silent/")]
    assert len(figures) == len(names) - 1 and min(figures) >= 12345.0  # c3s0 asked: it is alive


def test_the_start_flags_say_when_every_node_of_the_plan_is_up_and_has_a_verdict() -> None:
    """A starting node waited for every node of the swarm by polling whole snapshots five times a second:
    every node's key, from every node, O(N^2) bytes at a start.  Now it reads one global key."""
    broker, names, _ = _broker(clusters=3)
    sockets = _Sockets()
    _join(broker, sockets, names[:-1])
    assert start_flags(broker.book, broker.reach.verdicts) == {"up": False, "reached": False}
    _join(broker, sockets, names[-1:])
    verdicts = dict.fromkeys(names[:-1], "reachable")
    assert start_flags(broker.book, verdicts) == {"up": True, "reached": False}
    flags = start_flags(broker.book, {**verdicts, names[-1]: "behind_nat"})
    node = MembershipState(name="c0s0", metrics=Metrics("node"))
    node.apply_snapshot([{"items": [("start", flags)], "seqs": {GLOBAL: 1}, "scope": None}])
    assert node.start == {"up": True, "reached": True}


def test_the_averaging_a_plan_was_made_with_reaches_the_nodes() -> None:
    """The planner picks groups per plan (``Plan.averaging``); the nodes rebuild the plan from the broker's
    keys, and it was lost there (they averaged in global rings under a plan scored for groups)."""
    from ravq.config.averaging import AveragingConfig

    topology = parse_topology(local_topology("tests.sgd_task", [1] * 4, {"steps": 10}))
    plan = plan_for(topology, None).model_copy(update={"averaging": AveragingConfig(mode="groups", group_size=2)})
    broker = Broker(topology, plan, Metrics("broker"), SocketOptions(), clock=lambda: 1.0)
    sockets = _Sockets()
    _send(broker, sockets, "c0s0", MsgType.SNAPSHOT_REQ, SnapshotRequest().meta())
    node = MembershipState(name="c0s0", metrics=Metrics("node"), clock=lambda: 1.0)
    node.apply_snapshot([decode(encode(r), DecodeLimits(max_header_bytes=MAX_HEADER)).meta for r in sockets.replies])
    assert node.plan is not None and node.plan.averaging == AveragingConfig(mode="groups", group_size=2)
    assert node.plan == broker.plan


def test_a_snapshots_parts_come_whole_in_order_and_a_newer_snapshot_starts_over() -> None:
    from ravq.net.clone import SnapshotParts

    parts = SnapshotParts()
    assert parts.add({"snap": 1, "part": 1, "parts": 2}) is None
    assert parts.add({"snap": 2, "part": 1, "parts": 2}) is None  # a newer snapshot: snap 1's part is dropped
    assert parts.add({"snap": 2, "part": 0, "parts": 2}) == [{"snap": 2, "part": 0, "parts": 2},
                                                            {"snap": 2, "part": 1, "parts": 2}]


def test_each_excluded_cluster_is_a_key_of_its_own_which_nodes_and_the_passive_broker_read() -> None:
    """The plan's head carried the exclusions as a list: 23 KiB at 10,000 members, re-sent to every node
    with every pause and rejoin."""
    topology = parse_topology(local_topology("tests.sgd_task", [2] * 8, {"steps": 10}))
    plan = plan_for(topology, None)
    out = plan.model_copy(update={"excluded": [2, 5], "epoch": plan.epoch + 1})
    back = out.model_copy(update={"excluded": [5], "epoch": plan.epoch + 2})
    assert out_items(out, plan) == [("out/2", GLOBAL, True), ("out/5", GLOBAL, True)]
    assert out_items(back, out) == [("out/2", GLOBAL, None)]  # only the cluster that came back
    assert "excluded" not in plan_head(out)[2]
    keyed = KeyedState(limit=4000)
    for key, topic, value in plan_items(out):
        keyed.put(key, topic, value)
    keyed.flush()
    seqs, parts = keyed.snapshot(None)
    snapshot = [{"items": p, "seqs": seqs if i == 0 else {}, "scope": None, "incarnation": "b"}
                for i, p in enumerate(parts)]
    node, replica = MembershipState(name="c0s0", metrics=Metrics("node")), Replica()
    node.apply_snapshot(snapshot)
    replica.apply_snapshot(snapshot, 0.0)
    assert node.plan == out and replica.plan() == out
    for key, topic, value in [plan_head(back), *out_items(back, out)]:
        keyed.put(key, topic, value)
    (update,) = keyed.flush()
    meta = {"kind": "delta", "incarnation": "b", "topic": update.topic, "seq": update.seq,
            "items": update.items, "more": update.more}
    assert node.apply_update(meta) and replica.apply_update(meta)
    assert node.plan == back and replica.plan() == back and node.plan.excluded == [5]
