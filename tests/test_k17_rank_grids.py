"""k17 rank grids: positions, rows and columns; the groups, made everywhere; collectives inside them."""

from __future__ import annotations

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import refusal, run_module_ok
from dojo.todo import KataTodo

KATA = "k17_rank_grids"

# (world size, data_parallel, tensor_parallel): every shape of 4 ranks, and both of 6.
SHAPES = [(4, 2, 2), (4, 1, 4), (4, 4, 1), (6, 2, 3), (6, 3, 2)]
SHAPE_IDS = [f"{w}={d}x{t}" for w, d, t in SHAPES]


def _torch_layout(world_size: int, data_parallel: int, tensor_parallel: int):
    """What init_device_mesh("cpu", (dp, tp), ...) does: arange(world).view(dp, tp)."""
    mesh = torch.arange(world_size).view(data_parallel, tensor_parallel)
    return mesh.tolist(), mesh.t().tolist()


def _shape_text(world_size: int, data_parallel: int, tensor_parallel: int) -> str:
    return (
        f"world_size={world_size}, data_parallel={data_parallel}, tensor_parallel={tensor_parallel}"
    )


def _call(what: str, function, *args):
    try:
        return function(*args)
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(f"{what} raised {type(error).__name__}: {error}") from None


# --------------------------------------------------------------------------- step 1: the grid


def _layout_mistake(got: list, rows: list, columns: list, what: str) -> str:
    """Why ``got`` (the learner's rows or columns) is wrong, where a usual mistake explains it."""
    other = columns if what == "rows" else rows
    data_parallel, tensor_parallel = len(rows), len(columns)
    world_size = data_parallel * tensor_parallel
    column_major = (
        [list(range(i, world_size, data_parallel)) for i in range(data_parallel)]
        if what == "rows"
        else [
            list(range(j * data_parallel, (j + 1) * data_parallel)) for j in range(tensor_parallel)
        ]
    )
    if got == column_major:
        return (
            "it lays the ranks out column by column (rank = row + column * data_parallel): the "
            "ranks fill the grid row by row (row-major, as init_device_mesh and "
            "arange(world).view(dp, tp) do), so a row holds tensor_parallel consecutive ranks"
        )
    if got == other:
        return (
            f"its {what} are the grid's {'columns' if what == 'rows' else 'rows'}: the ranks fill "
            "the grid row by row (row-major, as init_device_mesh and arange(world).view(dp, tp) "
            "do), so a row holds tensor_parallel consecutive ranks and a column every "
            "tensor_parallel-th rank"
        )
    if what == "rows" and len(got) != len(rows):
        return (
            f"it made {len(got)} rows, the grid has data_parallel = {len(rows)}: each row holds "
            f"tensor_parallel = {len(rows[0])} ranks"
        )
    if what == "columns" and len(got) != len(columns):
        return (
            f"it made {len(got)} columns, the grid has tensor_parallel = {len(columns)}: each "
            f"column holds data_parallel = {len(columns[0])} ranks"
        )
    return (
        "row i holds ranks i * tensor_parallel .. (i + 1) * tensor_parallel - 1; column j holds "
        "j, j + tensor_parallel, j + 2 * tensor_parallel, ..."
    )


