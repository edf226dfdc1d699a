"""k08's mistakes catalogue: real mistakes with broadcast, reduce, scatter, gather, all_gather,
reduce_scatter, all_to_all, barrier and new_group, and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer

SUM = dist.ReduceOp.SUM


def _check_rank(value, name):
    world_size = dist.get_world_size()
    if not 0 <= value < world_size:
        raise ValueError(f"{name}={value} is not a rank of this world (0..{world_size - 1})")


def _check_table(table, name="table"):
    world_size = dist.get_world_size()
    if table is None or table.dim() < 1 or table.shape[0] != world_size:
        shape = None if table is None else tuple(table.shape)
        raise ValueError(f"{name} needs one row per rank ({world_size} rows), got shape {shape}")


# --------------------------------------------------------------------------- broadcast_from


def broadcast_from_own_rank(tensor, src):
    _check_rank(src, "src")
    dist.broadcast(tensor, src=dist.get_rank())  # "I broadcast my tensor": every rank a source
    return tensor


def broadcast_only_on_src(tensor, src):
    _check_rank(src, "src")
    if dist.get_rank() == src:  # "only the source has something to send"
        dist.broadcast(tensor, src=src)
    return tensor


def broadcast_into_a_copy(tensor, src):
    """Right: broadcast into a copy, then copy the result back into the caller's tensor."""
    _check_rank(src, "src")
    received = tensor.clone()
    dist.broadcast(received, src=src)
    tensor.copy_(received)
    return tensor


# --------------------------------------------------------------------------- reduce_to


def reduce_returns_everywhere(tensor, dst):
    _check_rank(dst, "dst")
    dist.reduce(tensor, dst=dst, op=SUM)
    return tensor  # the other ranks return their partial sums


def reduce_with_all_reduce(tensor, dst):
    _check_rank(dst, "dst")
    dist.all_reduce(tensor, op=SUM)  # right numbers on dst, but the sum goes to every rank
    return tensor if dist.get_rank() == dst else None


def reduce_always_to_rank_0(tensor, dst):
    _check_rank(dst, "dst")
    dist.reduce(tensor, dst=0, op=SUM)  # the tutorial's dst, hard-coded
    return tensor if dist.get_rank() == dst else None


# --------------------------------------------------------------------------- all_reduce_with

_OPS = {"sum": SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}


def avg_as_sum(tensor, op):
    ops = {**_OPS, "avg": SUM}  # "the average is a sum", divided by nobody
    if op not in ops:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(ops)}")
    dist.all_reduce(tensor, op=ops[op])
    return tensor


def reduced_a_copy(tensor, op):
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(_OPS)}")
    result = tensor.clone()
    dist.all_reduce(result, op=_OPS[op])
    return result  # the caller's tensor is left as it was


def ops_key_error(tensor, op):
    dist.all_reduce(tensor, op=_OPS[op])  # an unknown name escapes as a bare KeyError
    return tensor


def ops_unhelpful_error(tensor, op):
    if op not in _OPS:
        raise ValueError("invalid op")
    dist.all_reduce(tensor, op=_OPS[op])
    return tensor


def avg_as_sum_divided(tensor, op):
    """Right: the mean as a SUM all-reduce divided by the world size (gloo without AVG)."""
    if op not in ("sum", "max", "avg"):
        raise ValueError(f"unknown op {op!r}: use sum, max or avg")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else SUM)
    if op == "avg":
        tensor /= dist.get_world_size()
    return tensor


# --------------------------------------------------------------------------- scatter_rows / gather_rows


def check_table_on_every_rank(table, src, out):
    _check_rank(src, "src")
    _check_table(table)  # but only src has a table: the others passed None
    pieces = list(table.unbind(0)) if dist.get_rank() == src else None
    dist.scatter(out, scatter_list=pieces, src=src)
    return out


def scatter_list_on_every_rank(table, src, out):
    _check_rank(src, "src")
    if dist.get_rank() == src:
        _check_table(table)
        pieces = list(table.unbind(0))
    else:  # "every rank needs a list of the right shape"
        pieces = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.scatter(out, scatter_list=pieces, src=src)
    return out


def scatter_without_checking(table, src, out):
    _check_rank(src, "src")
    pieces = list(table.unbind(0)) if dist.get_rank() == src else None  # table never checked
    dist.scatter(out, scatter_list=pieces, src=src)
    return out


def gather_list_on_every_rank(row, dst):
    _check_rank(dst, "dst")
    pieces = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.gather(row, gather_list=pieces, dst=dst)  # every rank offers a list to fill
    return torch.stack(pieces) if dist.get_rank() == dst else None


