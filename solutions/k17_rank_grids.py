"""k17 · Rank grids: data parallel x tensor parallel, one process group per row and per column.

THE IDEA
    Part IV spreads one model over several ranks (tensor parallelism, k20) and trains several
    copies of it on different data (data parallelism, Parts I-III) at the same time. The world
    becomes a grid: ``data_parallel`` rows times ``tensor_parallel`` columns, their product the
    world size. The ranks of one row hold the pieces of ONE copy of the model and talk all the
    time (every layer's all-reduce); the ranks of one column hold the same piece of different
    copies and talk once a step (the gradients' average).

        world size 6, shape (data_parallel, tensor_parallel) = (2, 3):

                        tp 0   tp 1   tp 2
            dp 0 (row)    0      1      2      row 0 = tensor-parallel group [0, 1, 2]
            dp 1 (row)    3      4      5      row 1 = tensor-parallel group [3, 4, 5]

            columns (data-parallel groups): [0, 3]  [1, 4]  [2, 5]

    Ranks are laid out row by row (row-major), exactly as ``torch.arange(world).view(dp, tp)``
    and as torch's ``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))`` does: a
    row holds consecutive ranks, so the chatty tensor-parallel group sits on one machine (ranks
    0-7 of a node with 8 GPUs, as Megatron-LM places them), and only the data-parallel traffic
    crosses machines. Rank ``r`` sits in row ``r // tp`` and column ``r % tp``.

    A collective on a subgroup involves only its members: each row's all-reduce runs on its own,
    side by side with the other rows', and a rank outside a group never calls it. But MAKING a
    group is different: ``dist.new_group(ranks)`` must be called by EVERY rank of the world, for
    every group, in the same order, members or not, because each call takes the next group
    number on every rank, and the group's members meet under that number. A rank that makes only
    its own groups, or makes them in another order, pairs its groups with the wrong ones
    elsewhere: its first collective waits for ever (torch 2.14 with gloo simply hangs, with no
    error). (``new_group(..., use_local_synchronization=True)`` lifts the rule on recent torch;
    the portable habit, and what ``init_device_mesh`` does, is every group on every rank.)

        every rank, in the same order:  new_group([0, 1, 2]), new_group([3, 4, 5]),
                                        new_group([0, 3]), new_group([1, 4]), new_group([2, 5])
        rank 4 keeps:                   tensor_group = [3, 4, 5], data_group = [1, 4]

STEPS
    1. ``check_grid_shape``, ``grid_position``, ``grid_rows``, ``grid_columns``: a shape whose
       product is not the world size is a ``ValueError`` saying so; a rank's (row, column),
       every row's ranks and every column's ranks.
    2. ``RankGrid._make_groups``: every row's and every column's group made with
       ``dist.new_group`` by every rank, in the same order; returns this rank's (row group,
       column group).
    3. ``RankGrid.sum_over_row`` and ``RankGrid.average_over_column``: an all-reduce inside
       this rank's row (a sum, as tensor parallelism needs) and inside its column (a mean, as
       data parallelism needs), in place.

WHAT THE TESTS CHECK
    The positions, rows and columns of 4 and 6 ranks in every shape (2x2, 1x4, 4x1, 2x3, 3x2)
    against ``torch.arange(world).view(dp, tp)``, and a ``ValueError`` for shapes whose product
    is not the world size; by recording every rank's ``new_group`` calls (a stand-in makes no
    real group, so nothing can hang): every rank makes every row and column group, once each,
    in the same order, and keeps its own row and column; on real groups, on 4 and 6 ranks, that
    ``dist.get_process_group_ranks`` of each group equals ``init_device_mesh``'s "tp" and "dp"
    groups; by recording which group each all-reduce used: a row sums over its members only
    (while the other row does nothing at all, and is left unchanged), a column averages over
    its size; and the program.

RUN IT
    .venv/bin/python -m katas.k17_rank_grids --world-size 6 --data-parallel 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world


def check_grid_shape(world_size: int, data_parallel: int, tensor_parallel: int) -> None:
    """A grid's shape must cover the world exactly: a ValueError saying what is wrong otherwise."""
    # BEGIN STEP 1: the grid: a rank's row and column, every row and every column
    # TODO: nothing when data_parallel x tensor_parallel covers the world exactly; otherwise a
    # ValueError that names the shape and the world size and says what to do (sizes whose product is
    # the world size). A size that is not a positive whole number is a ValueError too. The tests try
    # 3 x 2 and 4 x 4 on 4 ranks, 2 x 2 on 6 and on 8, through the three functions below.
    sizes = {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive whole number of ranks, got {size!r}")
    if data_parallel * tensor_parallel != world_size:
        raise ValueError(
            f"a {data_parallel} x {tensor_parallel} grid (data_parallel x tensor_parallel) holds "
            f"{data_parallel * tensor_parallel} ranks, but the world has {world_size}: choose "
            "sizes whose product is the world size"
        )
    # END STEP 1


def grid_position(
    rank: int, world_size: int, data_parallel: int, tensor_parallel: int
) -> tuple[int, int]:
    """``(row, column)`` of ``rank`` in the ``data_parallel x tensor_parallel`` grid of the world.

    The row is the rank's data-parallel index (which copy of the model), the column its
    tensor-parallel index (which piece of it); ranks fill the grid row by row.
    """
    # BEGIN STEP 1: the grid: a rank's row and column, every row and every column
    # TODO: (row, column) of rank, the ranks laid out row by row as
    # torch.arange(world_size).view(data_parallel, tensor_parallel) (and init_device_mesh) lays them
    # out; a bad shape (check_grid_shape) or a rank outside the world is a ValueError. The tests try
    # every rank of 2x2, 1x4, 4x1, 2x3 and 3x2 grids, and ranks 4 and -1 of a world of 4.
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} is not in a world of {world_size} ranks (0..{world_size - 1})"
        )
    return rank // tensor_parallel, rank % tensor_parallel
    # END STEP 1


