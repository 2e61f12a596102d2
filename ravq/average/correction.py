"""Applying a finished round to live weights that trained on meanwhile: the arithmetic, as pure functions.

A round averages snapshots; the stage adds (average - snapshot) to its live weights, keeping the progress
made since the snapshot.  With outer_lr a != 1 the segment moves to the common point
anchor + a * (average - anchor) instead, where the anchor is the previous common point (at first the
initial weights every cluster started from): ``outer_step``.

Rounds overlap training, so a round's snapshot may predate the deltas of earlier rounds applied while
it ran.  Those deltas are already in the live weights, so they are added to this round's snapshot
(``PendingRound.applied``) and their mean over the clusters to its average (``PendingRound.shift``, zero
unless outer_lr != 1): the round then does what it would have done had the earlier ones been applied at
once (``record_applied``, then ``correct``).  Without this every round pulls the clusters together again
by the same distance and, with frequent rounds, swaps them past each other instead of averaging them;
with outer_lr > 1 it would also undo the earlier rounds' extrapolation.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ravq.average.rounds import RoundResult
from ravq.average.segments import OPTIM_SEP, Segment, flatten


@dataclass(eq=False, slots=True)
class PendingRound:
    """A round snapshotted and not applied yet, with what rounds applied since did to this segment."""

    round_id: int
    version: int = 0
    """The stage's version at the snapshot."""
    done: concurrent.futures.Future[RoundResult] | None = None
    segments: list[Segment] = field(default_factory=list)
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)
    applied: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    """Segment names -> the sum of the deltas applied to this node's live weights since the snapshot."""
    shift: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    """Segment names -> the mean of those deltas over the clusters: the sum of (common point - average)
    of the rounds applied since; nonzero only with outer_lr != 1, and the same on every cluster."""
    waited: bool = False
    """The stage held back for it once and trained on: it is not waited for again."""
    extra: int = 0
    """Steps beyond ``averaging_lead`` the stage trains past the snapshot before holding back for it: a slow
    ring's span under pacing by link (``RoundGroups.extra_lead``)."""

    def overdue(self, version: int, lead: int) -> bool:
        """Whether a stage at ``version`` holds back for this round, with ``averaging_lead`` ``lead``."""
        return version - self.version >= lead + self.extra


def correct(pending: PendingRound, segments: list[Segment], snapshots: dict[int, torch.Tensor],
            result: RoundResult) -> None:
    """Bring a round's snapshot and average up to the rounds applied since it was taken."""
    for seg in segments:
        if seg.ring_id not in result.averaged:
            continue
        if (applied := pending.applied.get(seg.names)) is not None:
            snapshots[seg.ring_id] = snapshots[seg.ring_id] + applied
        if (shift := pending.shift.get(seg.names)) is not None:
            result.averaged[seg.ring_id] = result.averaged[seg.ring_id] + shift


def outer_step(segments: list[Segment], result: RoundResult, anchors: dict[tuple[str, ...], torch.Tensor],
               initial: Mapping[str, torch.Tensor], outer_lr: float) -> dict[int, torch.Tensor]:
    """Replace each finished segment's average in ``result`` by the common point
    anchor + outer_lr * (average - anchor) and keep that as the segment's next anchor.

    Returns ring_id -> the point's shift from the average, for the segments that had an anchor.  With
    outer_lr 1 the point is the average: nothing moves, and no anchor is kept."""
    shifts: dict[int, torch.Tensor] = {}
    if outer_lr == 1.0:
        return shifts
    for seg in segments:
        average = result.averaged.get(seg.ring_id)
        if average is None:
            continue
        anchor = anchors.get(seg.names)
        if anchor is None and all(n in initial for n in seg.names):
            anchor = flatten([initial[n] for n in seg.names])
        if anchor is not None:
            point = anchor + outer_lr * (average - anchor)
            shifts[seg.ring_id] = point - average
            result.averaged[seg.ring_id] = average = point
        anchors[seg.names] = average.clone()
    return shifts


def record_applied(later: Sequence[PendingRound], segments: list[Segment], deltas: Mapping[int, torch.Tensor],
                   shifts: Mapping[int, torch.Tensor]) -> None:
    """Note the deltas (and shifts) a round just applied in the rounds not applied yet: their snapshots
    do not hold them."""
    for seg in segments:
        if (delta := deltas.get(seg.ring_id)) is None:
            continue
        for pending in later:
            accumulate(pending.applied, seg.names, delta)
            if seg.ring_id in shifts:
                accumulate(pending.shift, seg.names, shifts[seg.ring_id])


def accumulate(sums: dict[tuple[str, ...], torch.Tensor], key: tuple[str, ...], value: torch.Tensor) -> None:
    held = sums.get(key)
    sums[key] = value.clone() if held is None else held + value


def keep_non_negative_state(named: dict[str, torch.Tensor], segments: list[Segment],
                             snapshots: dict[int, torch.Tensor], result: RoundResult) -> None:
    """Optimizer state that was nowhere negative here (Adam's second moments) stays so after a compressed
    average: the exact average of non-negative values is, but a compression error near zero need not be,
    and Adam takes its square root."""
    for seg in segments:
        if seg.ring_id not in result.averaged or not any(OPTIM_SEP in n for n in seg.names):
            continue
        offset = 0
        for name in seg.names:
            numel = named[name].numel()
            part = snapshots[seg.ring_id][offset:offset + numel]
            if OPTIM_SEP in name and numel and float(part.min()) >= 0:
                named[name].clamp_(min=0)
            offset += numel