def scatter_by_iterating(table, src, out):
    """Right: the rows as `list(table)` and scatter's keyword-free call."""
    _check_rank(src, "src")
    rows = None
    if dist.get_rank() == src:
        _check_table(table)
        rows = [row.contiguous() for row in table]
    dist.scatter(out, rows, src)
    return out


# --------------------------------------------------------------------------- all_gather_rows


def all_gather_into_one_tensor(row):
    gathered = torch.empty((dist.get_world_size(), *row.shape), dtype=row.dtype)
    dist.all_gather(gathered, row)  # all_gather wants a list of tensors
    return gathered


def all_gather_returns_the_list(row):
    pieces = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, row)
    return pieces  # not stacked


def all_gather_into_tensor(row):
    """Right: one flat output tensor, then a reshape."""
    world_size = dist.get_world_size()
    flat = torch.empty(world_size * row.numel(), dtype=row.dtype, device=row.device)
    dist.all_gather_into_tensor(flat, row.contiguous())
    return flat.view(world_size, *row.shape)


# --------------------------------------------------------------------------- reduce_scatter_rows


def reduce_scatter_columns(table):
    _check_table(table)
    out = torch.empty_like(table[:, 0])
    dist.reduce_scatter(out, list(table.unbind(1)), op=SUM)  # columns, not rows
    return out


def reduce_scatter_with_all_reduce(table):
    _check_table(table)
    total = table.clone()
    dist.all_reduce(total, op=SUM)  # every rank receives every row's sum
    return total[dist.get_rank()]


def reduce_scatter_tensor(table):
    """Right: the whole table as one input tensor."""
    _check_table(table)
    out = torch.empty_like(table[0])
    dist.reduce_scatter_tensor(out, table.reshape(-1), op=SUM)  # the rows end to end
    return out


# --------------------------------------------------------------------------- all_to_all_rows


def all_to_all_lists_swapped(table):
    _check_table(table)
    received = [torch.empty_like(row) for row in table.unbind(0)]
    dist.all_to_all(list(table.unbind(0)), received)  # (input, output): the other way round
    return torch.stack(received)


def all_to_all_returns_input(table):
    _check_table(table)
    rows = list(table.unbind(0))
    received = [torch.empty_like(row) for row in rows]
    dist.all_to_all(received, [row.contiguous() for row in rows])
    return torch.stack(rows)  # the wrong list


def all_to_all_with_all_gather(table):
    _check_table(table)
    tables = [torch.empty_like(table) for _ in range(dist.get_world_size())]
    dist.all_gather(tables, table)  # everything everywhere, then keep row `rank` of each
    return torch.stack([t[dist.get_rank()] for t in tables])


def all_to_all_single(table):
    """Right: one input and one output tensor, split along dim 0."""
    _check_table(table)
    out = torch.empty_like(table)
    dist.all_to_all_single(out, table.contiguous())
    return out


# --------------------------------------------------------------------------- prepare_once


def _write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def prepare_without_barrier(path, prepare):
    if dist.get_rank() == 0:
        _write(path, prepare())
    return _read(path)  # the others read at once: the file may not be there yet


def barrier_before_writing(path, prepare):
    dist.barrier()  # "everyone together first"
    if dist.get_rank() == 0:
        _write(path, prepare())
    return _read(path)


def barrier_only_on_rank_0(path, prepare):
    if dist.get_rank() == 0:
        _write(path, prepare())
        dist.barrier()  # inside the if: the other ranks never arrive
    return _read(path)


def everyone_prepares(path, prepare):
    _write(path, prepare())  # every rank "downloads"
    dist.barrier()
    return _read(path)


def rank_0_keeps_its_text(path, prepare):
    """Right: rank 0 returns what it wrote without reading it back; a monitored barrier."""
    text = None
    if dist.get_rank() == 0:
        text = prepare()
        _write(path, text)
    dist.monitored_barrier()
    return text if text is not None else _read(path)


# --------------------------------------------------------------------------- group_sum / parity_sums


def _members(members):
    world_size = dist.get_world_size()
    ranks = list(members)
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"members must be distinct ranks of 0..{world_size - 1}, got {members!r}")
    return sorted(ranks)


def group_made_by_members_only(tensor, members):
    members = _members(members)
    if dist.get_rank() in members:  # "the others have nothing to do with it"
        group = dist.new_group(members)
        dist.all_reduce(tensor, group=group)
        dist.destroy_process_group(group)
    return tensor


def group_sum_forgets_the_group(tensor, members):
    members = _members(members)
    group = dist.new_group(members)
    if dist.get_rank() in members:
        dist.all_reduce(tensor)  # no group=: the whole world, whose other ranks never come
    dist.destroy_process_group(group)
    return tensor


