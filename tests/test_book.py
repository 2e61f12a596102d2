"""The broker's membership book (no sockets): loss, restart, recovery, broker restart."""

from __future__ import annotations

import time

import pytest

from brokers.book import Book
from ravq.config import ClusterPlan, Plan
from ravq.net.protocol import Heartbeat

PLAN = Plan(clusters=[ClusterPlan(nodes=["a0", "a1"], cuts=["l3"]), ClusterPlan(nodes=["b0", "b1"], cuts=["l3"])])
LOST_S = 5.0


def _beat(book: Book, node: str, now: float, **meta: object) -> bool:
    beat = {"incarnation": f"i-{node}", "phase": "training", "generation": 0, **meta}
    return book.heartbeat(node, Heartbeat(**beat), now)  # type: ignore[arg-type]


def _started() -> Book:
    book = Book(PLAN, lost_s=LOST_S, now=0.0)
    for n in ("a0", "a1", "b0", "b1"):
        book.register(n, f"i-{n}", 0.0)
    for n in ("a0", "a1", "b0", "b1"):
        _beat(book, n, 1.0)
    book.check(1.0)
    return book


def test_first_start_trains_once_everyone_is_past_waiting() -> None:
    book = Book(PLAN, lost_s=LOST_S, now=0.0)
    for n in ("a0", "a1", "b0"):
        book.register(n, f"i-{n}", 0.0)
        _beat(book, n, 9.5, phase="starting")  # waiting for everyone
    book.check(10.0)  # b1 is not there yet: a first start waits for it, nobody is lost
    assert [c.state for c in book.clusters] == ["starting", "starting"]
    assert book.members["b1"].state == "missing" and book.excluded() == []
    book.register("b1", "i-b1", 10.5)
    for n in ("a0", "a1", "b0", "b1"):
        _beat(book, n, 11.0)
    book.check(11.0)
    assert [c.state for c in book.clusters] == ["training", "training"] and book.excluded() == []


def test_a_cluster_that_is_done_leaves_the_rings_while_another_trains_on() -> None:
    """A cluster that lost time to a pause trains on after the other finished: it must not wait, every
    round, for ring peers that have exited.  Clusters finishing together change nothing (no new plan
    under their last rounds)."""
    book = _started()
    for n in ("a0", "a1"):
        _beat(book, n, 2.0, done=True, phase="finishing")
    for n in ("b0", "b1"):
        _beat(book, n, 2.0)
    book.check(2.0)
    assert [c.state for c in book.clusters] == ["done", "training"] and book.excluded() == []
    for n in ("b0", "b1"):
        _beat(book, n, 2.0 + LOST_S)
    assert book.check(2.0 + LOST_S) and book.excluded() == [0]

    together = _started()
    for n in ("a0", "a1"):
        _beat(together, n, 2.0, done=True, phase="finishing")
    together.check(2.0)
    for n in ("b0", "b1"):
        _beat(together, n, 3.0, done=True, phase="finishing")
    together.check(3.0)
    together.check(3.0 + LOST_S)
    assert [c.state for c in together.clusters] == ["done", "done"] and together.excluded() == []


def test_a_silent_node_is_lost_its_cluster_pauses_recovers_and_trains_again() -> None:
    book = _started()
    for t in (2.0, 4.0, 6.0):
        for n in ("a0", "a1", "b0"):
            _beat(book, n, t)
    assert book.check(6.5)  # b1 last seen at 1.0
    assert book.members["b1"].state == "lost"
    assert book.clusters[1].state == "paused" and book.clusters[1].generation == 1
    assert book.excluded() == [1] and book.clusters[0].state == "training"
    _beat(book, "b1", 8.0)  # back (a freeze ends): everyone up, so the cluster recovers
    book.check(8.0)
    assert book.clusters[1].state == "recovering" and book.clusters[1].catchup  # cluster 0 trains
    _beat(book, "b0", 8.5, generation=1, ready=1, trained=300, phase="paused")
    book.check(8.5)
    assert book.clusters[1].state == "recovering"  # b1 not ready yet
    _beat(book, "b1", 9.0, generation=1, ready=1, phase="paused")
    book.check(9.0)
    cs = book.clusters[1]
    assert cs.state == "training" and cs.trained == 300 and book.excluded() == []
    assert book.recoveries == [9.0 - 6.5]


