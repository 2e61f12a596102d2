"""Group averaging's derivation (ravq.average.groups): pure, so every node derives the same groups."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ravq.average.groups import grid_shape, group_of, groups_for, rounds_to_mix


def mix(values: dict[int, np.ndarray], groups: list[tuple[int, ...]]) -> dict[int, np.ndarray]:
    """One round: every group's members take their group's mean (a group's rings, all segments)."""
    out = dict(values)
    for g in groups:
        mean = np.mean([values[c] for c in g], axis=0)
        out.update({c: mean for c in g})
    return out


def test_global_mode_is_one_group_of_every_live_cluster() -> None:
    assert groups_for(3, 7, [4, 0, 2], "global", 2) == [(0, 2, 4)]
    assert groups_for(3, 7, [1, 0], "groups", 2) == [(0, 1)]  # no more clusters than a group holds


@pytest.mark.parametrize(("count", "size", "shape"), [(8, 2, [2, 2, 2]), (16, 4, [4, 4]), (12, 4, [4, 3]),
                                                      (6, 2, [2, 2, 2]), (5, 2, [2, 2, 2]), (9, 3, [3, 3])])
def test_grid_shape(count: int, size: int, shape: list[int]) -> None:
    assert grid_shape(count, size) == shape
    assert rounds_to_mix(count, size) == len(shape)


@pytest.mark.parametrize(("count", "size"), [(4, 2), (8, 2), (9, 3), (12, 4), (16, 4)])
def test_grid_reaches_the_exact_average_in_d_rounds(count: int, size: int) -> None:
    rng = np.random.default_rng(count)
    values = {c: rng.normal(size=5) for c in range(count)}
    target = np.mean(list(values.values()), axis=0)
    d = rounds_to_mix(count, size)
    for r in range(d, 2 * d):  # the second cycle: another shuffle, the same property
        groups = groups_for(5, r, range(count), "groups", size)
        assert all(len(g) <= size for g in groups)
        assert sorted(c for g in groups for c in g) == list(range(count))
        values = mix(values, groups)
    assert all(np.allclose(v, target, atol=1e-12) for v in values.values())


def test_cycles_reshuffle_so_clusters_meet_new_partners() -> None:
    first = groups_for(1, 0, range(8), "groups", 2)
    later = {tuple(groups_for(1, 3 * k, range(8), "groups", 2)) for k in range(6)}
    assert len(later) > 1 and tuple(first) in later
    assert len({tuple(groups_for(e, 0, range(8), "groups", 2)) for e in range(6)}) > 1  # and every epoch


def test_every_process_derives_the_same_groups() -> None:
    """A fresh interpreter (another hash seed) derives what this one does."""
    code = ("from ravq.average.groups import groups_for; "
            "print([groups_for(e, r, range(11), 'groups', 3) for e in (0, 9) for r in range(6)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == str([groups_for(e, r, range(11), "groups", 3) for e in (0, 9) for r in range(6)])


def test_a_dropped_cluster_changes_only_its_own_group_on_a_fixed_grid() -> None:
    """Rate-ordered places: removing a cluster leaves every group without it as it was on the round's
    first axis (neighbours by rate), and the dropped cluster's old partners regroup among themselves."""
    rates = {c: 100.0 - c for c in range(8)}
    before = groups_for(4, 0, range(8), "groups", 2, rates)
    after = groups_for(4, 0, [c for c in range(8) if c != 7], "groups", 2, rates)
    assert before == [(0, 1), (2, 3), (4, 5), (6, 7)]
    untouched = [g for g in before if 7 not in g]
    assert all(g in after for g in untouched)
    assert group_of(6, after) == (6,)


def test_rates_put_clusters_of_like_pace_together() -> None:
    rates = {0: 10.0, 1: 100.0, 2: 11.0, 3: 98.0}
    assert groups_for(0, 0, range(4), "groups", 2, rates) == [(0, 2), (1, 3)]
    assert groups_for(0, 1, range(4), "groups", 2, rates) == [(0, 3), (1, 2)]  # the mixing axis


def test_bad_mode_and_group_size_are_named() -> None:
    with pytest.raises(ValueError, match="averaging.mode"):
        groups_for(0, 0, range(4), "gossip", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="averaging.group_size"):
        groups_for(0, 0, range(4), "groups", 1)