def everyone_calls_the_group_all_reduce(tensor, members):
    """Right: non-members call the group's all_reduce too; torch skips it on ranks outside it."""
    members = _members(members)
    group = dist.new_group(members)
    dist.all_reduce(tensor, group=group)
    dist.destroy_process_group(group)
    return tensor


def parity_own_group_only(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(rank % 2, world_size, 2)))  # only the group it is in
    dist.all_reduce(tensor, group=group)
    dist.destroy_process_group(group)
    return tensor


def parity_own_group_first(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank % 2, world_size, 2))
    other = list(range(1 - rank % 2, world_size, 2))
    groups = [dist.new_group(mine), dist.new_group(other)]  # both, but its own first
    dist.all_reduce(tensor, group=groups[0])
    for group in groups:
        dist.destroy_process_group(group)
    return tensor


def parity_forgets_the_group(tensor):
    world_size = dist.get_world_size()
    groups = [dist.new_group(list(range(p, world_size, 2))) for p in (0, 1)]
    dist.all_reduce(tensor)  # the whole world: everyone's sum
    for group in groups:
        dist.destroy_process_group(group)
    return tensor


def parity_by_enumeration(tensor):
    """Right: torch's helper that creates every listed group on every rank, in order."""
    world_size = dist.get_world_size()
    mine, groups = dist.new_subgroups_by_enumeration(
        [list(range(p, world_size, 2)) for p in (0, 1)]
    )
    dist.all_reduce(tensor, group=mine)
    for group in groups:
        dist.destroy_process_group(group)
    return tensor


