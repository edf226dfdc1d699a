"""k01 spawn: the rank arithmetic, and a launcher that spawns, collects and joins."""

import os
import queue

import pytest

from dojo.impl import load_kata
from dojo.testing import run_program
from dojo.world import run_world

KATA = "k01_spawn"
# Set in the launching process only. A spawned child starts a fresh interpreter and imports this
# module again, so it must see None; a forked child would see the launcher's value.
_LAUNCHER_MARK = None


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "node, local, per_node, expected",
    [
        (0, 0, 3, 0),
        (0, 2, 3, 2),
        (1, 0, 3, 3),
        (1, 2, 3, 5),
        (3, 1, 4, 13),
        (0, 0, 1, 0),
        (5, 0, 1, 5),
    ],
)
def test_global_rank(kata, node, local, per_node, expected):
    got = kata.global_rank(node, local, per_node)
    why = (
        f"the {node * per_node} ranks of nodes 0..{node - 1} come first"
        if node
        else "on node 0 the rank is the local rank"
    )
    assert got == expected, (
        f"global_rank(node_rank={node}, local_rank={local}, nproc_per_node={per_node}) returned "
        f"{got!r}, expected {expected}: {why}"
    )


@pytest.mark.step(1)
def test_tutorial_layout_has_world_size_six(kata):
    got = kata.world_size_of(2, 3)
    assert got == 6, f"world_size_of(nnodes=2, nproc_per_node=3) returned {got!r}, expected 6"
    ranks = [kata.global_rank(node, local, 3) for node in range(2) for local in range(3)]
    assert ranks == list(range(6)), (
        f"the tutorial's 2 nodes x 3 processes got ranks {ranks}: every rank 0..5 must appear once"
    )


@pytest.mark.step(2)
def test_greet(kata):
    assert kata.greet(2, 4) == "world size:4. I'm rank 2.", (
        f"greet(2, 4) returned {kata.greet(2, 4)!r}, expected the tutorial's \"world size:4. I'm rank 2.\""
    )


def _answer(rank, world_size):
    return f"{rank} of {world_size}"


def _refuse(rank, world_size):
    raise ValueError(f"rank {rank} refuses")


@pytest.mark.step(3)
def test_run_rank_reports_the_answer_with_its_rank(kata):
    answers = queue.Queue()
    kata.run_rank(_answer, 2, 4, answers)
    got = answers.get_nowait() if not answers.empty() else None
    assert got == (2, "ok", "2 of 4"), (
        f"run_rank(fn, rank=2, world_size=4, answers) put {got!r} on the queue, expected "
        "(2, 'ok', fn(2, 4)): the launcher needs the rank to put answers back in order"
    )


@pytest.mark.step(3)
def test_run_rank_reports_an_error_instead_of_raising(kata):
    answers = queue.Queue()
    try:
        kata.run_rank(_refuse, 1, 3, answers)
    except ValueError:
        pytest.fail(
            "run_rank let fn's ValueError escape: catch it and put (rank, 'error', traceback) on the queue"
        )
    got = answers.get_nowait() if not answers.empty() else None
    assert got is not None and got[:2] == (1, "error"), (
        f"when fn raised, run_rank put {got!r} on the queue, expected (1, 'error', traceback_text)"
    )
    assert "ValueError: rank 1 refuses" in got[2] and "Traceback" in got[2], (
        f"the error text should be the full traceback (traceback.format_exc()), got {got[2]!r}"
    )


def _identify(rank, world_size):
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "mark": _LAUNCHER_MARK}


def _fail_on_rank_two(rank, world_size):
    if rank == 2:
        raise ValueError("rank two refuses")
    return rank


def _launch_in_isolation(_rank, _world_size, fn_name, world_size):
    """Runs inside one harness process, so a launcher that hangs or leaks is caught and cleaned."""
    global _LAUNCHER_MARK
    _LAUNCHER_MARK = "set in the launcher"
    kata = load_kata(KATA)
    fn = globals()[fn_name]
    try:
        answers = kata.launch(world_size, fn)
        outcome = ("returned", answers)
    except RuntimeError as error:
        if "context has already been set" in str(error):
            raise AssertionError(
                "launch called mp.set_start_method(), which may run only once per program (the test "
                "runner had already chosen one). Use mp.get_context('spawn') and start processes "
                "from that context instead."
            ) from error
        outcome = ("raised", type(error).__name__, str(error))
    import multiprocessing

    leftovers = [p.pid for p in multiprocessing.active_children()]
    return outcome, os.getpid(), leftovers


@pytest.mark.step(4)
def test_launch_spawns_and_collects_in_rank_order(kata):
    [(outcome, launcher_pid, leftovers)] = run_world(
        _launch_in_isolation, 1, "_identify", 4, init_group=False, deadline=60
    )
    assert outcome[0] == "returned", f"launch(4, fn) raised {outcome[1]}: {outcome[2]}"
    answers = outcome[1]
    assert isinstance(answers, list) and len(answers) == 4, (
        f"launch(4, fn) returned {answers!r}: expected a list of the 4 answers"
    )
    ranks = [a["rank"] for a in answers]
    assert ranks == [0, 1, 2, 3], (
        f"the answers came back for ranks {ranks}: return them in rank order (the queue delivers "
        "them in whatever order the processes finish)"
    )
    assert all(a["world_size"] == 4 for a in answers), "every rank must be told world_size=4"
    pids = {a["pid"] for a in answers}
    assert len(pids) == 4 and launcher_pid not in pids, (
        f"the 4 ranks ran in processes {sorted(pids)} (launcher {launcher_pid}): each rank needs a "
        "process of its own"
    )
    assert all(a["mark"] is None for a in answers), (
        "a rank saw the launcher's memory, so it was forked, not spawned: start processes from "
        "mp.get_context('spawn')"
    )
    assert not leftovers, (
        f"processes {leftovers} were still running after launch returned: join them"
    )


@pytest.mark.step(4)
def test_launch_names_the_rank_that_failed(kata):
    [(outcome, _, leftovers)] = run_world(
        _launch_in_isolation, 1, "_fail_on_rank_two", 3, init_group=False, deadline=60
    )
    assert outcome[0] == "raised", (
        f"rank 2 raised ValueError, but launch returned {outcome[1]!r}: a failed rank must make "
        "the launcher fail"
    )
    assert outcome[1] == "RankProcessFailed", (
        f"launch raised {outcome[1]}, expected the kata's RankProcessFailed"
    )
    message = outcome[2]
    assert "rank 2" in message and "rank two refuses" in message, (
        f"the error must name rank 2 and show its error, got: {message!r}"
    )
    assert "rank 0" not in message and "rank 1" not in message, (
        f"only rank 2 failed, but the error names other ranks too: {message!r}"
    )
    assert not leftovers, f"processes {leftovers} were still running after launch failed: join them"


@pytest.mark.step(4)
def test_program_prints_the_tutorial_lines(kata):
    """`python -m katas.k01_spawn` does what the tutorial's run_multiprocess.py does."""
    result = run_program(KATA, "--world-size", "4", timeout=90)
    assert result.returncode == 0, (
        f"the program failed (exit {result.returncode}):\n{result.stderr}"
    )
    for rank in range(4):
        line = f"[rank {rank}] world size:4. I'm rank {rank}."
        assert line in result.stdout.splitlines(), (
            f"expected the line {line!r} in:\n{result.stdout}"
        )
