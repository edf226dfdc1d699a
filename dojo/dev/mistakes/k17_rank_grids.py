"""k17's mistakes catalogue: real mistakes in laying out a rank grid (positions, rows, columns),
making its groups and using them, and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises.

RankGrid entries are subclasses of the reference with one method done the way a learner might
(the catalogue swaps whole classes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k17_rank_grids as reference

_Reference = reference.RankGrid
check_grid_shape = reference.check_grid_shape


# --------------------------------------------------------------------------- the grid


def column_major_rows(world_size, data_parallel, tensor_parallel):
    # "rank = row + column * data_parallel": ranks counted down the columns first
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return [list(range(row, world_size, data_parallel)) for row in range(data_parallel)]


def columns_stride_data_parallel(world_size, data_parallel, tensor_parallel):
    # every data_parallel-th rank: the stride of the other dimension
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return [list(range(column, world_size, data_parallel)) for column in range(tensor_parallel)]


def position_divides_by_data_parallel(rank, world_size, data_parallel, tensor_parallel):
    # the grid's tensor-parallel size ignored: right only while the grid is square
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return rank // data_parallel, rank % data_parallel


def position_swapped(rank, world_size, data_parallel, tensor_parallel):
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return rank % tensor_parallel, rank // tensor_parallel  # (column, row)


def position_counts_from_one(rank, world_size, data_parallel, tensor_parallel):
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return rank // tensor_parallel + 1, rank % tensor_parallel + 1


def no_product_check(world_size, data_parallel, tensor_parallel):
    # sizes checked one by one, never against the world
    for size in (data_parallel, tensor_parallel):
        if size < 1:
            raise ValueError(f"sizes must be positive, got {size}")


def no_world_in_message(world_size, data_parallel, tensor_parallel):
    if data_parallel * tensor_parallel != world_size:
        raise ValueError("bad grid shape")


def rows_from_arange(world_size, data_parallel, tensor_parallel):
    """Right: torch draws the grid."""
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return torch.arange(world_size).view(data_parallel, tensor_parallel).tolist()


def columns_by_transposing(world_size, data_parallel, tensor_parallel):
    """Right: the columns are the rows, transposed."""
    rows = reference.grid_rows(world_size, data_parallel, tensor_parallel)
    return [list(column) for column in zip(*rows)]


def position_with_divmod(rank, world_size, data_parallel, tensor_parallel):
    """Right: one divmod."""
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    if rank not in range(world_size):
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    return divmod(rank, tensor_parallel)


# --------------------------------------------------------------------------- the groups


def _shape(grid):
    return grid.world_size, grid.data_parallel, grid.tensor_parallel


class OwnGroupsOnly(_Reference):
    def _make_groups(self):
        # "why make groups I am not in?"
        return dist.new_group(self.row_ranks), dist.new_group(self.column_ranks)


class OwnRowFirst(_Reference):
    def _make_groups(self):
        rows = reference.grid_rows(*_shape(self))
        columns = reference.grid_columns(*_shape(self))
        # "my own row first, then the others": every rank made them all, in its own order
        order = [self.row] + [r for r in range(len(rows)) if r != self.row]
        made = {r: dist.new_group(rows[r]) for r in order}
        return made[self.row], [dist.new_group(c) for c in columns][self.column]


class GroupsSwapped(_Reference):
    def _make_groups(self):
        rows = [dist.new_group(r) for r in reference.grid_rows(*_shape(self))]
        columns = [dist.new_group(c) for c in reference.grid_columns(*_shape(self))]
        return columns[self.column], rows[self.row]  # (data, tensor): the wrong way round


class FirstGroupKept(_Reference):
    def _make_groups(self):
        rows = [dist.new_group(r) for r in reference.grid_rows(*_shape(self))]
        columns = [dist.new_group(c) for c in reference.grid_columns(*_shape(self))]
        return rows[0], columns[0]


class ColumnsFirst(_Reference):
    """Right: the columns' groups first, then the rows': the same order on every rank."""

    def _make_groups(self):
        columns = [dist.new_group(c) for c in reference.grid_columns(*_shape(self))]
        rows = [dist.new_group(r) for r in reference.grid_rows(*_shape(self))]
        return rows[self.row], columns[self.column]


class WithNewSubgroups(_Reference):
    """Right: torch's helper, which makes every listed group on every rank."""

    def _make_groups(self):
        row, _ = dist.new_subgroups_by_enumeration(reference.grid_rows(*_shape(self)))
        column, _ = dist.new_subgroups_by_enumeration(reference.grid_columns(*_shape(self)))
        return row, column


# --------------------------------------------------------------------------- collectives


class RowOnTheWorld(_Reference):
    def sum_over_row(self, tensor):
        dist.all_reduce(tensor)  # no group=: the whole world


class RowOnTheColumn(_Reference):
    def sum_over_row(self, tensor):
        dist.all_reduce(tensor, group=self.data_group)


class AverageByWorldSize(_Reference):
    def average_over_column(self, tensor):
        dist.all_reduce(tensor, group=self.data_group)
        tensor /= dist.get_world_size()  # the world's size, not the column's