def test_a_restarted_node_is_noticed_even_while_it_was_still_up() -> None:
    book = _started()
    book.register("a1", "i-a1-new", 2.0)  # re-registers within lost_s: a new process, its state is gone
    assert book.clusters[0].state == "paused" and book.clusters[0].generation == 1
    assert "restarted" in book.clusters[0].reason
    # a heartbeat with a new incarnation (its REGISTER went missing) is a restart too
    book2 = _started()
    _beat(book2, "b0", 2.0, incarnation="other")  # its cluster moves along at once: every member is up
    assert book2.clusters[1].state == "recovering" and book2.clusters[1].generation == 1


def test_a_restarted_broker_rebuilds_from_heartbeats_and_marks_missing_nodes_lost() -> None:
    book = Book(PLAN, lost_s=LOST_S, now=100.0)  # a new broker: nobody registered with it
    for n in ("a0", "a1", "b0"):
        _beat(book, n, 100.5, generation=2, trained=50)
    book.check(101.0)
    assert book.clusters[0].state == "training" and book.clusters[0].generation == 2
    assert book.clusters[1].state == "training" and book.excluded() == []
    for n in ("a0", "a1", "b0"):
        _beat(book, n, 104.0, generation=2)
    book.check(105.5)  # b1 never heard from: lost after lost_s
    assert book.members["b1"].state == "lost"
    assert book.clusters[1].state == "paused" and book.clusters[1].generation == 3 and book.excluded() == [1]


def test_a_node_restarted_while_the_broker_was_down_is_noticed() -> None:
    book = Book(PLAN, lost_s=LOST_S, now=100.0)
    book.register("b1", "fresh", 100.2)  # a fresh process registers before b0's first heartbeat
    _beat(book, "b0", 100.5, generation=0, trained=80)  # paused, and recovering at once: both are up
    assert book.clusters[1].state == "recovering" and book.clusters[1].generation == 1


def test_a_standby_whose_memory_fits_takes_a_lost_nodes_stage_after_replace_s() -> None:
    book = Book(PLAN, lost_s=LOST_S, now=0.0, replace_s=30.0, standbys=["small", "big"])
    for n in ("a0", "a1", "b0", "b1"):
        book.register(n, f"i-{n}", 0.0)
        _beat(book, n, 1.0, stage_bytes=4 << 30)
    memory = {"small": 1 << 30, "big": 8 << 30}  # a standby says its memory in every heartbeat
    for n in memory:
        book.register(n, f"i-{n}", 0.0)
        book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="standby", memory_bytes=memory[n]), 1.0)
    book.check(1.0)
    for t in range(2, 45):
        for n in ("a0", "a1", "b0", "small", "big"):
            book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", generation=0, memory_bytes=memory.get(n, 0),
                                        phase="standby" if n in memory else "paused"), float(t))
        book.check(float(t))
        if t < 36:  # lost at ~6 s, replaced 30 s later
            assert book.plan.clusters[1].nodes == ["b0", "b1"], t
    assert book.plan.clusters[1].nodes == ["b0", "big"]  # "small" does not fit a 4 GiB stage
    assert "big replaces b1" in book.clusters[1].reason and book.plan.epoch > PLAN.epoch
    assert book.clusters[1].state == "recovering"  # everyone up again: "big" catches up and reports ready


def test_when_no_standby_fits_the_cluster_stays_paused_and_says_why() -> None:
    book = Book(PLAN, lost_s=LOST_S, now=0.0, replace_s=10.0, standbys=["small"])
    for n in ("a0", "a1", "b0", "b1"):
        book.register(n, f"i-{n}", 0.0)
        _beat(book, n, 1.0, stage_bytes=4 << 30)
    book.register("small", "i-small", 0.0)
    for t in range(2, 25):
        for n in ("a0", "a1", "b0"):
            _beat(book, n, float(t))
        book.heartbeat("small", Heartbeat(incarnation="i-small", phase="standby", memory_bytes=1 << 30),
                       float(t))
        book.check(float(t))
    assert book.clusters[1].state == "paused" and book.plan.clusters[1].nodes == ["b0", "b1"]
    assert "no standby has 4.00 GiB" in book.clusters[1].reason and "small 1.00 GiB" in book.clusters[1].reason


