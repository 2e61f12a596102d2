"""Which clusters average together in a round: groups every node derives alone, as it derives round ids.

In ``global`` mode every live cluster is in one group (one set of rings over all of them, as ravq has
always averaged).  In ``groups`` mode the live clusters sit on a grid of ``d`` axes of at most
``group_size`` places each (Moshpit averaging, arXiv 2103.03239): on round r the clusters that share every
coordinate but axis ``r mod d`` average together.  Averaging along every axis once, d rounds in a row,
leaves every cluster with the exact average of all C when the grid is full (C = M^d, or any C whose
factors fit: 12 clusters in groups of at most 4 are a 4 x 3 grid); otherwise some groups are smaller and
the average after d rounds is near, not exact.  A cluster alone in its group skips the round.

Which cluster sits where changes every ``d`` rounds (a cycle): a shuffle seeded by (plan epoch, cycle),
so over cycles every cluster meets every other.  Given ``rates`` (samples/s per cluster, the same on
every node: the plan's, never a node's own measurement), the places follow the rates instead, fastest
first, so the first axis groups clusters of like pace and a slow cluster holds back only the group it
is in on that round.

Everything here is pure (no torch, no sockets): the node, the simulator and the planner all call it, so
it sits in the planner's layer, below averaging (``ravq.average.groups`` re-exports it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

Mode = Literal["global", "groups"]


def groups_for(epoch: int, round_index: int, live_clusters: Iterable[int], mode: Mode, group_size: int,
               rates: Mapping[int, float] | None = None) -> list[tuple[int, ...]]:
    """The groups of round ``round_index`` of plan epoch ``epoch`` over ``live_clusters``: disjoint
    tuples of cluster indices, each sorted, together covering every live cluster once, in order of
    their first cluster.  Every node that passes the same arguments gets the same groups."""
    live = sorted(set(live_clusters))
    if mode == "global" or len(live) <= group_size:
        return [tuple(live)] if live else []
    if mode != "groups":
        raise ValueError(f"averaging.mode: expected 'global' or 'groups', got {mode!r}")
    if group_size < 2:
        raise ValueError(f"averaging.group_size: at least 2, got {group_size}")
    dims = grid_shape(len(live), group_size)
    axis = round_index % len(dims)
    places = _places(epoch, round_index // len(dims), live, rates)
    groups: dict[tuple[int, ...], list[int]] = {}
    for place, cluster in enumerate(places):
        coords = _coords(place, dims)
        groups.setdefault(coords[:axis] + coords[axis + 1:], []).append(cluster)
    return sorted(tuple(sorted(g)) for g in groups.values())


def group_of(cluster: int, groups: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The group holding ``cluster`` (a live cluster is in exactly one); () when it is in none."""
    return next((g for g in groups if cluster in g), ())


def grid_shape(count: int, group_size: int) -> list[int]:
    """The grid's axis lengths for ``count`` clusters in groups of at most ``group_size``: the fewest
    axes whose product is exactly ``count`` when its prime factors allow it (an exact average after one
    round per axis), else ``group_size`` on each of ceil(log_M count) axes (some places stay empty)."""
    if count <= group_size:
        return [count]
    factors = _prime_factors(count)
    if max(factors) <= group_size:
        axes: list[int] = []
        for p in sorted(factors, reverse=True):  # first fit, largest first
            fit = next((i for i, a in enumerate(axes) if a * p <= group_size), None)
            if fit is None:
                axes.append(p)
            else:
                axes[fit] *= p
        if len(axes) <= _uniform_axes(count, group_size):
            return sorted(axes, reverse=True)
    return [group_size] * _uniform_axes(count, group_size)


def _uniform_axes(count: int, group_size: int) -> int:
    d = max(1, math.ceil(math.log(count, group_size) - 1e-9))
    while group_size ** d < count:  # float log may land one short
        d += 1
    return d


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def _coords(place: int, dims: Sequence[int]) -> tuple[int, ...]:
    """Mixed-radix digits of ``place``, axis 0 fastest-varying (neighbouring places share axis 0's group)."""
    out = []
    for size in dims:
        place, digit = divmod(place, size)
        out.append(digit)
    return tuple(out)


def _places(epoch: int, cycle: int, live: list[int], rates: Mapping[int, float] | None) -> list[int]:
    """Clusters in place order: by rate (fastest first, ties by index) or shuffled for (epoch, cycle)."""
    if rates is not None:
        return sorted(live, key=lambda c: (-rates.get(c, 0.0), c))
    order = list(live)
    random.Random(f"ravq-groups:{epoch}:{cycle}").shuffle(order)  # a str seed hashes alike in every process
    return order


def rounds_to_mix(count: int, group_size: int) -> int:
    """Rounds after which every cluster's weights hold every other's (the grid's axes; 1 when global)."""
    return len(grid_shape(count, group_size)) if count > group_size else 1