# --------------------------------------------------------------------------- the catalogue

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "broadcast_from_own_rank",
        replaces="broadcast_from",
        fails=["test_broadcast_and_reduce[2]", "test_broadcast_and_reduce[3]"],
        says=["rank 1 called dist.broadcast(src=1) while rank 0 used src=0", "not its own rank"],
    ),
    Mistake(
        "broadcast_only_on_src",
        replaces="broadcast_from",
        fails=["test_broadcast_and_reduce[2]"],
        says=["only rank 0 called dist.broadcast; rank 1 never did", "called by every rank"],
    ),
    Mistake(
        "reduce_returns_everywhere",
        replaces="reduce_to",
        fails=["test_broadcast_and_reduce"],
        says=["expected None", "partial sums"],
    ),
    Mistake(
        "reduce_with_all_reduce",
        replaces="reduce_to",
        fails=["test_broadcast_and_reduce[2]"],
        says=["called dist.all_reduce: use dist.reduce", "gives it to dst only"],
    ),
    Mistake(
        "reduce_always_to_rank_0",
        replaces="reduce_to",
        fails=["test_broadcast_and_reduce"],  # every world: its dst is never 0
        says=[
            "inside reduce_to(tensor, dst=",
            "called dist.reduce(dst=0): pass dst on unchanged",
        ],
    ),
    Mistake(
        "avg_as_sum",
        replaces="all_reduce_with",
        fails=["test_all_reduce_with_sum_max_avg"],
        says=["the sum; expected the mean", "ReduceOp.AVG"],
    ),
    Mistake(
        "reduced_a_copy",
        replaces="all_reduce_with",
        fails=["test_all_reduce_with_sum_max_avg[2]"],
        says=["left rank 0's tensor as it was", "in place"],
    ),
    Mistake(
        "ops_key_error",
        replaces="all_reduce_with",
        fails=["test_all_reduce_with_sum_max_avg[2]"],
        says=["raised KeyError", "must raise ValueError"],
    ),
    Mistake(
        "ops_unhelpful_error",
        replaces="all_reduce_with",
        fails=["test_all_reduce_with_sum_max_avg[2]"],
        says=["name the ops it knows (sum, max, avg)"],
    ),
    Mistake(
        "check_table_on_every_rank",
        replaces="scatter_rows",
        fails=["test_scatter_and_gather[2]"],
        says=["only the source rank holds the table", "table=None"],
    ),
    Mistake(
        "scatter_list_on_every_rank",
        replaces="scatter_rows",
        fails=["test_scatter_and_gather"],  # every world: a list of world_size tensors
        says=["tensors, but it is not src", "scatter_list=None"],
    ),
    Mistake(
        "scatter_without_checking",
        replaces="scatter_rows",
        fails=["test_scatter_rows_refuses_bad_tables"],
        says=["scatter_rows(table=None) on src raised AttributeError", "expected a ValueError"],
    ),
    Mistake(
        "gather_list_on_every_rank",
        replaces="gather_rows",
        fails=["test_scatter_and_gather[2]"],
        says=["rank 1 passed a gather_list of 2 tensors", "gather_list=None"],
    ),
    Mistake(
        "all_gather_into_one_tensor",
        replaces="all_gather_rows",
        fails=["test_all_gather_and_reduce_scatter[2]"],
        says=["dist.all_gather fills a list of tensors, one per rank", "stack"],
    ),
    Mistake(
        "all_gather_returns_the_list",
        replaces="all_gather_rows",
        fails=["test_all_gather_and_reduce_scatter[2]"],
        says=["returned a Python list of 2 tensors", "torch.stack"],
    ),
    Mistake(
        "reduce_scatter_columns",
        replaces="reduce_scatter_rows",
        fails=["test_all_gather_and_reduce_scatter"],
        says=["split the table into its rows"],
    ),
    Mistake(
        "reduce_scatter_with_all_reduce",
        replaces="reduce_scatter_rows",
        fails=["test_all_gather_and_reduce_scatter[2]"],
        says=["called dist.all_reduce: use dist.reduce_scatter"],
    ),
    Mistake(
        "all_to_all_lists_swapped",
        replaces="all_to_all_rows",
        fails=["test_all_to_all[2]", "test_all_to_all[3]"],
        says=[
            "writes into its first argument",
            "the list of empty rows to receive into comes first",
        ],
    ),
    Mistake(
        "all_to_all_returns_input",
        replaces="all_to_all_rows",
        fails=["test_all_to_all"],
        says=["returned its own table unchanged", "return what arrived"],
    ),
    Mistake(
        "all_to_all_with_all_gather",
        replaces="all_to_all_rows",
        fails=["test_all_to_all[2]", "test_all_to_all[3]"],
        says=["called dist.all_gather: use dist.all_to_all", "N times the data"],
    ),
    Mistake(
        "prepare_without_barrier",
        replaces="prepare_once",
        fails=["test_prepare_once_waits_at_a_barrier"],
        says=[
            "never called dist.barrier() in prepare_once",
            "between rank 0's write and the reads",
        ],
    ),
    Mistake(
        "barrier_before_writing",
        replaces="prepare_once",
        fails=["test_prepare_once_waits_at_a_barrier"],
        says=["rank 0 reached the barrier before it had prepared and written the file"],
    ),
    Mistake(
        "barrier_only_on_rank_0",
        replaces="prepare_once",
        fails=["test_prepare_once_waits_at_a_barrier"],  # every world: rank 0 waits alone
        says=["only rank 0 called dist.barrier;", "called by every rank"],
    ),
    Mistake(
        "everyone_prepares",
        replaces="prepare_once",
        fails=["test_prepare_once_waits_at_a_barrier"],
        says=["rank 1 called prepare(): only rank 0 prepares"],
    ),
    Mistake(
        "group_made_by_members_only",
        replaces="group_sum",
        fails=["test_subgroups_touch_only_their_members"],
        says=["never called dist.new_group(", "dist.new_group is a collective of the whole world"],
    ),
    Mistake(
        "group_sum_forgets_the_group",
        replaces="group_sum",
        fails=[
            "test_subgroups_touch_only_their_members[2]",
            "test_subgroups_touch_only_their_members[3]",
        ],
        says=["called dist.all_reduce on the whole world (no group=)"],
    ),
    Mistake(
        "parity_own_group_only",
        replaces="parity_sums",
        fails=[
            "test_subgroups_touch_only_their_members[2]",
            "test_subgroups_touch_only_their_members[4]",
        ],
        says=["dist.new_group is a collective of the whole world", "members or not"],
    ),
    Mistake(
        "parity_own_group_first",
        replaces="parity_sums",
        fails=[
            "test_subgroups_touch_only_their_members[2]",
            "test_subgroups_touch_only_their_members[4]",
        ],
        says=["dist.new_group calls do not pair up", "in the same order"],
    ),
    Mistake(
        "parity_forgets_the_group",
        replaces="parity_sums",
        fails=["test_subgroups_touch_only_their_members"],
        says=["called dist.all_reduce on the whole world (no group=)"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("broadcast_into_a_copy", replaces="broadcast_from"),
    RightAnswer("avg_as_sum_divided", replaces="all_reduce_with"),
    RightAnswer("scatter_by_iterating", replaces="scatter_rows"),
    RightAnswer("all_gather_into_tensor", replaces="all_gather_rows"),
    RightAnswer("reduce_scatter_tensor", replaces="reduce_scatter_rows"),
    RightAnswer("all_to_all_single", replaces="all_to_all_rows"),
    RightAnswer("rank_0_keeps_its_text", replaces="prepare_once"),
    RightAnswer("everyone_calls_the_group_all_reduce", replaces="group_sum"),
    RightAnswer("parity_by_enumeration", replaces="parity_sums"),
]