class AverageNotInPlace(_Reference):
    def average_over_column(self, tensor):
        dist.all_reduce(tensor, group=self.data_group)
        tensor = tensor / len(self.column_ranks)  # a new tensor: the caller's holds the sum


class AverageOnTheRow(_Reference):
    def average_over_column(self, tensor):
        dist.all_reduce(tensor, group=self.tensor_group)
        tensor /= len(self.row_ranks)


class DividesFirst(_Reference):
    """Right: every rank divides its own value first; the sum is then the mean."""

    def average_over_column(self, tensor):
        tensor.div_(dist.get_world_size(self.data_group))
        dist.all_reduce(tensor, group=self.data_group)


# --------------------------------------------------------------------------- the catalogue

_LAYOUT = "test_the_grid_is_laid_out_as_init_device_mesh_does"
_REFUSED = "test_a_shape_that_does_not_cover_the_world_is_refused"
_MADE = "test_every_rank_makes_every_group_in_the_same_order"
_COLUMN = "test_a_column_averages_over_its_own_members"

MISTAKES = [
    Mistake(
        "column_major_rows",
        replaces="grid_rows",
        fails=[f"{_LAYOUT}[6=2x3]", f"{_LAYOUT}[4=2x2]"],
        says=["column by column", "row by row (row-major"],
    ),
    Mistake(
        "columns_stride_data_parallel",
        replaces="grid_columns",
        fails=[f"{_LAYOUT}[{shape}]" for shape in ("4=1x4", "4=4x1", "6=2x3", "6=3x2")],
        says=["grid_columns(", "column j holds j, j + tensor_parallel"],
    ),
    Mistake(
        "position_divides_by_data_parallel",
        replaces="grid_position",
        fails=[f"{_LAYOUT}[{shape}]" for shape in ("4=1x4", "4=4x1", "6=2x3", "6=3x2")],
        says=["it divides by data_parallel", "rank // tensor_parallel"],
    ),
    Mistake(
        "position_swapped",
        replaces="grid_position",
        fails=[_LAYOUT],
        says=["it is (column, row)"],
    ),
    Mistake(
        "position_counts_from_one",
        replaces="grid_position",
        fails=[_LAYOUT],
        says=["it counts from 1", "numbered from 0"],
    ),
    Mistake(
        "no_product_check",
        replaces="check_grid_shape",
        fails=[_REFUSED],
        says=["data_parallel * tensor_parallel == world_size", "raise ValueError"],
    ),
    Mistake(
        "no_world_in_message",
        replaces="check_grid_shape",
        fails=[_REFUSED],
        says=["say what was wrong", "and the world size"],
    ),
    Mistake(
        "OwnGroupsOnly",
        replaces="RankGrid",
        fails=[_MADE],
        says=["only the groups it belongs to", "for EVERY group, members or not"],
    ),
    Mistake(
        "OwnRowFirst",
        replaces="RankGrid",
        fails=[f"{_MADE}[4=2x2]", f"{_MADE}[6=3x2]"],
        says=["the same groups in another order", "in the same order"],
    ),
    Mistake(
        "GroupsSwapped",
        replaces="RankGrid",
        fails=[_MADE, "test_the_groups_equal_init_device_mesh[6=3x2]"],
        says=["swapped", "tensor_group"],
    ),
    Mistake(
        "FirstGroupKept",
        replaces="RankGrid",
        fails=[_MADE],
        says=["expected the group made for its own", "keep the group of"],
    ),
    Mistake(
        "RowOnTheWorld",
        replaces="RankGrid",
        fails=["test_a_row_sums_over_its_own_members_only", "test_every_row_sums_at_once"],
        says=["group=self.tensor_group"],
    ),
    Mistake(
        "RowOnTheColumn",
        replaces="RankGrid",
        fails=["test_a_row_sums_over_its_own_members_only", "test_every_row_sums_at_once[6=3x2]"],
        says=["its column's group (self.data_group)", "pass group=self.tensor_group"],
    ),
    Mistake(
        "AverageByWorldSize",
        replaces="RankGrid",
        fails=[_COLUMN],
        says=["divided by the world size 6", "divide by the column's size"],
    ),
    Mistake(
        "AverageNotInPlace",
        replaces="RankGrid",
        fails=[_COLUMN],
        says=["nothing divided it in place", "tensor /= size"],
    ),
    Mistake(
        "AverageOnTheRow",
        replaces="RankGrid",
        fails=[_COLUMN],
        says=["on row group(s)", "group=self.data_group"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("rows_from_arange", replaces="grid_rows"),
    RightAnswer("columns_by_transposing", replaces="grid_columns"),
    RightAnswer("position_with_divmod", replaces="grid_position"),
    RightAnswer("ColumnsFirst", replaces="RankGrid", steps=(2,)),
    RightAnswer("WithNewSubgroups", replaces="RankGrid", steps=(2,)),
    RightAnswer("DividesFirst", replaces="RankGrid", steps=(3,)),
]
