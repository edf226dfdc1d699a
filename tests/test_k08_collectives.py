"""k08 collectives and groups: exact results on every rank, for worlds of 2, 3 and 4.

Each test runs one world per world size and checks one step there: every rank returns what it
got, and the test compares it with what that rank should hold, naming the rank and the call.
"""

import os
import time

import pytest
import torch

from dojo.impl import load_kata
from dojo.testing import refusal, run_program
from dojo.world import WorldDeadlock, run_world

KATA = "k08_collectives"
DEADLINE_S = 10.0  # correct code finishes in well under a second; a deadlock ends here
SIZES = [2, 3, 4]


def _run(fn, world_size, *args, hint=""):
    """run_world, with a hint for the learner in front of a deadlock report."""
    try:
        return run_world(fn, world_size, *args, deadline=DEADLINE_S)
    except WorldDeadlock as deadlock:
        report = str(deadlock)
    pytest.fail(f"{hint}\n\n{report}" if hint else report, pytrace=False)


def _listed(value):
    """A returned tensor as a list (None stays None), so ranks send back plain values."""
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _check(results, call, expected, why):
    """Compare what every rank got from ``call`` with ``expected(rank)``."""
    for rank, got in enumerate(results):
        want = expected(rank)
        assert got[call] == want, f"{call}: rank {rank} got {got[call]!r}, expected {want!r}: {why}"


def _no_refusal_missing(results):
    for rank, got in enumerate(results):
        for call, outcome in got.get("bad", {}).items():
            assert outcome is None, (
                f"rank {rank}: {call} {outcome}, expected a ValueError that says what is wrong"
            )


# ------------------------------------------------------------------------------ step 1