def test_a_recovering_cluster_catches_up_from_the_freshest_training_cluster() -> None:
    plan = Plan(clusters=[ClusterPlan(nodes=[f"{x}0", f"{x}1"], cuts=["l3"]) for x in "abc"])
    book = Book(plan, lost_s=LOST_S, now=0.0)
    nodes = [n for c in plan.clusters for n in c.nodes]
    for n in nodes:
        book.register(n, f"i-{n}", 0.0)
    versions = {"a0": 50, "a1": 49, "b0": 80, "b1": 20, "c0": 70, "c1": 69}  # b's stage 1 is behind
    for n in nodes:
        _beat(book, n, 1.0, stats={"version": versions[n]})
    book.check(1.0)
    book.register("a1", "i-a1-new", 2.0)  # a1 restarted: cluster 0 pauses, and recovers once a1 beats
    _beat(book, "a1", 2.5, phase="paused", generation=1)
    book.check(2.5)
    cs = book.clusters[0]
    assert cs.state == "recovering" and cs.catchup and cs.source == 2  # c (69) is further on than b (20)
    assert book.public()["clusters"][0]["source"] == 2
    for n in ("b0", "b1", "c0", "c1"):  # the others pause too: nobody to catch up from
        book.register(n, f"i-{n}-new", 3.0)
    book.register("a0", "i-a0-new", 3.0)
    _beat(book, "a0", 3.5, phase="paused", generation=2)
    _beat(book, "a1", 3.5, phase="paused", generation=2)
    book.check(3.5)
    assert book.clusters[0].state == "recovering" and not book.clusters[0].catchup and book.clusters[0].source is None


class _CountingMembers(dict):  # type: ignore[type-arg]
    """A book's members that count the walks over all of them."""

    walks = 0

    def items(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().items()

    def values(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().values()

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().__iter__()


def test_a_heartbeat_visits_its_own_member_and_cluster_only_and_the_index_follows_a_replacement() -> None:
    """A heartbeat found its member by a scan of the plan and checked every member (O(N) each, O(N^2) a
    heartbeat interval: 683 ms per heartbeat at 10,000 members); the loss check is the timer's."""
    names = [f"n{i}" for i in range(400)]
    plan = Plan(clusters=[ClusterPlan(nodes=names[i:i + 2], cuts=["layer.1"]) for i in range(0, 400, 2)])
    book = Book(plan, lost_s=LOST_S, now=0.0, replace_s=2.0, standbys=["s"])
    book.members = _CountingMembers(book.members)
    for n in [*names, "s"]:
        book.register(n, f"i-{n}", 0.0)
    for n in names:
        book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="training"), 1.0)
        book.advance(book.cluster_of(n), 1.0)
    assert _CountingMembers.walks == 0 and book.clusters[199].state == "training"
    assert book.cluster_of("n399") == 199 and book.cluster_of("s") is None
    book.heartbeat("s", Heartbeat(incarnation="i-s", phase="standby", memory_bytes=1), 1.0)
    for t in (1.5, 7.0, 9.5):  # n399 goes silent: lost at the timer's check, then replaced by s
        for n in names[:-1]:
            book.heartbeat(n, Heartbeat(incarnation=f"i-{n}", phase="training"), t)
        book.heartbeat("s", Heartbeat(incarnation="i-s", phase="standby", memory_bytes=1), t)
        book.check(t)
    assert book.plan.clusters[199].nodes == ["n398", "s"]
    assert book.cluster_of("s") == 199 and book.cluster_of("n399") is None