def grid_rows(world_size: int, data_parallel: int, tensor_parallel: int) -> list[list[int]]:
    """Every row's ranks, row 0 first: the tensor-parallel groups (``data_parallel`` of them)."""
    # BEGIN STEP 1: the grid: a rank's row and column, every row and every column
    # TODO: every row's ranks as lists, row 0 first: data_parallel lists of tensor_parallel ranks
    # each, equal to torch.arange(world_size).view(data_parallel, tensor_parallel).tolist(); a bad
    # shape is a ValueError (check_grid_shape). Tested on 2x2, 1x4, 4x1, 2x3 and 3x2 grids.
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return [
        list(range(row * tensor_parallel, (row + 1) * tensor_parallel))
        for row in range(data_parallel)
    ]
    # END STEP 1


def grid_columns(world_size: int, data_parallel: int, tensor_parallel: int) -> list[list[int]]:
    """Every column's ranks, column 0 first: the data-parallel groups (``tensor_parallel``)."""
    # BEGIN STEP 1: the grid: a rank's row and column, every row and every column
    # TODO: every column's ranks as lists, column 0 first: tensor_parallel lists of data_parallel
    # ranks each, the columns of torch.arange(world_size).view(data_parallel, tensor_parallel); a
    # bad shape is a ValueError (check_grid_shape). Tested on the same grids.
    check_grid_shape(world_size, data_parallel, tensor_parallel)
    return [list(range(column, world_size, tensor_parallel)) for column in range(tensor_parallel)]
    # END STEP 1


class RankGrid:
    """This rank's place in a ``data_parallel x tensor_parallel`` grid of the world, and its groups.

    ``RankGrid(data_parallel, tensor_parallel)``, called by every rank of an initialised world
    (rank and size come from ``torch.distributed``): ``.row``, ``.column``, ``.row_ranks``,
    ``.column_ranks``, ``.tensor_group`` (this rank's row) and ``.data_group`` (its column).
    """

    def __init__(self, data_parallel: int, tensor_parallel: int):
        self.data_parallel, self.tensor_parallel = data_parallel, tensor_parallel
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.row, self.column = grid_position(
            self.rank, self.world_size, data_parallel, tensor_parallel
        )
        self.row_ranks = grid_rows(self.world_size, data_parallel, tensor_parallel)[self.row]
        self.column_ranks = grid_columns(self.world_size, data_parallel, tensor_parallel)[
            self.column
        ]
        self.tensor_group, self.data_group = self._make_groups()

    def _make_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Every row's and column's group, made by every rank in the same order; this rank's two."""
        # BEGIN STEP 2: the groups: every row and every column, made by every rank in the same order
        # TODO: (the group of this rank's row, the group of its column), made with dist.new_group.
        # Every rank of the world takes part in making every row's and every column's group, members
        # or not, in the same order on every rank, each group once. The tests replace new_group by a
        # recorder (no real group, so nothing can hang) and compare every rank's calls, in 2x2, 2x3
        # and 3x2 grids; then, with real groups, dist.get_process_group_ranks of both groups on
        # every rank against init_device_mesh's "tp" and "dp" groups, in 2x2, 1x4, 4x1, 2x3 and 3x2
        # grids.
        shape = (self.world_size, self.data_parallel, self.tensor_parallel)
        rows = [dist.new_group(ranks) for ranks in grid_rows(*shape)]  # all of them, everywhere
        columns = [dist.new_group(ranks) for ranks in grid_columns(*shape)]
        return rows[self.row], columns[self.column]
        # END STEP 2

    def sum_over_row(self, tensor: torch.Tensor) -> None:
        """In place: the sum of ``tensor`` over this rank's row (its tensor-parallel group)."""
        # BEGIN STEP 3: collectives inside a row and inside a column
        # TODO: in place, tensor becomes the sum of its values over this rank's row (the
        # tensor-parallel group), and only the row's ranks take part. The tests record which group
        # each call used: one all-reduce, on the row's group; in a 2x3 grid row 0 sums while row 1
        # calls nothing (and must not be waited for); every row at once in 3x2 and 1x4 grids.
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.tensor_group)
        # END STEP 3

    def average_over_column(self, tensor: torch.Tensor) -> None:
        """In place: the mean of ``tensor`` over this rank's column (its data-parallel group)."""
        # BEGIN STEP 3: collectives inside a row and inside a column
        # TODO: in place, tensor becomes the mean of its values over this rank's column (the
        # data-parallel group), only the column's ranks taking part. The tests record which group
        # each all-reduce used and compare the result with the column's mean (to a few ulps) in 3x2
        # and 2x3 grids of 6 ranks, where the world's size and the column's differ.
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.data_group)
        tensor /= len(self.column_ranks)  # SUM, then divide: ReduceOp.AVG is not on every backend
        # END STEP 3


