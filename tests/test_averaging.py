"""Applying overlapped averaging rounds (``Averager._apply``) without sockets.

Two clusters, one segment, a round every step, each round applied ``depth`` steps after its snapshot
(while later rounds are already snapshotted): the way ``overlap_averaging`` runs when rings are slower
than a step.  Each cluster's weights change by a fixed local progress per step, so the intended result
has a closed form: after round r is applied, cluster c holds the common point P_r plus its progress
since round r's snapshot, where P_r = P_{r-1} + outer_lr * (mean progress of step r) (each round moves
the common point by outer_lr times the clusters' mean step from it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from ravq.average.averager import Averager
from ravq.average.correction import PendingRound as _Pending
from ravq.average.rounds import RoundResult
from ravq.average.segments import Segment
from ravq.config import ClusterPlan, Plan

CLUSTERS, NUMEL, STEPS = 2, 5, 12
SEGMENT = Segment(ring_id=0, names=("w",), numel=NUMEL, ring=("c0", "c1"))


def _averager(outer_lr: float, initial: torch.Tensor) -> Averager:
    """An Averager with only what ``_apply`` uses (no sockets or plan; a worker without buffers)."""
    from types import SimpleNamespace

    avg = Averager.__new__(Averager)
    avg.outer_lr, avg.anchors, avg._pending, avg.initial = outer_lr, {}, [], {"w": initial.clone()}
    avg.worker = SimpleNamespace(buffers={}, before_weight_change=lambda: None)  # type: ignore[assignment]
    avg.compression = None  # float32 rings (ravq.average.ring_compression not in play)
    avg.compute_timer = contextlib.nullcontext
    avg.hold_s = 5.0
    avg.silent_s = lambda node: 0.0
    plan = Plan(clusters=[ClusterPlan(nodes=["c0"]), ClusterPlan(nodes=["c1"])])
    avg.plan = lambda: plan
    return avg


def _run(outer_lr: float, depth: int, correct: bool) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Returns the progress per step and cluster, and each cluster's weights after each applied round."""
    gen = torch.Generator().manual_seed(0)
    initial = torch.randn(NUMEL, generator=gen)
    progress = [torch.randn(CLUSTERS, NUMEL, generator=gen) for _ in range(STEPS)]
    weights = [initial.clone() for _ in range(CLUSTERS)]
    averagers = [_averager(outer_lr, initial) for _ in range(CLUSTERS)]
    queued: list[tuple[list[torch.Tensor], list[_Pending | None]]] = []
    after_round: list[list[torch.Tensor]] = []

    def apply_oldest() -> None:
        snapshots, pendings = queued.pop(0)
        average = torch.stack(snapshots).mean(0)  # what the ring computes
        for c in range(CLUSTERS):
            averagers[c]._apply({"w": weights[c]}, [SEGMENT], {0: snapshots[c]},
                                RoundResult(averaged={0: average.clone()}), pendings[c])
        after_round.append([w.clone() for w in weights])

    for step in range(STEPS):
        for c in range(CLUSTERS):
            weights[c] += progress[step][c]
        pendings: list[_Pending | None] = []
        for c in range(CLUSTERS):  # what Averager.on_update does on each cluster
            pending = _Pending(step) if correct else None
            if pending is not None:
                averagers[c]._pending.append(pending)
            pendings.append(pending)
        queued.append(([w.clone() for w in weights], pendings))
        if len(queued) > depth:
            apply_oldest()
    while queued:
        apply_oldest()
    assert not any(a._pending for a in averagers)
    return progress, after_round


def _intended(progress: list[torch.Tensor], outer_lr: float, depth: int, initial_seed: int = 0
              ) -> list[list[torch.Tensor]]:
    initial = torch.randn(NUMEL, generator=torch.Generator().manual_seed(initial_seed))
    point, out = initial, []
    for r in range(STEPS):
        point = point + outer_lr * progress[r].mean(0)
        applied_at = min(r + depth, STEPS - 1)  # the step after which round r is applied
        since = [sum((progress[t][c] for t in range(r + 1, applied_at + 1)), torch.zeros(NUMEL))
                 for c in range(CLUSTERS)]
        out.append([point + since[c] for c in range(CLUSTERS)])
    return out


