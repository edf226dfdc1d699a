"""Process groups and the collectives recorded on them, in the specs' words (k20, k25, k28).

rank_group(rank, world_size, groups)  this rank's group among ``groups`` (None: the world), members
where(world_size, groups)             the world or its groups, in words for a message
which_group(used, given)              the group a recorded call used, named against the one given
kind(name)                            a recorded call's kind: all-gather, reduce-scatter or its name
"""

from __future__ import annotations

GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")


def rank_group(rank: int, world_size: int, groups):
    """``(group, members)``: the world (None) or this rank's row; every rank makes every group
    (``dist.new_group`` is a collective of the whole world)."""
    import torch.distributed as dist

    if groups is None:
        return None, list(range(world_size))
    made = [dist.new_group(ranks) for ranks in groups]
    index = next(i for i, ranks in enumerate(groups) if rank in ranks)
    return made[index], groups[index]


def where(world_size: int, groups) -> str:
    if groups is None:
        return f"on {world_size} ranks"
    return f"in the groups {groups[0]} and {groups[1]} of a world of {world_size}"


def which_group(used, given) -> str:
    """The group a recorded call ``used``, said against the one it was ``given`` (None is the
    world): "the group", "the whole world" or "another group"."""
    import torch.distributed as dist

    if used is given or (given is None and used is dist.group.WORLD):
        return "the group"
    if used is None or used is dist.group.WORLD:
        return "the whole world"
    return "another group"


def kind(name: str) -> str:
    """A recorded call's kind: any of torch's all-gathers is an "all-gather", any of its
    reduce-scatters a "reduce-scatter"; another call is its name ("all-reduce")."""
    if name in GATHERS:
        return "all-gather"
    if name in SCATTERS:
        return "reduce-scatter"
    return name.replace("_", "-")
