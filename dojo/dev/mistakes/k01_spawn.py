"""k01's mistakes catalogue: real mistakes in rank arithmetic, the greeting, reporting a rank's
outcome and launching processes, and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises.

The launcher's stand-ins run in a harness rank (the test's launcher); the processes they start
run the kata's own ``run_rank`` (``_kata().run_rank``), and the ``run_rank`` stand-ins travel
into those processes by name when the reference's launch starts them.
"""

from __future__ import annotations

import queue
import time
import traceback

import torch.multiprocessing as mp

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness.impl import load_kata


def _kata():
    """The kata module under test (the reference, with this entry swapped in)."""
    return load_kata("k01_spawn")


# --------------------------------------------------------------------------- global_rank


def ranks_swapped(node_rank, local_rank, nproc_per_node):
    return local_rank * nproc_per_node + node_rank  # the node and the local rank trade places


def ranks_added(node_rank, local_rank, nproc_per_node):
    return node_rank + local_rank  # forgot that every node before holds nproc_per_node ranks


def ranks_from_one(node_rank, local_rank, nproc_per_node):
    return node_rank * nproc_per_node + local_rank + 1  # counts ranks from 1


def node_ignored(node_rank, local_rank, nproc_per_node):
    return local_rank  # the local rank taken for the global one: every node restarts at 0


def world_size_added(nnodes, nproc_per_node):
    return nnodes + nproc_per_node  # adds the nodes and the processes per node


# --------------------------------------------------------------------------- greet


def greet_with_a_space(rank, world_size):
    return f"world size: {world_size}. I'm rank {rank}."  # tidied the tutorial's text


def greet_prints(rank, world_size):
    print(f"world size:{world_size}. I'm rank {rank}.")  # prints instead of returning


def greet_swapped(rank, world_size):
    return f"world size:{rank}. I'm rank {world_size}."  # the two numbers trade places


# --------------------------------------------------------------------------- run_rank


def run_rank_without_status(fn, rank, world_size, answers):
    answers.put((rank, fn(rank, world_size)))  # no "ok": an answer cannot be told from an error


def run_rank_lets_it_escape(fn, rank, world_size, answers):
    answers.put((rank, "ok", fn(rank, world_size)))  # an error is lost; the launcher waits


def run_rank_reraises(fn, rank, world_size, answers):
    try:
        answers.put((rank, "ok", fn(rank, world_size)))
    except Exception:
        answers.put((rank, "error", traceback.format_exc()))
        raise  # "so that the process fails too"


def run_rank_message_only(fn, rank, world_size, answers):
    try:
        answers.put((rank, "ok", fn(rank, world_size)))
    except Exception as error:
        answers.put((rank, "error", str(error)))  # the message without its traceback


# --------------------------------------------------------------------------- launch