@pytest.mark.parametrize("outer_lr", [1.0, 1.5])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_overlapped_rounds_reach_the_common_point_plus_local_progress(outer_lr: float, depth: int) -> None:
    progress, got = _run(outer_lr, depth, correct=True)
    want = _intended(progress, outer_lr, depth)
    for r, (g, w) in enumerate(zip(got, want)):
        for c in range(CLUSTERS):
            torch.testing.assert_close(g[c], w[c], rtol=0, atol=1e-5, msg=f"round {r} cluster {c}")


@pytest.mark.parametrize("outer_lr", [1.0, 1.5])
def test_without_the_correction_overlapped_rounds_overshoot(outer_lr: float) -> None:
    """The same schedule without ``_Pending`` bookkeeping (each round's delta taken from its own stale
    snapshot) misses the intended weights: the check above can fail."""
    depth = 2
    progress, got = _run(outer_lr, depth, correct=False)
    want = _intended(progress, outer_lr, depth)
    worst = max(float((g[c] - w[c]).abs().max()) for g, w in zip(got, want) for c in range(CLUSTERS))
    assert worst > 0.5


def test_two_overlapping_rounds_by_hand() -> None:
    """Clusters at 0 and 4, local steps +1 and -1; round 1 snapshots (0, 4), a step, round 2 snapshots
    (1, 3), a step to (2, 2), then both rounds apply.  Round 1 moves the clusters to 2 + progress since
    its snapshot: (4, 0).  Round 2 must leave them at 2 + progress since its own snapshot, (3, 1);
    without the correction it adds 2 - (1, 3) again and swaps them past each other to (5, -1)."""
    seg = Segment(ring_id=0, names=("w",), numel=1, ring=("c0", "c1"))
    for correct, want in ((True, (3.0, 1.0)), (False, (5.0, -1.0))):
        averagers = [_averager(1.0, torch.zeros(1)) for _ in range(2)]
        weights = [torch.tensor([0.0]), torch.tensor([4.0])]
        rounds = []
        for round_id in (1, 2):
            pendings = [_Pending(round_id) if correct else None for _ in range(2)]
            for a, p in zip(averagers, pendings):
                if p is not None:
                    a._pending.append(p)
            rounds.append(([w.clone() for w in weights], pendings))
            weights[0] += 1
            weights[1] -= 1
        for snapshots, pendings in rounds:
            average = (snapshots[0] + snapshots[1]) / 2
            for c in range(2):
                averagers[c]._apply({"w": weights[c]}, [seg], {0: snapshots[c]},
                                    RoundResult(averaged={0: average.clone()}), pendings[c])
        assert [float(w) for w in weights] == list(want), correct


class _Polls:
    """A held stage's ``should_abort``, which ``Averager._wait_round`` polls between waits of at most
    0.2 s for the round.  ``after(n, action)``: the n-th poll from now runs ``action`` (which may finish
    the round or silence a member) and, if it says so, the process gives up from then on.  The tests
    follow the stage's waits by these polls, never by a clock."""

    def __init__(self) -> None:
        self.count, self.aborted = 0, False
        self._then: dict[int, Callable[[], bool]] = {}

    def after(self, polls: int, action: Callable[[], bool]) -> None:
        self._then[self.count + polls] = action

    def __call__(self) -> bool:
        self.count += 1
        action = self._then.pop(self.count, None)
        self.aborted = self.aborted or (action is not None and action())
        return self.aborted


def _finish(done: concurrent.futures.Future[RoundResult]) -> Callable[[], bool]:
    """A poll action: the round ends (every cluster averaged to 0) and the process goes on."""
    def finish() -> bool:
        done.set_result(RoundResult(averaged={0: torch.zeros(NUMEL)}))
        return False
    return finish