def test_an_events_exclusions_look_at_its_clusters_and_the_timer_says_what_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every registration and heartbeat change ran ``excluded`` over every cluster, and every change the
    timer found re-published every member and cluster; freshest_source walked every member per recovery."""
    plan = Plan(clusters=[ClusterPlan(nodes=[f"n{2 * c}", f"n{2 * c + 1}"], cuts=["l3"]) for c in range(300)])
    book = Book(plan, lost_s=LOST_S, now=0.0)
    names = [n for c in plan.clusters for n in c.nodes]
    for n in names:
        book.register(n, f"i-{n}", 0.0)
        _beat(book, n, 1.0, stats={"version": 10})
    assert not book.check(1.0).names and book.excluded() == []
    looked: list[int] = []
    idle = Book._idle
    monkeypatch.setattr(Book, "_idle", lambda self, c: looked.append(c) or idle(self, c))
    _beat(book, "n11", 1.5, left=True)  # cluster 5 pauses
    book.exclude_idle([5])
    assert looked == [5] and book.plan.excluded == [5] and book.plan.epoch > plan.epoch
    assert abs(book.plan.epoch / 1000 - time.time()) < 60  # every epoch names its own start (rounds by time)
    stamped = book.plan.epoch
    book.exclude_idle([5])  # nothing new: the same plan
    assert book.plan.excluded == [5] and book.plan.epoch == stamped
    for n in names:
        if n not in ("n11", "n21"):  # n21 goes silent: lost at the timer's check, its cluster pauses
            _beat(book, n, 1.0 + LOST_S, stats={"version": 20 if n in ("n2", "n3") else 10})
    changes = book.check(1.5 + LOST_S)
    assert changes.names == {"n21"} and changes.clusters == {10}
    _beat(book, "n11", 7.0, stats={"version": 10})  # back: cluster 5 recovers from the freshest, cluster 1
    _beat(book, "n10", 7.0, stats={"version": 10}, generation=1, phase="paused")
    book.advance(5, 7.0)
    assert book.clusters[5].state == "recovering" and book.clusters[5].source == 1


def test_the_exclusions_log_line_stays_short_when_thousands_of_clusters_are_out(
        caplog: pytest.LogCaptureFixture) -> None:
    """Each pause and rejoin logged the whole excluded list: O(N) a line, thousands of lines at a
    10,000-member start.  A short list is still logged whole."""
    plan = Plan(clusters=[ClusterPlan(nodes=[f"n{2 * c}", f"n{2 * c + 1}"], cuts=["l3"]) for c in range(100)])
    book = Book(plan, lost_s=LOST_S, now=0.0)
    names = [n for c in plan.clusters for n in c.nodes]
    for n in names:
        book.register(n, f"i-{n}", 0.0)
        _beat(book, n, 1.0)
    book.check(1.0)
    with caplog.at_level("INFO", logger="brokers.book"):
        for c in range(40):
            _beat(book, f"n{2 * c}", 2.0, left=True)
            book.exclude_idle([c])
    lines = [r.getMessage() for r in caplog.records if "rings now exclude" in r.getMessage()]
    assert len(lines) == 40 and lines[0] == "rings now exclude clusters [0]"
    assert lines[-1] == "rings now exclude clusters (40 in all): now also [39], no longer []"
    assert book.plan.excluded == list(range(40))


def test_a_heartbeat_that_changes_nothing_moves_no_cluster_and_one_saying_ready_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker moved the member's cluster along after every heartbeat (visiting its members); the book
    now does it when the beat changed what a move depends on: here readiness, which no published key
    shows."""
    book = _started()
    _beat(book, "a0", 2.0, left=True)  # cluster 0 pauses, then a0 comes back: it recovers
    book.register("a0", "i-a0", 2.5)
    _beat(book, "a0", 3.0, phase="catching_up", generation=1)
    _beat(book, "a1", 3.0, phase="catching_up", generation=1)
    assert book.clusters[0].state == "recovering" and book.clusters[0].generation == 1
    moved: list[int] = []
    advance = Book._advance
    monkeypatch.setattr(Book, "_advance", lambda self, c, cs, now: moved.append(c) or advance(self, c, cs, now))
    for t in (4.0, 5.0):  # the same beats again: nothing to move
        _beat(book, "a0", t, phase="catching_up", generation=1)
        _beat(book, "b0", t)
    assert moved == [] and book.clusters[0].state == "recovering"
    _beat(book, "a0", 6.0, phase="catching_up", generation=1, ready=1)
    _beat(book, "a1", 6.0, phase="catching_up", generation=1, ready=1)
    assert moved == [0, 0] and book.clusters[0].state == "training"


def test_a_member_silent_during_a_first_start_pauses_its_cluster_only_and_nobody_missing_is_lost() -> None:
    """A registered member that went silent before training began paused its starting cluster, which
    counted as training having begun: every member not registered yet was then lost (at 10,000 emulated
    members, 8,624 lost and their clusters paused while the swarm joined)."""
    plan = Plan(clusters=[*PLAN.clusters, ClusterPlan(nodes=["c0", "c1"], cuts=["l3"])])
    book = Book(plan, lost_s=LOST_S, now=0.0)
    for n in ("a0", "a1", "b0", "b1", "c0"):
        book.register(n, f"i-{n}", 0.0)
    for n in ("a0", "b0", "b1", "c0"):  # a1 died after registering; c1 has not started yet
        _beat(book, n, 5.5, phase="starting")
    changes = book.check(6.0)
    assert changes.names == {"a1"} and book.members["a1"].state == "lost"
    assert [c.state for c in book.clusters] == ["paused", "starting", "starting"]
    assert book.members["c1"].state == "missing" and not book.running
    book.register("c1", "i-c1", 6.5)  # it comes: its cluster starts as if nothing happened elsewhere
    for n in ("b0", "b1", "c0", "c1"):
        _beat(book, n, 7.0)
    assert [c.state for c in book.clusters] == ["paused", "training", "training"] and book.running
