"""Binary Star (brokers.binarystar, brokers.replica): the pair's state machine on a virtual clock, and a
passive broker's followed state restored into a broker that takes over.  No sockets."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import zmq.asyncio

from brokers.binarystar import ACTIVE, BACKUP, PASSIVE, PRIMARY, BinaryStar
from brokers.pair import ActiveSide, Pair, as_backup
from brokers.replica import SEQ_JUMP, Replica
from brokers.topology import Broker
from ravq.cli.main import plan_for
from ravq.config import Topology, parse_topology
from ravq.metrics import Metrics
from ravq.net.clone import GLOBAL
from ravq.net.options import SocketOptions
from ravq.net.protocol import Heartbeat

EXPIRY = 2.0


def _pair(now: float = 0.0) -> tuple[BinaryStar, BinaryStar]:
    return (BinaryStar(primary=True, expiry_s=EXPIRY, now=now),
            BinaryStar(primary=False, expiry_s=EXPIRY, now=now))


def _exchange(a: BinaryStar, b: BinaryStar, now: float) -> None:
    """Each hears the other's state (as published at ``now``)."""
    sa, ta, sb, tb = a.state, a.term, b.state, b.term
    a.peer_said(sb, tb, now)
    b.peer_said(sa, ta, now)


def test_first_start_the_primary_is_active_and_the_backup_passive() -> None:
    p, b = _pair()
    _exchange(p, b, 0.1)
    _exchange(p, b, 0.2)
    assert (p.state, b.state) == (ACTIVE, PASSIVE) and p.term == 1 and p.failovers == b.failovers == 0


def test_a_vote_makes_the_backup_active_only_once_it_lost_the_primary_too() -> None:
    p, b = _pair()
    for t in (0.1, 0.2, 0.5, 1.0):
        _exchange(p, b, t)
    assert b.vote(1.5) is None and b.state == PASSIVE  # the primary was heard 0.5 s ago: no split brain
    assert b.vote(2.9) is None  # 1.9 s of silence: not yet
    change = b.vote(3.0)  # the primary died after 1.0: two intervals of silence and a node's vote
    assert change is not None and (change.before, change.after) == (PASSIVE, ACTIVE)
    assert b.active and b.failovers == 1 and b.term == p.term + 1


def test_a_partition_between_the_brokers_alone_never_makes_two_actives() -> None:
    """The link between the brokers is cut for a long time; nodes still hear the primary and so never vote
    on the backup: the backup stays passive however long it loses the primary."""
    p, b = _pair()
    _exchange(p, b, 0.1)
    _exchange(p, b, 0.2)
    for t in (x / 4 for x in range(1, 400)):
        assert p.vote(t) is None and p.active  # the primary serves its nodes all along
        assert [p.state, b.state].count(ACTIVE) == 1
    assert b.state == PASSIVE and b.peer_lost(100.0)


def test_two_actives_that_meet_agree_on_one_and_the_older_term_turns_passive() -> None:
    """A partition that nodes voted across (some heard only the backup): when it heals, the active of
    the older term turns passive, whichever hears the other first."""
    for first in (0, 1):
        p, b = _pair()
        _exchange(p, b, 0.1)
        _exchange(p, b, 0.2)
        assert b.vote(5.0) is not None and p.active and b.active  # the cut; a node voted on the backup
        stars = [p, b] if first == 0 else [b, p]
        other = stars[1]
        stars[0].peer_said(other.state, other.term, 6.0)
        stars[1].peer_said(stars[0].state, stars[0].term, 6.0)
        assert (p.state, b.state) == (PASSIVE, ACTIVE), first
        assert b.term > p.term


def test_the_old_primary_comes_back_passive_and_the_next_failover_goes_back_to_it() -> None:
    p, b = _pair()
    _exchange(p, b, 0.1)
    _exchange(p, b, 0.2)
    assert b.vote(3.0) is not None  # the primary died at 0.2
    p = BinaryStar(primary=True, expiry_s=EXPIRY, now=10.0)  # restarted
    assert p.vote(10.5) is None  # a node's request before it heard anyone: it waits for an active peer
    _exchange(p, b, 10.6)
    assert (p.state, b.state) == (PASSIVE, ACTIVE)
    assert p.vote(11.0) is None  # the backup serves: the primary turns votes down
    assert p.vote(12.7) is not None and p.active and p.term > b.term  # the backup died at 10.6


def test_a_backup_that_never_heard_an_active_primary_never_serves() -> None:
    b = BinaryStar(primary=False, expiry_s=EXPIRY, now=0.0)
    assert all(b.vote(t) is None for t in (1.0, 5.0, 100.0)) and b.state == BACKUP
    p = BinaryStar(primary=True, expiry_s=EXPIRY, now=0.0)
    assert p.vote(1.0) is None and p.vote(2.0) is not None and p.active  # a primary alone serves after expiry