# What the usual mistakes return for (rank, data_parallel, tensor_parallel), in the order they
# are told apart. On some shapes two of them agree (on a 1 x 4 grid (column, row) is
# (rank // 1, rank % 1)): a second shape, where they differ, decides.
_FROM_ONE = "it counts from 1: rows and columns are numbered from 0, like ranks"
_POSITION_MISTAKES = [
    ("it is (column, row): return (row, column)", lambda r, d, t: (r % t, r // t)),
    (
        "it divides by data_parallel: a row holds tensor_parallel ranks, so the row is "
        "rank // tensor_parallel and the column rank % tensor_parallel",
        lambda r, d, t: (r // d, r % d),
    ),
    (_FROM_ONE, lambda r, d, t: (r // t + 1, r % t + 1)),
    (_FROM_ONE, lambda r, d, t: (r // t + 1, r % t)),
    (_FROM_ONE, lambda r, d, t: (r // t, r % t + 1)),
]
_DECIDING_SHAPES = [(6, 2, 3), (6, 3, 2)]  # no two of the mistakes agree on these


def _positions(kata, world_size, data_parallel, tensor_parallel):
    """Every rank's grid_position on a shape, or None where it raised."""
    try:
        return [
            tuple(int(x) for x in kata.grid_position(r, world_size, data_parallel, tensor_parallel))
            for r in range(world_size)
        ]
    except KataTodo:
        raise
    except Exception:
        return None


def _position_mistake(kata, got: list, shape) -> str:
    """Why grid_position's answers ``got`` (every rank's, on ``shape``) are wrong."""
    world_size, data_parallel, tensor_parallel = shape
    for why, mistake in _POSITION_MISTAKES:
        if got != [mistake(r, data_parallel, tensor_parallel) for r in range(world_size)]:
            continue
        if all(
            _positions(kata, *other) == [mistake(r, *other[1:]) for r in range(other[0])]
            for other in _DECIDING_SHAPES
        ):
            return why
    return "the row is rank // tensor_parallel and the column rank % tensor_parallel"


@pytest.mark.step(1)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_the_grid_is_laid_out_as_init_device_mesh_does(kata, shape):
    world_size, data_parallel, tensor_parallel = shape
    rows, columns = _torch_layout(*shape)
    where = _shape_text(*shape)
    got_rows = _call(f"grid_rows({where})", kata.grid_rows, *shape)
    got_rows = [list(map(int, row)) for row in got_rows]
    assert got_rows == rows, (
        f"grid_rows({where}) returned {got_rows}, expected {rows} "
        f"(torch.arange({world_size}).view({data_parallel}, {tensor_parallel})): "
        + _layout_mistake(got_rows, rows, columns, "rows")
    )
    got_columns = _call(f"grid_columns({where})", kata.grid_columns, *shape)
    got_columns = [list(map(int, column)) for column in got_columns]
    assert got_columns == columns, (
        f"grid_columns({where}) returned {got_columns}, expected {columns} (the columns of "
        f"torch.arange({world_size}).view({data_parallel}, {tensor_parallel})): "
        + _layout_mistake(got_columns, rows, columns, "columns")
    )
    got = [
        tuple(int(x) for x in _call(f"grid_position({r}, {where})", kata.grid_position, r, *shape))
        for r in range(world_size)
    ]
    for rank in range(world_size):
        expected = (rank // tensor_parallel, rank % tensor_parallel)
        assert got[rank] == expected, (
            f"grid_position({rank}, {where}) returned {got[rank]}, expected (row, column) = "
            f"{expected}: " + _position_mistake(kata, got, shape)
        )


REFUSED = [
    # (world size, data_parallel, tensor_parallel): products that are not the world size
    (4, 3, 2),
    (6, 2, 2),
    (4, 4, 4),
    (8, 2, 2),
]


@pytest.mark.step(1)
@pytest.mark.parametrize("shape", REFUSED, ids=[f"{w}={d}x{t}" for w, d, t in REFUSED])
def test_a_shape_that_does_not_cover_the_world_is_refused(kata, shape):
    world_size, data_parallel, tensor_parallel = shape
    where = _shape_text(*shape)
    for name, call in (
        ("grid_rows", lambda: kata.grid_rows(*shape)),
        ("grid_columns", lambda: kata.grid_columns(*shape)),
        ("grid_position", lambda: kata.grid_position(0, *shape)),
    ):
        did = refusal(call)
        assert did is None, (
            f"{name}({'0, ' if name == 'grid_position' else ''}{where}) {did}: a "
            f"{data_parallel} x {tensor_parallel} grid holds {data_parallel * tensor_parallel} "
            f"ranks, not the world's {world_size}. Check that data_parallel * tensor_parallel == "
            "world_size and raise ValueError saying so"
        )
        try:
            call()
        except ValueError as error:
            assert str(world_size) in str(error) and str(data_parallel) in str(error), (
                f"{name}({where}) raised ValueError({str(error)!r}): say what was wrong, naming "
                f"the shape {data_parallel} x {tensor_parallel} and the world size {world_size}"
            )


@pytest.mark.step(1)
def test_a_rank_outside_the_world_is_refused(kata):
    for rank in (4, -1):
        did = refusal(lambda rank=rank: kata.grid_position(rank, 4, 2, 2))
        assert did is None, (
            f"grid_position({rank}, world_size=4, data_parallel=2, tensor_parallel=2) {did}: "
            f"rank {rank} is not in a world of 4 ranks (0..3); raise ValueError saying so"
        )


# --------------------------------------------------------------------------- step 2: the groups


class _Recorded:
    """What a stand-in ``new_group`` returns: which call made it, and for which ranks."""

    def __init__(self, number: int, ranks):
        self.number, self.ranks = number, ranks


def _spy_groups(rank, world_size, data_parallel, tensor_parallel):
    """RankGrid with ``new_group`` replaced by a recorder that makes no group (nothing can hang)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    kata = load_kata(KATA)
    made = []

    def new_group(ranks=None, *args, **kwargs):
        made.append(None if ranks is None else [int(r) for r in ranks])
        return _Recorded(len(made) - 1, made[-1])

    originals = (dist.new_group, c10d.new_group, getattr(kata, "new_group", None))
    dist.new_group = c10d.new_group = new_group
    if originals[2] is not None:  # `from torch.distributed import new_group` in the kata
        kata.new_group = new_group
    try:
        grid = kata.RankGrid(data_parallel, tensor_parallel)
    except KataTodo:
        raise
    except Exception as error:
        return {"failure": f"{type(error).__name__}: {str(error).strip()[:300]}", "made": made}
    finally:
        dist.new_group, c10d.new_group = originals[:2]
        if originals[2] is not None:
            kata.new_group = originals[2]

    def kept(group):
        if isinstance(group, _Recorded):
            return {"number": group.number, "ranks": group.ranks}
        if group is None or group is dist.group.WORLD:
            return {"number": None, "ranks": "the whole world (not a group of new_group)"}
        return {"number": None, "ranks": f"{type(group).__name__} (not a group of new_group)"}

    return {
        "failure": None,
        "made": made,
        "tensor_group": kept(grid.tensor_group),
        "data_group": kept(grid.data_group),
    }


def _describe_calls(made: list) -> str:
    return ", ".join(f"new_group({ranks})" for ranks in made) or "no new_group at all"


def check_groups_made(shape, results) -> None:
    world_size, data_parallel, tensor_parallel = shape
    rows, columns = _torch_layout(*shape)
    where = f"RankGrid({data_parallel}, {tensor_parallel}) on {world_size} ranks"
    for rank, got in enumerate(results):
        if got["failure"]:
            raise AssertionError(f"rank {rank}: {where} raised {got['failure']}")
    first = results[0]["made"]
    for rank, got in enumerate(results):
        if got["made"] == first:
            continue
        mine = [r for r in got["made"] if r is not None and rank in r]
        if all(r is not None and rank in r for r in got["made"]) and got["made"]:
            raise AssertionError(
                f"rank {rank} called {_describe_calls(got['made'])}: only the groups it belongs "
                f"to, while rank 0 called {_describe_calls(first)}. dist.new_group is collective: "
                "every rank of the world must call it for EVERY group, members or not, in the "
                "same order (each call takes the next group number on every rank, and members "
                "meet under that number). A rank that makes only its own groups pairs them "
                "with the wrong ones elsewhere, and its first collective hangs: make every row's "
                "and column's group on every rank, keeping the two this rank belongs to"
            )
        if sorted(got["made"], key=str) == sorted(first, key=str):
            raise AssertionError(
                f"rank {rank} called {_describe_calls(got['made'])}, rank 0 "
                f"{_describe_calls(first)}: the same groups in another order. Every rank must "
                "make the groups in the same order (rows in row order, then columns in column "
                "order, say), whatever its own row: the n-th new_group call on one rank is the "
                "n-th on every rank, so a rank-dependent order pairs different groups and the "
                "first collective hangs"
            )
        raise AssertionError(
            f"rank {rank} called {_describe_calls(got['made'])}, rank 0 {_describe_calls(first)} "
            f"(mine: {mine}): every rank must make the same groups in the same order"
        )
    expected = rows + columns
    made = first
    missing = [g for g in expected if g not in made]
    extra = [g for g in made if g not in expected]
    twice = [g for g in expected if made.count(g) > 1]
    assert not missing and not extra and not twice, (
        f"{where} made {_describe_calls(made)}; expected each row {rows} and each column "
        f"{columns} once"
        + (f"; missing {missing}" if missing else "")
        + (f"; {extra} is neither a row nor a column" if extra else "")
        + (f"; {twice} twice" if twice else "")
        + (
            ": a row is a tensor-parallel group (consecutive ranks), a column a data-parallel "
            "group. Make both kinds, every one of them, on every rank"
        )
    )
    for rank, got in enumerate(results):
        row, column = rows[rank // tensor_parallel], columns[rank % tensor_parallel]
        tensor, data = got["tensor_group"]["ranks"], got["data_group"]["ranks"]
        if (tensor, data) == (column, row) and row != column:
            raise AssertionError(
                f"rank {rank}'s tensor_group is {tensor} and its data_group {data}: swapped. The "
                f"tensor-parallel group is this rank's row {row} (the ranks holding pieces of one "
                f"model), the data-parallel group its column {column}"
            )
        assert tensor == row, (
            f"rank {rank}'s tensor_group is {tensor}, expected the group made for its own row "
            f"{row}: keep the group of row self.row (the n-th row's group, not the first, not "
            "the last made)"
        )
        assert data == column, (
            f"rank {rank}'s data_group is {data}, expected the group made for its own column "
            f"{column}: keep the group of column self.column"
        )


SPY_SHAPES = [(4, 2, 2), (6, 2, 3), (6, 3, 2)]


@pytest.mark.step(2)
@pytest.mark.parametrize("shape", SPY_SHAPES, ids=[f"{w}={d}x{t}" for w, d, t in SPY_SHAPES])
def test_every_rank_makes_every_group_in_the_same_order(kata, shape):
    results = run_world(_spy_groups, shape[0], *shape[1:])
    check_groups_made(shape, results)


def _real_groups(rank, world_size, data_parallel, tensor_parallel):
    import torch.distributed as dist

    kata = load_kata(KATA)
    grid = kata.RankGrid(data_parallel, tensor_parallel)
    mine = {}
    for name in ("tensor_group", "data_group"):
        group = getattr(grid, name)
        if group is None or group is dist.group.WORLD:
            mine[name] = "the whole world"
        elif not isinstance(group, dist.ProcessGroup):
            mine[name] = f"{group!r}, not a process group of this rank"
        else:
            mine[name] = list(dist.get_process_group_ranks(group))
    try:
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        return mine, None
    mesh = init_device_mesh("cpu", (data_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))
    theirs = {
        "tensor_group": list(dist.get_process_group_ranks(mesh.get_group("tp"))),
        "data_group": list(dist.get_process_group_ranks(mesh.get_group("dp"))),
    }
    return mine, theirs


@pytest.mark.step(2)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_the_groups_equal_init_device_mesh(kata, shape):
    world_size, data_parallel, tensor_parallel = shape
    try:
        results = run_world(_real_groups, world_size, data_parallel, tensor_parallel)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"RankGrid({data_parallel}, {tensor_parallel}) on {world_size} ranks never finished: "
            "ranks waited for each other while making the groups. Every rank must call "
            "dist.new_group for every row and column, in the same order, members or not.\n"
            f"{deadlock}"
        ) from None
    rows, columns = _torch_layout(*shape)
    for rank, (mine, theirs) in enumerate(results):
        expected = {
            "tensor_group": rows[rank // tensor_parallel],
            "data_group": columns[rank % tensor_parallel],
        }
        if theirs is not None:
            assert theirs == expected, f"init_device_mesh's groups on rank {rank}: {theirs}"
        if expected["tensor_group"] != expected["data_group"] and mine == {
            "tensor_group": expected["data_group"],
            "data_group": expected["tensor_group"],
        }:
            raise AssertionError(
                f"rank {rank}'s tensor_group holds {mine['tensor_group']} and its data_group "
                f'{mine["data_group"]}: swapped. init_device_mesh\'s "tp" group is the row '
                f'{expected["tensor_group"]}, its "dp" group the column {expected["data_group"]}'
            )
        for name, ranks in mine.items():
            assert ranks == expected[name], (
                f'rank {rank}\'s {name} holds ranks {ranks}; init_device_mesh("cpu", '
                f'({data_parallel}, {tensor_parallel}), mesh_dim_names=("dp", "tp"))\'s '
                f"{'tp' if name == 'tensor_group' else 'dp'} group there is {expected[name]}"
            )
    if results[0][1] is None:
        pytest.skip("this torch has no torch.distributed.device_mesh: compared with arange instead")


# --------------------------------------------------------------------------- step 3: collectives


def _row_only(rank, world_size, data_parallel, tensor_parallel, active_row):
    """Only the ranks of ``active_row`` sum over their row; the other rows do nothing."""
    kata = load_kata(KATA)
    grid = kata.RankGrid(data_parallel, tensor_parallel)
    tensor = torch.tensor([float(rank), 10.0 * rank + 1])
    if grid.row != active_row:
        return tensor, []
    rehearsed = _rehearse(kata, grid, lambda: grid.sum_over_row(tensor.clone()))
    if rehearsed and rehearsed != [("all_reduce", "row")]:
        return tensor, rehearsed  # the real call would wait for ranks outside the row
    with recording() as calls:
        grid.sum_over_row(tensor)
    return tensor, _groups_used(calls, grid)


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _rehearse(kata, grid, call) -> list[tuple[str, str]]:
    """``call`` with dist.all_reduce replaced by a stand-in that only notes the group it was
    given (it communicates nothing, so a wrong group cannot hang): [(name, which group)]."""
    import torch.distributed as dist

    noted = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        noted.append(("all_reduce", group))
        return _Done() if async_op else None

    originals = (dist.all_reduce, getattr(kata, "all_reduce", None))
    dist.all_reduce = all_reduce
    if originals[1] is not None:  # `from torch.distributed import all_reduce` in the kata
        kata.all_reduce = all_reduce
    try:
        call()
    finally:
        dist.all_reduce = originals[0]
        if originals[1] is not None:
            kata.all_reduce = originals[1]
    return [(name, _which(group, grid)) for name, group in noted]


def _which(group, grid) -> str:
    import torch.distributed as dist

    if group is grid.tensor_group:
        return "row"
    if group is grid.data_group:
        return "column"
    return "world" if group is None or group is dist.group.WORLD else "other"


def _groups_used(calls, grid) -> list[tuple[str, str]]:
    """Each call's name and which of the grid's groups it named: row, column, world or other."""
    return [(c.name, _which(c.group, grid)) for c in calls]


@pytest.mark.step(3)
def test_a_row_sums_over_its_own_members_only(kata):
    shape = (6, 2, 3)
    try:
        results = run_world(_row_only, *shape, 0)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            "sum_over_row on row 0 ([0, 1, 2]) of a 2 x 3 grid never returned while row 1 "
            "([3, 4, 5]) called nothing: the all-reduce waited for ranks outside the row. Pass "
            "group=self.tensor_group to dist.all_reduce: a collective on a subgroup involves "
            f"only its members.\n{deadlock}"
        ) from None
    check_row_sums(results, shape, active_rows={0})


def _every_row(rank, world_size, data_parallel, tensor_parallel):
    return _row_only(rank, world_size, data_parallel, tensor_parallel, rank // tensor_parallel)


def check_row_sums(results, shape, active_rows) -> None:
    world_size, data_parallel, tensor_parallel = shape
    rows, _ = _torch_layout(*shape)
    for rank, (tensor, used) in enumerate(results):
        row = rank // tensor_parallel
        before = torch.tensor([float(rank), 10.0 * rank + 1])
        if row not in active_rows:
            assert torch.equal(tensor, before), (
                f"rank {rank} (row {row}) never called sum_over_row, yet its tensor changed"
            )
            continue
        members = rows[row]
        expected = torch.tensor([float(sum(members)), sum(10.0 * r + 1 for r in members)])
        names = [name for name, *_ in used]
        if names.count("all_reduce") != 1 or len(names) != 1:
            raise AssertionError(
                f"rank {rank}'s sum_over_row called {names or 'nothing'}: exactly one "
                "dist.all_reduce, on the row's group"
            )
        group = used[0][1]
        if group != "row":
            raise AssertionError(
                f"rank {rank}'s sum_over_row all-reduced on "
                + {
                    "column": "its column's group (self.data_group)",
                    "world": "the whole world (no group=)",
                    "other": "a group that is not its row's",
                }[group]
                + ": the row is the tensor-parallel group, pass group=self.tensor_group"
            )
        world = torch.tensor(
            [float(sum(range(world_size))), sum(10.0 * r + 1 for r in range(world_size))]
        )
        assert torch.equal(tensor, expected), (
            f"rank {rank} (row {row}, ranks {members}) holds {tensor.tolist()} after "
            f"sum_over_row, expected the sum over its row {expected.tolist()}"
            + (
                ": that is the whole world's sum; the row's group alone"
                if torch.equal(tensor, world)
                else ": a SUM all-reduce in place, nothing divided"
            )
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("shape", [(6, 3, 2), (4, 1, 4)], ids=["6=3x2", "4=1x4"])
def test_every_row_sums_at_once(kata, shape):
    results = run_world(_every_row, *shape)
    check_row_sums(results, shape, active_rows=set(range(shape[1])))


def _columns(rank, world_size, data_parallel, tensor_parallel):
    kata = load_kata(KATA)
    grid = kata.RankGrid(data_parallel, tensor_parallel)
    tensor = torch.tensor([float(rank), 1.0 + rank / 7])
    with recording() as calls:
        try:
            grid.average_over_column(tensor)
        except KataTodo:
            raise
        except Exception as error:
            return f"{type(error).__name__}: {str(error).strip()[:300]}", _groups_used(calls, grid)
    return tensor, _groups_used(calls, grid)


@pytest.mark.step(3)
@pytest.mark.parametrize("shape", [(6, 3, 2), (6, 2, 3)], ids=["6=3x2", "6=2x3"])
def test_a_column_averages_over_its_own_members(kata, shape):
    world_size, data_parallel, tensor_parallel = shape
    _, columns = _torch_layout(*shape)
    results = run_world(_columns, *shape)
    for rank, (tensor, used) in enumerate(results):
        members = columns[rank % tensor_parallel]
        if isinstance(tensor, str):
            raise AssertionError(
                f"rank {rank}'s average_over_column raised {tensor}"
                + (
                    ": this backend has no ReduceOp.AVG (older gloo lacks it). All-reduce a SUM on the column's "
                    "group, then divide in place by the column's size"
                    if "AVG" in tensor.upper()
                    else ""
                )
            )
        values = [torch.tensor([float(r), 1.0 + r / 7]) for r in members]
        total = torch.stack(values).sum(0)
        expected = total / len(members)
        groups = {group for name, group in used if name == "all_reduce"}
        assert groups == {"column"}, (
            f"rank {rank}'s average_over_column called {[name for name, _ in used] or 'nothing'}"
            + (f" on {', '.join(sorted(groups))} group(s)" if groups else "")
            + ": all-reduce on the column, group=self.data_group (the data-parallel group), "
            "not the row's (self.tensor_group) nor the whole world"
        )
        mine = torch.tensor([float(rank), 1.0 + rank / 7])
        # Dividing each rank's value before the sum is right too, and rounds differently from
        # dividing the sum: hence a tolerance of a few ulps, not bitwise equality.
        if torch.allclose(tensor, expected, rtol=1e-6, atol=0):
            continue
        if torch.allclose(tensor, total, rtol=1e-6, atol=0):
            why = (
                "that is the column's sum, and nothing divided it in place: divide the "
                f"tensor itself by the column's size {len(members)} (tensor /= size or "
                "tensor.div_(size); tensor = tensor / size makes a new tensor the caller never "
                "sees)"
            )
        elif torch.allclose(tensor, total / world_size, rtol=1e-6, atol=0):
            why = (
                f"the column's sum divided by the world size {world_size}: divide by the "
                f"column's size, {len(members)} ranks"
            )
        elif torch.equal(tensor, mine):
            why = "the tensor is unchanged: average it in place"
        else:
            why = "sum over the column (self.data_group), then divide by the column's size"
        raise AssertionError(
            f"rank {rank} (column {members}) holds {tensor.tolist()} after "
            f"average_over_column, expected the column's mean {expected.tolist()}: {why}"
        )


@pytest.mark.step(3)
def test_program_draws_the_grid_and_sums_each_row(kata):
    out = run_module_ok(KATA, "--world-size", "4", "--data-parallel", "2").stdout
    shown = "`python -m k17_rank_grids --world-size 4 --data-parallel 2`"
    lines = [line for line in out.splitlines() if line.startswith("[main]  ")]
    rows = [line.split("row", 1)[1].split("tensor")[0].split() for line in lines if " row " in line]
    assert rows == [["0", "1"], ["2", "3"]], f"{shown} should draw the grid's rows:\n{out}"
    assert "[rank 3] row 1, column 1: sum_over_row(rank) = 5 (ranks [2, 3])" in out, out
    assert "average_over_column(rank) = 2 (ranks [1, 3])" in out, out
    assert "each row summed its own ranks only" in out, out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    grid = kata.RankGrid(1, world_size)
    row = torch.full((3,), float(rank + 1), device=device)
    grid.sum_over_row(row)
    column = torch.full((3,), float(rank + 1), device=device)
    grid.average_over_column(column)
    return str(row.device), row.cpu(), column.cpu()


def check_on_cuda(results, world_size) -> None:
    total = float(sum(range(1, world_size + 1)))
    for rank, (device, row, column) in enumerate(results):
        assert device.startswith("cuda"), f"rank {rank}'s tensor left the GPU: {device}"
        assert torch.equal(row, torch.full((3,), total)), (
            f"rank {rank}: sum_over_row on CUDA gave {row.tolist()}, expected {total} each"
        )
        assert torch.equal(column, torch.full((3,), float(rank + 1))), (
            f"rank {rank}: average_over_column over a column of one rank changed the value"
        )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    check_on_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")), 1)


@pytest.mark.step(3)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    check_on_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")), 2)
