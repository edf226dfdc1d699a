"""k08 · Collectives and groups: who holds what, before and after.

THE IDEA
    A collective is one call that every rank of a group makes, in the same order, with tensors
    of matching shapes; torch.distributed moves and combines the data between them. Which
    collective you need depends on who holds what before and who needs what after. Four
    ranks, one letter per rank's data (a tensor each):

    broadcast(src=0): one rank's tensor to everyone, in place
        before   r0: a    r1: .    r2: .    r3: .
        after    r0: a    r1: a    r2: a    r3: a

    reduce(dst=0): everyone's tensors combined (here summed) onto one rank
        before   r0: a    r1: b    r2: c    r3: d
        after    r0: a+b+c+d   r1..r3: partial sums along the way: never read them

    all_reduce: everyone's tensors combined, the result on every rank (op SUM, MAX, AVG, ...)
        before   r0: a    r1: b    r2: c    r3: d
        after    every rank: a+b+c+d      (MAX: the largest; AVG: (a+b+c+d)/4, floats only)

    scatter(src=0): one rank's list, one piece to each rank
        before   r0: [A0 A1 A2 A3]
        after    r0: A0   r1: A1   r2: A2   r3: A3

    gather(dst=0): one piece from each rank, as a list on one rank
        before   r0: a    r1: b    r2: c    r3: d
        after    r0: [a b c d]   (the others get nothing)

    all_gather: every rank gets the list
        before   r0: a    r1: b    r2: c    r3: d
        after    every rank: [a b c d]

    reduce_scatter: rank j gets the sum, over all ranks, of their piece j
        before   r0: [a0 a1 a2 a3]   r1: [b0 b1 b2 b3]   r2: [c0 ...]   r3: [d0 ...]
        after    r0: a0+b0+c0+d0     r1: a1+b1+c1+d1     ...

    all_to_all: piece j of rank i goes to rank j, as its piece i (a transpose)
        before   r0: [a0 a1 a2 a3]   r1: [b0 b1 b2 b3]   ...
        after    r0: [a0 b0 c0 d0]   r1: [a1 b1 c1 d1]   ...

    barrier: no data; no rank leaves until every rank has arrived.

    reduce_scatter followed by all_gather *is* an all_reduce (each rank sums one piece, then
    everyone collects the pieces): kata 09 builds an all-reduce exactly that way.

    The list arguments are asymmetric: ``scatter_list`` is given only on ``src``, and
    ``gather_list`` only on ``dst``; every other rank passes ``None``. The output tensors
    (``all_gather``'s list, ``scatter``'s tensor) are allocated by the caller before the call.

    A *group* is a subset of ranks with collectives of its own: ``dist.new_group([0, 2])``.
    Creating one is itself a collective over the whole world: every rank calls ``new_group``
    for every group, members or not, in the same order (a rank outside the group gets a
    placeholder back). Then a collective with ``group=`` touches only the members:

        all_reduce in group [0, 2]
        before   r0: a    r1: b    r2: c    r3: d
        after    r0: a+c  r1: b    r2: a+c  r3: d

STEPS
    1. ``broadcast_from`` and ``reduce_to``: one to all, all to one.
    2. ``all_reduce_with``: all_reduce with SUM, MAX and AVG, chosen by name.
    3. ``scatter_rows`` and ``gather_rows``: one table, a row per rank, and back.
    4. ``all_gather_rows`` and ``reduce_scatter_rows``: the two halves of an all-reduce.
    5. ``all_to_all_rows``: the transpose.
    6. ``prepare_once``: rank 0 prepares a file, everyone waits for it at a barrier.
    7. ``group_sum`` and ``parity_sums``: new_group and collectives inside a subgroup.

WHAT THE TESTS CHECK
    Exact integer results on every rank for worlds of 2, 3 and 4, from several source and
    destination ranks, including what non-destination ranks return (``None``). AVG on floats
    whose mean is exact. ``prepare_once`` faces a rank 0 that arrives late, so a rank that does
    not wait finds no file. Subgroup all-reduces change only their members, and a rank that
    skips ``new_group`` for a group it is not in ends as a deadlock report. Bad arguments (an
    unknown op name, a src outside the world, a table with the wrong number of rows, bad group
    members) raise ``ValueError``.

RUN IT
    .venv/bin/python -m katas.k08_collectives --world-size 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from dojo.console import run_program, say
from dojo.launch import add_launch_arguments, launch_world


def _check_rank(value: int, name: str) -> None:
    world_size = dist.get_world_size()
    if not 0 <= value < world_size:
        raise ValueError(f"{name}={value} is not a rank of this world (0..{world_size - 1})")


def _check_table(table: torch.Tensor | None, name: str = "table") -> None:
    world_size = dist.get_world_size()
    if table is None or table.dim() < 1 or table.shape[0] != world_size:
        shape = None if table is None else tuple(table.shape)
        raise ValueError(f"{name} needs one row per rank ({world_size} rows), got shape {shape}")


# ------------------------------------------------------------------------------ step 1


def broadcast_from(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Every rank passes a tensor of the same shape; afterwards each holds ``src``'s values.

    Works in place and returns ``tensor``.
    """
    _check_rank(src, "src")
    # BEGIN STEP 1: broadcast_from: one rank's tensor to every rank
    # TODO: afterwards every rank's `tensor` holds src's values (changed in place, and returned).
    #   The tests broadcast from the first and from the last rank in worlds of 2, 3 and 4, and
    #   check which collective each rank called, and with which src.
    dist.broadcast(tensor, src=src)
    return tensor
    # END STEP 1