def _held(lead: int, version: int, polls: _Polls, waits: list[str]) -> tuple[Averager, torch.Tensor,
                                                                             concurrent.futures.Future[RoundResult]]:
    """An averager whose stage is at ``version`` with one round pending, snapshotted at version 5 (the
    snapshot 1.0, the live weights 3.0: two local steps since), and that round's future."""
    avg = _averager(1.0, torch.zeros(NUMEL))
    avg.lead, avg.timeout_s, avg.me, avg.hold_backs, avg.held_s, avg.with_state = lead, 100.0, "c0", 0, 0.0, False
    live = torch.full((NUMEL,), 3.0)
    avg.worker = SimpleNamespace(version=version, before_weight_change=lambda: None,  # type: ignore[assignment]
                                 params={"w": live}, buffers={},
                                 should_abort=polls, waited=lambda reason, seconds: waits.append(reason))
    done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
    avg._pending.append(_Pending(1, 5, done, [SEGMENT], {0: torch.ones(NUMEL)}))
    return avg, live, done


def test_a_stage_waits_for_its_oldest_round_once_it_is_lead_steps_past_it() -> None:
    """``averaging_lead`` 2: a round snapshotted at version 5 does not hold the stage at version 6, and
    at version 7 the stage waits until the round finishes (here while it waits, as when the other cluster
    is behind) and applies it before training on."""
    polls, waits = _Polls(), []
    avg, live, done = _held(2, 6, polls, waits)
    avg._hold_back(avg.worker)
    assert avg._pending and avg.hold_backs == 0 and polls.count == 0  # one step past the snapshot: trains on
    avg.worker.version = 7
    polls.after(2, _finish(done))  # the round ends after the stage waited for it once
    avg._hold_back(avg.worker)
    assert polls.count >= 2 and avg.hold_backs == 1 and not avg._pending
    assert waits == ["averaging"]  # reported as waiting, not compute
    torch.testing.assert_close(live, torch.full((NUMEL,), 2.0))  # average 0 + local progress 2


def test_a_held_stage_lets_go_when_the_process_gives_up() -> None:
    """A forced stop must not wait out a ring's timeouts (here 100 s): the held compute thread returns
    at the first poll after ``should_abort`` says so, leaving the round unapplied."""
    polls, waits = _Polls(), []
    avg, live, _ = _held(1, 6, polls, waits)  # the round never ends
    polls.after(3, lambda: True)
    avg._hold_back(avg.worker)
    assert polls.aborted and not avg._pending and avg.hold_backs == 0
    torch.testing.assert_close(live, torch.full((NUMEL,), 3.0))  # nothing applied


def test_a_stage_stops_holding_back_once_a_ring_member_is_silent_and_applies_the_round_later() -> None:
    """A round whose member stopped sending heartbeats (gone, not yet declared lost) holds the stage only
    until that member has been silent for ``hold_s``, and not while it stays silent; it still applies when
    it ends.  A member that is merely behind (heartbeats arrive), or heard from again, is waited for."""
    polls, waits = _Polls(), []
    avg, live, done = _held(1, 6, polls, waits)
    avg.hold_s = 1.5
    silent = {"c1": 0.0}
    avg.silent_s = lambda node: silent[node]

    def stop_beating() -> bool:  # c1's heartbeats stop arriving
        silent["c1"] = 2.0
        return False

    polls.after(2, stop_beating)  # while the stage waits
    avg._hold_back(avg.worker)
    assert avg.hold_backs == 1 and len(avg._pending) == 1 and waits == ["averaging"]
    avg.worker.version = 7
    seen = polls.count
    avg._hold_back(avg.worker)  # still silent: not waited for
    assert polls.count == seen and avg.hold_backs == 1 and len(avg._pending) == 1 and waits == ["averaging"]
    silent["c1"] = 0.0  # heard from again (it was slow, not dead): waited for once more
    polls.after(2, _finish(done))
    avg._hold_back(avg.worker)
    assert polls.count >= seen + 2 and avg.hold_backs == 2 and not avg._pending
    torch.testing.assert_close(live, torch.full((NUMEL,), 2.0))
