"""All-pairs (pairwise) combinations of on/off features, deterministic: every pair of features takes each
of its four value pairs (on/on, on/off, off/on, off/off) in at least one row, except pairs a constraint
forbids.  A greedy covering in the manner of AETG with its random orders made fixed: each candidate row
takes, feature by feature, the value that covers the most still uncovered pairs with the features already
set; the candidates start at each rotation of the feature order with the first feature on or off, and the
one covering most is kept.  The same features always give the same rows (13 on/off features: 10 rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import combinations

Row = dict[str, bool]
Allowed = Callable[[Row], bool]
"""Whether a row (complete or partial: only the features set so far) may exist."""

Pair = tuple[str, bool, str, bool]


def coverable_pairs(features: Sequence[str], allowed: Allowed) -> set[Pair]:
    """Every value pair of two features that some allowed row can hold."""
    values = (True, False)
    return {(a, va, b, vb) for a, b in combinations(features, 2) for va in values for vb in values
            if allowed({a: va, b: vb})}


def covered(row: Row, features: Sequence[str]) -> set[Pair]:
    return {(a, row[a], b, row[b]) for a, b in combinations(features, 2) if a in row and b in row}


def all_pairs(features: Sequence[str], allowed: Allowed = lambda _: True) -> list[Row]:
    """Rows that together hold every coverable pair; each row allowed.  Raises AssertionError if the
    constraint leaves a coverable pair that no greedy row can complete (a constraint on three features)."""
    todo = coverable_pairs(features, allowed)
    rows: list[Row] = []
    while todo:
        row = _next_row(features, allowed, todo)
        gained = covered(row, features) & todo
        assert gained, f"no allowed row covers any of {sorted(todo)[:3]}"
        todo -= gained
        rows.append(row)
    return rows


def _next_row(features: Sequence[str], allowed: Allowed, todo: set[Pair]) -> Row:
    best: tuple[int, Row] | None = None
    for start in range(len(features)):
        order = [*features[start:], *features[:start]]
        for first in (True, False):
            row = _greedy_row(order, allowed, todo, first)
            gain = len(covered(row, features) & todo)
            if best is None or gain > best[0]:
                best = (gain, row)
    assert best is not None
    return {name: best[1][name] for name in features}


def _greedy_row(order: Sequence[str], allowed: Allowed, todo: set[Pair], first: bool) -> Row:
    row: Row = {}
    for i, name in enumerate(order):
        gains = {}
        for value in ((first,) if i == 0 else (False, True)):
            trial = {**row, name: value}
            if allowed(trial):
                gains[value] = sum((f, trial[f], name, value) in todo or (name, value, f, trial[f]) in todo
                                   for f in row)
        assert gains, f"no value of {name} is allowed with {row}"
        row[name] = max(gains, key=lambda v: gains[v])  # a tie keeps the first: off
    return row