def _broadcast_and_reduce(rank, world_size):
    kata, last = load_kata(KATA), world_size - 1
    mine = lambda: torch.tensor([10 * rank + 1, 10 * rank + 2])  # noqa: E731
    return {
        "broadcast_from(src=0)": _listed(kata.broadcast_from(mine(), 0)),
        f"broadcast_from(src={last})": _listed(kata.broadcast_from(mine(), last)),
        "reduce_to(dst=0)": _listed(kata.reduce_to(torch.tensor([rank + 1, 100]), 0)),
        f"reduce_to(dst={last})": _listed(kata.reduce_to(torch.tensor([rank + 1, 100]), last)),
        "bad": {
            f"broadcast_from(src={world_size})": refusal(
                lambda: kata.broadcast_from(mine(), world_size)
            ),
            "reduce_to(dst=-1)": refusal(lambda: kata.reduce_to(mine(), -1)),
        },
    }


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size", SIZES)
def test_broadcast_and_reduce(world_size):
    results = _run(
        _broadcast_and_reduce, world_size, hint="a collective deadlocked: every rank must call it."
    )
    last = world_size - 1
    for src in (0, last):
        _check(
            results,
            f"broadcast_from(src={src})",
            lambda r: [10 * src + 1, 10 * src + 2],  # noqa: B023
            f"every rank ends up with rank {src}'s tensor: dist.broadcast(tensor, src={src}) on every rank",
        )
    total = [world_size * (world_size + 1) // 2, 100 * world_size]
    for dst in (0, last):
        _check(
            results,
            f"reduce_to(dst={dst})",
            lambda r: total if r == dst else None,  # noqa: B023
            f"rank {dst} returns the sum of every rank's tensor; the other ranks return None, "
            "because after a reduce their tensors hold partial sums that mean nothing",
        )
    _no_refusal_missing(results)


# ------------------------------------------------------------------------------ step 2


def _all_reduce_ops(rank, world_size):
    kata = load_kata(KATA)
    return {
        "sum": _listed(kata.all_reduce_with(torch.tensor([rank + 1, -rank]), "sum")),
        "max": _listed(kata.all_reduce_with(torch.tensor([(rank * 7) % 5, -rank]), "max")),
        "avg": _listed(kata.all_reduce_with(torch.tensor([2.0 * rank, 6.0]), "avg")),
        "bad": {
            "all_reduce_with(t, 'median')": refusal(
                lambda: kata.all_reduce_with(torch.ones(1), "median")
            )
        },
    }


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", SIZES)
def test_all_reduce_with_sum_max_avg(world_size):
    results = _run(
        _all_reduce_ops, world_size, hint="all_reduce deadlocked: every rank must call it."
    )
    ranks = range(world_size)
    _check(
        results,
        "sum",
        lambda r: [sum(q + 1 for q in ranks), -sum(ranks)],
        "every rank holds the sum of every rank's tensor: ReduceOp.SUM",
    )
    _check(
        results,
        "max",
        lambda r: [max((q * 7) % 5 for q in ranks), 0],
        "every rank holds the element-wise largest: ReduceOp.MAX",
    )
    mean = [float(world_size - 1), 6.0]
    for rank, got in enumerate(results):
        if got["avg"] == [2.0 * sum(ranks), 6.0 * world_size]:
            pytest.fail(
                f"'avg': rank {rank} got {got['avg']}, the sum; expected the mean {mean}: "
                "use ReduceOp.AVG (or divide the sum by the world size)",
                pytrace=False,
            )
    _check(results, "avg", lambda r: mean, "every rank holds the element-wise mean: ReduceOp.AVG")
    _no_refusal_missing(results)


# ------------------------------------------------------------------------------ step 3


def _table(world_size, base=100):
    """One row per rank: row r is [base + 10 r, base + 10 r + 1, base + 10 r + 2]."""
    return torch.tensor([[base + 10 * r + i for i in range(3)] for r in range(world_size)])


def _scatter_and_gather(rank, world_size):
    kata, last = load_kata(KATA), world_size - 1
    out = {}
    for src in (0, last):
        table = _table(world_size) if rank == src else None  # only src has the table
        out[f"scatter_rows(src={src})"] = _listed(
            kata.scatter_rows(table, src, torch.zeros(3, dtype=torch.int64))
        )
    for dst in (0, last):
        out[f"gather_rows(dst={dst})"] = _listed(
            kata.gather_rows(torch.tensor([rank, rank * rank]), dst)
        )
    out["bad"] = {
        "scatter_rows(table=None) on src": refusal(
            lambda: kata.scatter_rows(None, rank, torch.zeros(3))
        ),
        "scatter_rows(a table with one row too many) on src": refusal(
            lambda: kata.scatter_rows(_table(world_size + 1), rank, torch.zeros(3))
        ),
    }
    return out


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", SIZES)
def test_scatter_and_gather(world_size):
    results = _run(
        _scatter_and_gather,
        world_size,
        hint="scatter or gather deadlocked: every rank calls it, not only src or dst (the others pass "
        "None as the list).",
    )
    rows = _table(world_size).tolist()
    for src in (0, world_size - 1):
        _check(
            results,
            f"scatter_rows(src={src})",
            lambda r: rows[r],
            f"rank r gets row r of rank {src}'s table: dist.scatter(out, scatter_list=list of rows "
            "(on src only), src=src)",
        )
    for dst in (0, world_size - 1):
        _check(
            results,
            f"gather_rows(dst={dst})",
            lambda r: [[q, q * q] for q in range(world_size)] if r == dst else None,  # noqa: B023
            f"rank {dst} gets every rank's row, in rank order; the others return None "
            "(gather_list is a list of empty rows on dst, None elsewhere)",
        )
    _no_refusal_missing(results)


# ------------------------------------------------------------------------------ step 4


def _pieces(rank, world_size):
    """Rank ``rank``'s table for reduce_scatter: row j is [100 rank + j, 1]."""
    return torch.tensor([[100 * rank + j, 1] for j in range(world_size)])


def _gather_and_reduce_scatter(rank, world_size):
    kata = load_kata(KATA)
    summed = kata.reduce_scatter_rows(_pieces(rank, world_size))
    return {
        "all_gather_rows": _listed(kata.all_gather_rows(torch.tensor([rank, 10 + rank]))),
        "reduce_scatter_rows": _listed(summed),
        "all_gather_rows(reduce_scatter_rows(table))": _listed(kata.all_gather_rows(summed)),
        "bad": {
            "reduce_scatter_rows(a table with one row too few)": refusal(
                lambda: kata.reduce_scatter_rows(_pieces(rank, world_size - 1))
            )
        },
    }


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", SIZES)
def test_all_gather_and_reduce_scatter(world_size):
    results = _run(
        _gather_and_reduce_scatter,
        world_size,
        hint="a collective deadlocked: every rank must call it.",
    )
    ranks = range(world_size)
    _check(
        results,
        "all_gather_rows",
        lambda r: [[q, 10 + q] for q in ranks],
        "every rank gets every rank's row, in rank order (allocate a list of empty rows first)",
    )
    _check(
        results,
        "reduce_scatter_rows",
        lambda r: [100 * sum(ranks) + world_size * r, world_size],
        "rank r gets the sum over all ranks of their row r",
    )
    everything = sum(_pieces(q, world_size) for q in ranks).tolist()
    _check(
        results,
        "all_gather_rows(reduce_scatter_rows(table))",
        lambda r: everything,
        "reduce_scatter then all_gather is an all-reduce: every rank ends with the sum of all tables",
    )
    _no_refusal_missing(results)


# ------------------------------------------------------------------------------ step 5


def _all_to_all(rank, world_size):
    kata = load_kata(KATA)
    table = torch.tensor([[10 * rank + j, rank] for j in range(world_size)])
    return {
        "all_to_all_rows": _listed(kata.all_to_all_rows(table)),
        "bad": {
            "all_to_all_rows(a table with one row too many)": refusal(
                lambda: kata.all_to_all_rows(torch.zeros(world_size + 1, 2))
            )
        },
    }


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size", SIZES)
def test_all_to_all(world_size):
    results = _run(_all_to_all, world_size, hint="all_to_all deadlocked: every rank must call it.")
    _check(
        results,
        "all_to_all_rows",
        lambda r: [[10 * i + r, i] for i in range(world_size)],
        "row j of rank i becomes row i of rank j (a transpose): rank r collects row r of every "
        "rank, in rank order",
    )
    _no_refusal_missing(results)


# ------------------------------------------------------------------------------ step 6

_LATE_S = 0.3  # rank 0 arrives this late, so a rank that does not wait finds no file
_WAIT_FOR_PEERS_S = 5.0


def _prepare_once(rank, world_size, path):
    calls = []

    def prepare():
        calls.append(rank)
        return (
            "prepared by rank 0"
            if rank == 0
            else f"prepared by rank {rank}, which should not prepare"
        )

    arrived = [f"{path}.rank{r}-arrived" for r in range(1, world_size)]
    if rank == 0:  # late for certain: only after every other rank has arrived, and then some
        give_up = time.monotonic() + _WAIT_FOR_PEERS_S
        while not all(map(os.path.exists, arrived)) and time.monotonic() < give_up:
            time.sleep(0.01)
        time.sleep(_LATE_S)
    else:
        open(arrived[rank - 1], "w").close()
    try:
        text = load_kata(KATA).prepare_once(path, prepare)
    except FileNotFoundError:
        text = FileNotFoundError
    return {"text": text, "prepared": bool(calls)}


@pytest.mark.step(6)
@pytest.mark.parametrize("world_size", SIZES)
def test_prepare_once_waits_at_a_barrier(world_size, tmp_path):
    path = str(tmp_path / "prepared.txt")
    results = _run(
        _prepare_once,
        world_size,
        path,
        hint="prepare_once deadlocked: every rank, rank 0 included, must reach the barrier.",
    )
    for rank, got in enumerate(results):
        assert got["prepared"] == (rank == 0), (
            f"rank {rank} {'called' if got['prepared'] else 'did not call'} prepare(): only rank 0 "
            "prepares (think of a download: once is enough), the others wait for its file"
        )
        assert got["text"] is not FileNotFoundError, (
            f"rank {rank} looked for the file before rank 0 (which arrived {_LATE_S:g} s late) had "
            "written it: call dist.barrier() on every rank between rank 0's write and the reads"
        )
        assert got["text"] == "prepared by rank 0", (
            f"rank {rank} returned {got['text']!r}, expected the text rank 0 prepared, 'prepared by rank 0'"
        )
    assert os.path.exists(path), "nothing was written to the path"


# ------------------------------------------------------------------------------ step 7

_MEMBER_SETS = {2: ([1], [0, 1]), 3: ([0, 2], [1, 2]), 4: ([0, 2], [1, 2, 3])}


def _groups(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    for members in _MEMBER_SETS[world_size]:
        out[f"group_sum(members={members})"] = _listed(
            kata.group_sum(torch.tensor([rank + 1, 1]), members)
        )
    out["parity_sums"] = _listed(kata.parity_sums(torch.tensor([rank + 1, 1])))
    out["bad"] = {
        f"group_sum(members={bad})": refusal(lambda bad=bad: kata.group_sum(torch.ones(1), bad))
        for bad in ([], [0, 0], [world_size])
    }
    return out


@pytest.mark.step(7)
@pytest.mark.parametrize("world_size", SIZES)
def test_subgroups_touch_only_their_members(world_size):
    results = _run(
        _groups,
        world_size,
        hint="a subgroup deadlocked. Creating a group is a collective of the whole world: every rank "
        "calls dist.new_group for every group, members or not, in the same order; then only the "
        "members call the group's all_reduce.",
    )
    for members in _MEMBER_SETS[world_size]:
        inside = [sum(m + 1 for m in members), len(members)]
        _check(
            results,
            f"group_sum(members={members})",
            lambda r: inside if r in members else [r + 1, 1],  # noqa: B023
            f"the members {members} hold their sum; every other rank keeps its own tensor untouched",
        )
    _check(
        results,
        "parity_sums",
        lambda r: [
            sum(q + 1 for q in range(r % 2, world_size, 2)),
            len(range(r % 2, world_size, 2)),
        ],
        "each rank holds the sum over the ranks of its own parity (evens with evens, odds with odds)",
    )
    _no_refusal_missing(results)


# ------------------------------------------------------------------------------ the program


@pytest.mark.step(7)
def test_program_shows_every_collective():
    result = run_program(KATA, "--world-size", "4", timeout=120)
    assert result.returncode == 0, (
        f"the program failed (exit {result.returncode}):\n{result.stderr}"
    )
    out = result.stdout
    for lines in (
        ["[rank 0] --- reduce (sum) to rank 0", "[rank 0] 0 -> 6", "[rank 1] 1 -> None"],
        ["[rank 0] --- all_reduce avg", "[rank 0] 0.0 -> 1.5", "[rank 1] 1.0 -> 1.5"],
        ["[rank 0] --- all_to_all", "[rank 0] [0, 1, 2, 3] -> [0, 10, 20, 30]"],
        ["[rank 0] --- all_reduce in the group [0, 2]", "[rank 0] 0 -> 2", "[rank 1] 1 -> 1"],
        ["[main] 4 ranks ran every collective in the same order"],
    ):
        block = "\n".join(lines)
        assert block in out, (
            f"the program's output lacks these lines, in this order:\n{block}\n\nit printed:\n{out}"
        )