def _start(world_size, fn):
    fn = fn or _kata().greet
    context = mp.get_context("spawn")
    answers = context.Queue()
    processes = [
        context.Process(target=_kata().run_rank, args=(fn, rank, world_size, answers))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return answers, processes


def _outcome(messages, world_size):
    failed = {rank: text for rank, (status, text) in messages.items() if status == "error"}
    if failed:
        report = "\n".join(f"rank {rank} failed:\n{text}" for rank, text in sorted(failed.items()))
        raise _kata().RankProcessFailed(f"{len(failed)} of {world_size} ranks failed\n{report}")
    return [messages[rank][1] for rank in range(world_size)]


def in_arrival_order(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    results = []
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        if status == "error":
            raise _kata().RankProcessFailed(f"rank {rank} failed:\n{value}")
        results.append(value)  # in the order the ranks finished
    for process in processes:
        process.join()
    return results


def joins_before_collecting(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    for process in processes:
        process.join()  # waits for processes that wait for their answers to be read
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        messages[rank] = (status, value)
    return _outcome(messages, world_size)


def one_at_a_time(world_size, fn=None, timeout=180.0):
    fn = fn or _kata().greet
    context = mp.get_context("spawn")
    answers = context.Queue()
    messages = {}
    for rank in range(world_size):
        process = context.Process(target=_kata().run_rank, args=(fn, rank, world_size, answers))
        process.start()
        rank, status, value = answers.get(timeout=timeout)  # waits for it before the next
        process.join()
        messages[rank] = (status, value)
    return _outcome(messages, world_size)


def never_joined(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        messages[rank] = (status, value)
    return _outcome(messages, world_size)  # the processes are left to end on their own


def default_start_method(world_size, fn=None, timeout=180.0):
    fn = fn or _kata().greet
    answers = mp.Queue()
    processes = [  # mp.Process: the program's default start method, not necessarily spawn
        mp.Process(target=_kata().run_rank, args=(fn, rank, world_size, answers))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        messages[rank] = (status, value)
    for process in processes:
        process.join(timeout)
    return _outcome(messages, world_size)


def sets_the_start_method(world_size, fn=None, timeout=180.0):
    mp.set_start_method("spawn")  # as in the tutorial's __main__, but inside a function
    return default_start_method(world_size, fn, timeout)


def forces_the_start_method(world_size, fn=None, timeout=180.0):
    mp.set_start_method("spawn", force=True)  # "fixes" the error above for the whole program
    return default_start_method(world_size, fn, timeout)


def returns_the_failure(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        messages[rank] = value  # the traceback text takes the place of the answer
    for process in processes:
        process.join(timeout)
    return [messages[rank] for rank in range(world_size)]


def raises_runtime_error(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        messages[rank] = (status, value)
    for process in processes:
        process.join(timeout)
    failed = [rank for rank, (status, _) in sorted(messages.items()) if status == "error"]
    if failed:
        raise RuntimeError(f"rank {failed[0]} failed:\n{messages[failed[0]][1]}")
    return [messages[rank][1] for rank in range(world_size)]


def names_without_traceback(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        messages[rank] = (status, value)
    for process in processes:
        process.join(timeout)
    failed = [rank for rank, (status, _) in sorted(messages.items()) if status == "error"]
    if failed:
        raise _kata().RankProcessFailed(f"rank {failed[0]} failed")  # but not why
    return [messages[rank][1] for rank in range(world_size)]


def fails_fast_without_joining(world_size, fn=None, timeout=180.0):
    answers, processes = _start(world_size, fn)
    messages = {}
    for _ in range(world_size):
        rank, status, value = answers.get(timeout=timeout)
        if status == "error":  # give up at the first failure; the others are left running
            raise _kata().RankProcessFailed(f"rank {rank} failed:\n{value}")
        messages[rank] = (status, value)
    for process in processes:
        process.join(timeout)
    return [messages[rank][1] for rank in range(world_size)]


# Right answers written differently: the checks must accept every one.


def greet_by_concatenation(rank, world_size):
    return "world size:" + str(world_size) + ". I'm rank " + str(rank) + "."


def global_rank_by_counting(node_rank, local_rank, nproc_per_node):
    before = sum(nproc_per_node for _ in range(node_rank))  # the ranks of the nodes before
    return before + local_rank


def run_rank_with_exception_text(fn, rank, world_size, answers):
    try:
        answer = fn(rank, world_size)
    except BaseException as error:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        answers.put((rank, "error", text))
    else:
        answers.put((rank, "ok", answer))


def launch_polling(world_size, fn=None, timeout=180.0):
    """Polls the queue and notices a rank that died without answering (no waiting in vain); names
    the failed ranks as a list ("ranks [2] failed")."""
    answers, processes = _start(world_size, fn)
    results = [None] * world_size
    statuses = [None] * world_size
    deadline = time.monotonic() + timeout
    try:
        while None in statuses:
            try:
                rank, status, value = answers.get(timeout=0.1)
            except queue.Empty:
                silent = [r for r in range(world_size) if statuses[r] is None]
                dead = [r for r in silent if processes[r].exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise _kata().RankProcessFailed(
                        f"rank(s) {dead or silent} ended or went silent without an answer"
                    ) from None
                continue
            results[rank], statuses[rank] = value, status
    finally:
        for process in processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
    errors = [r for r in range(world_size) if statuses[r] == "error"]
    if errors:  # the failed ranks named as a list, as a real student's launcher did
        raise _kata().RankProcessFailed(
            f"ranks {errors} failed:\n" + "\n".join(results[r] for r in errors)
        )
    return results


def _start_processes_entry(index, fn, world_size, answers):
    _kata().run_rank(fn, index, world_size, answers)


def launch_with_start_processes(world_size, fn=None, timeout=180.0):
    """torch.multiprocessing's own launcher (what mp.spawn runs), without its join=True."""
    fn = fn or _kata().greet
    answers = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _start_processes_entry,
        args=(fn, world_size, answers),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    messages = dict(
        (rank, (status, value))
        for rank, status, value in (answers.get(timeout=timeout) for _ in range(world_size))
    )
    while not context.join(timeout):
        pass
    return _outcome(messages, world_size)


# --------------------------------------------------------------------------- the catalogue

_IN_ORDER = "test_launch_spawns_and_collects_in_rank_order"
_BIG = "test_launch_reads_big_answers_before_joining"
_FAILED = "test_launch_names_the_rank_that_failed"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "ranks_swapped",
        replaces="global_rank",
        fails=[
            "test_global_rank[node0-local2-of3]",
            "test_global_rank[node1-local2-of3]",
            "test_global_rank[node3-local1-of4]",
            "test_tutorial_layout_numbers_every_rank_once",
        ],
        says=["node_rank and local_rank are swapped"],
    ),
    Mistake(
        "ranks_added",
        replaces="global_rank",
        fails=[
            "test_global_rank[node1-local0-of3]",
            "test_global_rank[node1-local2-of3]",
            "test_global_rank[node3-local1-of4]",
        ],
        says=["were added", "multiply node_rank by nproc_per_node"],
    ),
    Mistake(
        "ranks_from_one",
        replaces="global_rank",
        fails=["test_global_rank"],
        says=["ranks count from 0"],
    ),
    Mistake(
        "node_ignored",
        replaces="global_rank",
        fails=["test_global_rank[node1-local0-of3]"],
        says=["the 3 ranks of node 0 come first"],
    ),
    Mistake(
        "world_size_added",
        replaces="world_size_of",
        fails=["test_world_size_of"],
        says=["nnodes + nproc_per_node", "multiply"],
    ),
    Mistake(
        "greet_with_a_space",
        replaces="greet",
        fails=["test_greet"],
        says=["only the spaces differ", "no space after 'world size:'"],
    ),
    Mistake(
        "greet_prints",
        replaces="greet",
        fails=["test_greet"],
        says=["greet returned None", "instead of returning it"],
    ),
    Mistake(
        "greet_swapped",
        replaces="greet",
        fails=["test_greet"],
        says=["are swapped", "gets the rank first"],
    ),
    Mistake(
        "run_rank_without_status",
        replaces="run_rank",
        fails=["test_run_rank_reports_the_answer_with_its_rank"],
        says=["put (2, '2 of 4')", "the status 'ok'"],
    ),
    Mistake(
        "run_rank_lets_it_escape",
        replaces="run_rank",
        fails=["test_run_rank_reports_an_error_instead_of_raising"],
        says=["escape and put nothing on the queue", "wait for an answer that never comes"],
    ),
    Mistake(
        "run_rank_reraises",
        replaces="run_rank",
        fails=["test_run_rank_reports_an_error_instead_of_raising"],
        says=["then raised fn's ValueError again", "Report the error on the queue and return"],
    ),
    Mistake(
        "run_rank_message_only",
        replaces="run_rank",
        fails=["test_run_rank_reports_an_error_instead_of_raising"],
        says=["reported 'rank 1 refuses'", "traceback.format_exc()"],
    ),
    Mistake(
        "in_arrival_order",
        replaces="launch",
        fails=[_IN_ORDER],
        says=["in the order they arrived", "keep them by the rank each message carries"],
    ),
    Mistake(
        "joins_before_collecting",
        replaces="launch",
        fails=[_BIG],
        says=["waiting in process.join()", "Read every answer first"],
    ),
    Mistake(
        "one_at_a_time",
        replaces="launch",
        fails=[_IN_ORDER],
        says=["ran one after another", "Start every process first"],
    ),
    Mistake(
        "never_joined",
        replaces="launch",
        fails=["test_launch_spawns_and_collects_in_rank_order", _FAILED],
        says=["without joining the processes it started", "call process.join() on every process"],
    ),
    Mistake(
        "default_start_method",
        replaces="launch",
        fails=[_IN_ORDER],
        says=["was not spawned", "mp.get_context('spawn')"],
    ),
    Mistake(
        "sets_the_start_method",
        replaces="launch",
        fails=[_IN_ORDER],
        says=["may run only once per program", "mp.get_context('spawn')"],
    ),
    Mistake(
        "forces_the_start_method",
        replaces="launch",
        fails=[_IN_ORDER],
        says=["changed the program's start method", "mp.get_context('spawn')"],
    ),
    Mistake(
        "returns_the_failure",
        replaces="launch",
        fails=[_FAILED],
        says=["but launch returned", "raise RankProcessFailed naming it"],
    ),
    Mistake(
        "raises_runtime_error",
        replaces="launch",
        fails=[_FAILED],
        says=["launch raised RuntimeError", "expected the kata's RankProcessFailed"],
    ),
    Mistake(
        "names_without_traceback",
        replaces="launch",
        fails=[_FAILED],
        says=["must show rank 2's traceback"],
    ),
    Mistake(
        "fails_fast_without_joining",
        replaces="launch",
        fails=[_FAILED],
        says=["launch raised without joining", "call process.join() on every process"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("global_rank_by_counting", replaces="global_rank"),
    RightAnswer("greet_by_concatenation", replaces="greet"),
    RightAnswer("run_rank_with_exception_text", replaces="run_rank"),
    RightAnswer("launch_polling", replaces="launch"),
    RightAnswer("launch_with_start_processes", replaces="launch"),
]