def reduce_to(tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
    """Sum every rank's ``tensor`` onto rank ``dst``: ``dst`` returns the sum, others ``None``.

    (On the other ranks ``tensor`` may be left holding partial sums: nobody should read it.)
    """
    _check_rank(dst, "dst")
    # BEGIN STEP 1: reduce_to: every rank's tensor summed onto dst
    # TODO: dst returns the element-wise sum of every rank's tensor; every other rank returns
    #   None. The tests reduce onto the first and onto the last rank, and check that every rank
    #   took part in one collective that brings the sum to dst alone.
    dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM)
    return tensor if dist.get_rank() == dst else None
    # END STEP 1


# ------------------------------------------------------------------------------ step 2


def all_reduce_with(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce ``tensor`` in place with ``op``, one of ``"sum"``, ``"max"``, ``"avg"``.

    Returns ``tensor``. Any other name raises ``ValueError`` naming the three. (AVG needs a
    floating-point tensor: the mean of integers is not always an integer.)
    """
    # BEGIN STEP 2: all_reduce with SUM, MAX and AVG
    # TODO: every rank's `tensor` ends up holding the reduction over all ranks (in place, and
    #   returned). The tests check "sum", "max" and "avg" (on floats) on every rank, and that an
    #   unknown name raises a ValueError whose message names the three.
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
    if op not in ops:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(ops)}")
    dist.all_reduce(tensor, op=ops[op])
    return tensor
    # END STEP 2


# ------------------------------------------------------------------------------ step 3


def scatter_rows(table: torch.Tensor | None, src: int, out: torch.Tensor) -> torch.Tensor:
    """Rank ``src`` holds ``table`` (one row per rank); row ``r`` lands in rank ``r``'s ``out``.

    Ranks other than ``src`` pass ``table=None``. Every rank passes ``out``, shaped like one
    row; returns ``out``.
    """
    _check_rank(src, "src")
    # BEGIN STEP 3: scatter_rows: a row to each rank
    # TODO: rank r's `out` receives row r of src's table (and is returned). Only src holds a
    #   table, and only src refuses a bad one (_check_table raises the ValueError). The tests
    #   scatter from the first and from the last rank, and give src tables it must refuse.
    pieces = None
    if dist.get_rank() == src:
        _check_table(table)
        pieces = list(table.unbind(0))
    dist.scatter(out, scatter_list=pieces, src=src)
    return out
    # END STEP 3


def gather_rows(row: torch.Tensor, dst: int) -> torch.Tensor | None:
    """Every rank's ``row`` stacked in rank order on ``dst``; ``None`` on the other ranks."""
    _check_rank(dst, "dst")
    # BEGIN STEP 3: gather_rows: every row onto dst
    # TODO: dst returns one tensor, every rank's row stacked in rank order; every other rank
    #   returns None. The tests gather onto the first and onto the last rank.
    if dist.get_rank() != dst:
        dist.gather(row, gather_list=None, dst=dst)
        return None
    pieces = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.gather(row, gather_list=pieces, dst=dst)
    return torch.stack(pieces)
    # END STEP 3


# ------------------------------------------------------------------------------ step 4


def all_gather_rows(row: torch.Tensor) -> torch.Tensor:
    """Every rank's ``row`` stacked in rank order, on every rank."""
    # BEGIN STEP 4: all_gather_rows: every row on every rank
    # TODO: every rank returns one tensor: every rank's row, stacked in rank order, gathered by
    #   one collective.
    pieces = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, row)
    return torch.stack(pieces)
    # END STEP 4