# --------------------------------------------------------------------------- the program


def show_grid(rank: int, world_size: int, data_parallel: int) -> dict:
    """Build the grid; sum each rank's number over its row and average it over its column."""
    grid = RankGrid(data_parallel, world_size // data_parallel)
    device = rank_device()
    row_sum = torch.tensor([float(rank)], device=device)
    grid.sum_over_row(row_sum)
    column_mean = torch.tensor([float(rank)], device=device)
    grid.average_over_column(column_mean)
    return {
        "position": (grid.row, grid.column),
        "row": list(dist.get_process_group_ranks(grid.tensor_group)),
        "column": list(dist.get_process_group_ranks(grid.data_group)),
        "row_sum": row_sum.item(),
        "column_mean": column_mean.item(),
    }


def picture(world_size: int, data_parallel: int) -> list[str]:
    """The grid as text: one line per row of rank numbers (pure: no world needed)."""
    tensor_parallel = world_size // data_parallel
    lines = [" " * 13 + "".join(f"{f'tp {c}':>7}" for c in range(tensor_parallel))]
    for row, ranks in enumerate(grid_rows(world_size, data_parallel, tensor_parallel)):
        cells = "".join(f"{r:>7}" for r in ranks)
        lines.append(f"  dp {row:<3} row {cells}    tensor-parallel group {ranks}")
    columns = grid_columns(world_size, data_parallel, tensor_parallel)
    lines.append("  columns (data-parallel groups): " + "  ".join(str(c) for c in columns))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="A data-parallel x tensor-parallel grid of ranks, a group per row and column."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument(
        "--data-parallel",
        type=int,
        default=2,
        help="rows of the grid (copies of the model); tensor parallel = world size / this",
    )
    args = parser.parse_args(argv)
    if args.data_parallel < 1 or args.world_size % args.data_parallel:
        parser.error(
            f"--data-parallel {args.data_parallel} does not divide --world-size {args.world_size}"
        )
    tensor_parallel = args.world_size // args.data_parallel
    drawn = picture(args.world_size, args.data_parallel)
    say(
        None,
        f"{args.world_size} ranks as {args.data_parallel} (data parallel) x {tensor_parallel} "
        "(tensor parallel), row by row as init_device_mesh lays them out:",
    )
    for line in drawn:
        say(None, line)
    results = launch_world(
        show_grid, args.world_size, args.data_parallel, backend=args.backend, device=args.device
    )
    for rank, got in enumerate(results):
        row, column = got["position"]
        say(
            rank,
            f"row {row}, column {column}: sum_over_row(rank) = {got['row_sum']:g} (ranks "
            f"{got['row']}), average_over_column(rank) = {got['column_mean']:g} (ranks "
            f"{got['column']})",
        )
    rows = grid_rows(args.world_size, args.data_parallel, tensor_parallel)
    right = all(
        got["row_sum"] == sum(rows[got["position"][0]]) and got["row"] == rows[got["position"][0]]
        for got in results
    )
    say(None, "each row summed its own ranks only" if right else "a row's sum is wrong")
    return 0 if right else 1


if __name__ == "__main__":
    run_program(main)