def test_a_passive_broker_takes_over_when_its_peer_restarts() -> None:
    p, b = _pair()
    _exchange(p, b, 0.1)
    _exchange(p, b, 0.2)
    assert b.peer_said(PRIMARY, 0, 1.0) is not None and b.active and b.failovers == 1
    restarted = BinaryStar(primary=True, expiry_s=EXPIRY, now=1.0)
    restarted.peer_said(b.state, b.term, 1.1)
    assert restarted.state == PASSIVE


def test_no_sequence_of_events_gives_two_actives_unless_both_were_voted_for_while_cut() -> None:
    """Every short sequence of exchanges and votes, on a clock that only moves on: two actives only ever
    follow votes on both sides of a cut, and the next exchange resolves them."""
    events = ["exchange", "vote_p", "vote_b", "wait"]
    for seq in itertools.product(events, repeat=6):
        p, b = _pair()
        now = 0.0
        for e in seq:
            now += 0.5 if e != "wait" else 3.0
            if e == "exchange":
                _exchange(p, b, now)
                assert not (p.active and b.active), seq
            elif e == "vote_p":
                p.vote(now)
            elif e == "vote_b":
                b.vote(now)


TOPOLOGY = {"task": "ravq.tasks.charlm", "broker": {"pub_port": 5000, "router_port": 5001},
            "nodes": [{"name": f"c{c}s{s}", "pipeline_port": 6000 + 4 * c + 2 * s,
                       "ring_port": 6001 + 4 * c + 2 * s, "cluster": c, "stage": s}
                      for c in range(2) for s in range(2)]
            + [{"name": "spare", "pipeline_port": 6100, "ring_port": 6101, "standby": True}]}


def test_a_passive_broker_restores_the_active_ones_run_book_and_numbers(tmp_path: Path) -> None:
    """A broker's published state (a whole snapshot, then updates) followed by a replica and restored: the
    same run id, members with their incarnations, states and checkpoints, clusters with their
    generations, the standby; the plan epoch and every topic's number past those seen."""
    topology = parse_topology({**TOPOLOGY, "broker": {**TOPOLOGY["broker"], "state_dir": str(tmp_path)}},
                              resolve_task=False)
    now = [1.0]
    active = Broker(topology, plan_for(topology, None), Metrics("broker"), SocketOptions(),
                    clock=lambda: now[0])
    for name in ("c0s0", "c0s1", "c1s0", "c1s1", "spare"):
        active.book.register(name, f"inc-{name}", now[0])
        active.silences.beat(name, now[0])
        phase = "standby" if name == "spare" else "training"
        points = [{"version": 7, "micro_batch": 70}]
        active.book.heartbeat(name, Heartbeat(incarnation=f"inc-{name}", phase=phase, ready=0,
                                              checkpoints=points), now[0])
        active.book.advance(active.book.cluster_of(name), now[0])
    active._refresh(list(active.members), range(2))
    replica = Replica(clock=lambda: now[0])
    seqs, parts = active.keyed.snapshot(None)
    replica.apply_snapshot([{"items": parts[0], "seqs": seqs, "incarnation": active.incarnation, "seq": 3}]
                           + [{"items": p} for p in parts[1:]], now[0])

    def follow() -> None:
        for u in active.keyed.flush():
            assert replica.apply_update({"kind": "delta", "incarnation": active.incarnation, "topic": u.topic,
                                         "seq": u.seq, "items": u.items, "more": u.more})

    now[0] = 4.0  # c1s1 silent past 1.4 intervals, as the broker publishes it (at once)
    for name in ("c0s0", "c0s1", "c1s0", "spare"):
        active.silences.beat(name, now[0])
    for name in active.silences.due(now[0]):
        active.keyed.put(f"silent/{name}", GLOBAL, round(now[0] - active.silences.last[name], 3))
    follow()
    now[0] = 20.0  # c1s1 silent: lost, cluster 1 paused with generation 1
    for name in ("c0s0", "c0s1", "c1s0"):
        active.book.heartbeat(name, Heartbeat(incarnation=f"inc-{name}", phase="training", ready=0), now[0])
    assert active.book.check(now[0])
    active._refresh(list(active.members), range(2))
    follow()
    assert not replica.apply_update({"kind": "tick", "incarnation": active.incarnation, "topic": "g.",
                                     "seq": active.keyed.seqs["g."] + 1})  # a gap: fetch a snapshot
    assert not replica.apply_update({"kind": "tick", "incarnation": "another", "topic": "g.", "seq": 1})
    restored = replica.restore(active.the_run, lost_s=6.0, replace_s=30.0, standbys=["spare"], now=30.0,
                               term=2)
    assert restored.run.run_id == active.run_id and restored.run.plan.epoch > active.plan.epoch
    book = restored.book
    assert {n: m.state for n, m in book.members.items()} == {n: m.state for n, m in active.members.items()}
    assert {n: m.incarnation for n, m in book.members.items()} == {n: f"inc-{n}" for n in book.members}
    assert book.members["c0s0"].checkpoints == [{"version": 7, "micro_batch": 70}]
    assert [(c.state, c.generation) for c in book.clusters] == [("training", 0), ("paused", 1)]
    assert book.standbys == ["spare"] and book.cluster_of("c1s1") == 1
    assert all(restored.seqs[t] == n + 2 * SEQ_JUMP for t, n in active.keyed.seqs.items())
    # each has lost_s from the takeover on, but one published silent (3 s, at 4.0) was last heard at 1.0:
    # its loss is not put off by the 26 s from that update to the takeover
    seen = {n: m.last_seen for n, m in book.members.items()}
    assert seen == {**dict.fromkeys(book.members, 30.0), "c1s1": 1.0}
    # and the broker that takes over publishes it silent at once (nodes stop holding rounds back for it)
    now[0] = 30.0
    pair = Pair(as_backup(topology_with_backup(topology), {}), active.plan, Metrics("broker"), SocketOptions(),
                primary=False)
    taken = Broker(as_backup(topology_with_backup(topology), {}), active.plan, Metrics("broker"),
                   SocketOptions(), clock=lambda: now[0], pair=ActiveSide(pair, restored))
    assert taken.silences.due(now[0]) == ["c1s1"] and taken.silences.figures(now[0]) == [("silent/c1s1", 29.0)]