def reduce_scatter_rows(table: torch.Tensor) -> torch.Tensor:
    """Every rank holds a ``table`` with one row per rank; rank ``r`` gets the sum of all row ``r``s."""
    _check_table(table)
    # BEGIN STEP 4: reduce_scatter_rows: rank r gets the sum of every row r
    # TODO: rank r returns one row, the sum over all ranks of their row r, from one collective
    #   that brings each rank the sum of its own row only.
    out = torch.empty_like(table[0])
    dist.reduce_scatter(out, list(table.unbind(0)), op=dist.ReduceOp.SUM)
    return out
    # END STEP 4


# ------------------------------------------------------------------------------ step 5


def all_to_all_rows(table: torch.Tensor) -> torch.Tensor:
    """Row ``j`` of rank ``i``'s ``table`` becomes row ``i`` of rank ``j``'s result."""
    _check_table(table)
    # BEGIN STEP 5: all_to_all_rows: the transpose
    # TODO: rank j returns a table whose row i is row j of rank i's table (a transpose across
    #   the ranks), from one collective; `table` itself is left as it was.
    received = [torch.empty_like(row) for row in table.unbind(0)]
    dist.all_to_all(received, [row.contiguous() for row in table.unbind(0)])
    return torch.stack(received)
    # END STEP 5


# ------------------------------------------------------------------------------ step 6


def prepare_once(path: str, prepare: Callable[[], str]) -> str:
    """Rank 0 calls ``prepare()`` and writes its text to ``path``; every rank returns that text.

    The pattern of "rank 0 downloads the data set, the others wait": only rank 0 prepares, and
    no rank reads the file before rank 0 has written it.
    """
    # BEGIN STEP 6: prepare_once: rank 0 writes, everyone waits at a barrier
    # TODO: only rank 0 calls prepare() and writes its text to `path`; every rank returns the
    #   file's text. The test's rank 0 arrives late, so a rank that reads before rank 0 has
    #   written finds no file: the tests check that every rank waits at a barrier, and that
    #   rank 0 reaches it only once the file is written.
    if dist.get_rank() == 0:
        with open(path, "w", encoding="utf-8") as f:
            f.write(prepare())
    dist.barrier()  # nobody reads before rank 0 has written
    with open(path, encoding="utf-8") as f:
        return f.read()
    # END STEP 6


# ------------------------------------------------------------------------------ step 7


def _check_members(members: list[int]) -> list[int]:
    world_size = dist.get_world_size()
    ranks = list(members)
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"members must be distinct ranks of 0..{world_size - 1}, got {members!r}")
    return sorted(ranks)


