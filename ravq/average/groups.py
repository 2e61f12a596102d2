"""Which clusters average together in a round: ``ravq.planner.groups`` (the pure derivation lives in the
planner's layer, below averaging, because the planner scores plans by the groups they will average in)."""

from ravq.planner.groups import Mode, grid_shape, group_of, groups_for, rounds_to_mix

__all__ = ["Mode", "grid_shape", "group_of", "groups_for", "rounds_to_mix"]