def test_status_names_the_serving_broker_and_its_failovers() -> None:
    from ravq.cli.status import format_status

    star = BinaryStar(primary=False, expiry_s=EXPIRY, now=0.0)
    star.peer_said(ACTIVE, 1, 0.1)
    assert star.vote(5.0) is not None
    pair = {**star.public(6.0), "peer_address": "10.0.0.1:5556"}
    text = format_status({"seq": 3, "run_id": "r", "plan": {"clusters": []}, "clusters": [], "members": {},
                          "pair": pair})
    assert "broker: the backup is active (term 2, 1 failovers here); the other (10.0.0.1:5556) is active, " \
           "last heard 5.9s ago" in text
    assert "broker: the" not in format_status({"seq": 3, "plan": {"clusters": []}})


def topology_with_backup(topology: Topology) -> Topology:
    backup = {"host": "127.0.0.1", "pub_port": 5002, "router_port": 5003, "state_dir": topology.broker.state_dir}
    data = topology.model_dump(exclude_none=True)
    return parse_topology({**data, "broker": {**data["broker"], "backup": backup}}, resolve_task=False)


def test_a_broker_that_takes_over_serves_the_reachability_verdicts_it_followed(tmp_path: Path) -> None:
    """The verdicts the active broker published come back in the broker that takes over: nodes are not
    dialled again and a rejoining node does not wait for its peers to be (they asked again after the
    takeover, each a dial-back, before a restarted node could link to them)."""
    nodes = [{**n, "reachable": n["name"] != "c1s0"} for n in TOPOLOGY["nodes"]]
    backup = {"host": "127.0.0.1", "pub_port": 5002, "router_port": 5003, "state_dir": str(tmp_path / "b")}
    topology = parse_topology({**TOPOLOGY, "nodes": nodes, "broker": {
        **TOPOLOGY["broker"], "state_dir": str(tmp_path / "p"), "backup": backup}}, resolve_task=False)
    plan = plan_for(topology, None)
    active = Broker(topology, plan, Metrics("broker"), SocketOptions())
    for name in ("c0s0", "c1s0"):  # declared in the topology: no dial-back, no socket
        asyncio.run(active.reach.check(zmq.asyncio.Context.instance(), name, ["pipeline"]))
    active._refresh(list(active.members), range(2))
    replica = Replica()
    seqs, parts = active.keyed.snapshot(None)
    replica.apply_snapshot([{"items": parts[0], "seqs": seqs, "incarnation": active.incarnation, "seq": 3}]
                           + [{"items": p} for p in parts[1:]], 1.0)
    restored = replica.restore(active.the_run, lost_s=6.0, replace_s=30.0, standbys=["spare"], now=2.0,
                               term=2)
    assert restored.reach == {"c0s0": "reachable", "c1s0": "behind_nat"}
    pair = Pair(as_backup(topology, {}), plan, Metrics("broker"), SocketOptions(), primary=False)
    taken = Broker(as_backup(topology, {}), plan, Metrics("broker"), SocketOptions(),
                   pair=ActiveSide(pair, restored))
    assert taken.reach.public() == restored.reach
    assert not taken.reach.wants("c0s0") and not taken.reach.wants("c1s0") and taken.reach.wants("c0s1")
    seqs, parts = taken.keyed.snapshot(None)  # and its snapshots carry them
    items = dict(item for part in parts for item in part)
    assert items["reach/c0s0"] == "reachable" and items["reach/c1s0"] == "behind_nat"