def group_sum(tensor: torch.Tensor, members: list[int]) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in ``members`` only; other ranks keep theirs untouched.

    Every rank calls this (creating a group is a collective of the whole world). Returns
    ``tensor``, summed in place on members.
    """
    members = _check_members(members)
    # BEGIN STEP 7: group_sum: an all-reduce inside a subgroup
    # TODO: the members end with their sum, every other rank with its tensor untouched; free the
    #   group you create before returning (dist.destroy_process_group(group)). The tests call it
    #   twice with different members and check, on every rank, which groups it created and
    #   which group its all-reduce used.
    group = dist.new_group(members)  # every rank, member or not
    if dist.get_rank() in members:
        dist.all_reduce(tensor, group=group)
    dist.destroy_process_group(group)  # a group holds connections: free it when done
    return tensor
    # END STEP 7


def parity_sums(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of the same parity: evens with evens, odds with odds.

    Two groups; every rank creates both, in the same order, and all-reduces in its own.
    """
    # BEGIN STEP 7: parity_sums: two subgroups at once
    # TODO: every rank ends with the sum over the ranks of its own parity, using two groups
    #   (evens, odds) that are freed before returning. The tests check, on every rank, which
    #   groups it created, in which order, and which group its all-reduce used.
    world_size, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(parity, world_size, 2))) for parity in (0, 1)]
    dist.all_reduce(tensor, group=groups[rank % 2])
    for group in groups:
        dist.destroy_process_group(group)
    return tensor
    # END STEP 7


# ------------------------------------------------------------------------------ the program


def show(rank: int, world_size: int, scratch: str) -> None:
    """What each rank of the program does: every collective once, printed before and after.

    ``scratch`` is a folder every rank can read and write (the barrier's shared file goes there).
    """
    from dojo.devices import rank_device

    device = rank_device()
    last = world_size - 1

    def section(title: str, text: str) -> None:
        if rank == 0:
            say(rank, f"--- {title}")
        for turn in range(world_size):  # one rank at a time, so the lines come in rank order
            dist.barrier()
            if turn == rank:
                say(rank, text)
        dist.barrier()

    mine = torch.tensor(rank, device=device)  # one number per rank (a 0-d tensor)
    section(
        f"broadcast from rank {last}",
        f"{mine.tolist()} -> {broadcast_from(mine.clone(), last).tolist()}",
    )
    total = reduce_to(mine.clone(), 0)
    section(
        "reduce (sum) to rank 0", f"{mine.tolist()} -> {None if total is None else total.tolist()}"
    )
    for op in ("sum", "max", "avg"):
        value = mine.float() if op == "avg" else mine.clone()
        section(
            f"all_reduce {op}", f"{value.tolist()} -> {all_reduce_with(value.clone(), op).tolist()}"
        )
    table = torch.arange(world_size, device=device) * 10 if rank == 0 else None
    out = torch.empty((), dtype=torch.int64, device=device)  # a row of a 1-D table is a scalar
    section(
        "scatter from rank 0 (it holds [0, 10, 20, ...])",
        f"got {scatter_rows(table, 0, out).tolist()}",
    )
    gathered = gather_rows(mine, 0)
    section(
        "gather to rank 0", f"{mine.tolist()} -> {None if gathered is None else gathered.tolist()}"
    )
    section("all_gather", f"{mine.tolist()} -> {all_gather_rows(mine).tolist()}")
    pieces = torch.arange(world_size, device=device) + 10 * rank
    section("reduce_scatter", f"{pieces.tolist()} -> {reduce_scatter_rows(pieces).tolist()}")
    section("all_to_all", f"{pieces.tolist()} -> {all_to_all_rows(pieces).tolist()}")
    text = prepare_once(os.path.join(scratch, "prepared.txt"), lambda: f"prepared by rank {rank}")
    section("barrier: rank 0 writes a file, nobody reads it before the barrier", f"read {text!r}")
    members = list(range(0, world_size, 2))
    section(
        f"all_reduce in the group {members}",
        f"{mine.tolist()} -> {group_sum(mine.clone(), members).tolist()}",
    )
    section(
        "parity_sums: evens with evens, odds with odds",
        f"{mine.tolist()} -> {parity_sums(mine.clone()).tolist()}",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Every collective once, with who holds what before and after."
    )
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="k08-") as scratch:
        launch_world(show, args.world_size, scratch, backend=args.backend, device=args.device)
    say(None, f"{args.world_size} ranks ran every collective in the same order")
    return 0


if __name__ == "__main__":
    run_program(main)
