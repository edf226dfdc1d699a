"""k01 spawn: the rank arithmetic, and a launcher that spawns, collects and joins."""

import json
import linecache
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

import pytest

from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.lang import t
from dojo.spec.testing import run_module_ok
from dojo.todo import KataTodo

KATA = "k01_spawn"
# Set in the launching process only. A spawned child starts a fresh interpreter and imports this
# module again, so it must see None; a forked child would see the launcher's value.
_LAUNCHER_MARK = None
# The folder where the ranks that launch starts leave their pids and say when their work is done.
_FOLDER_VAR = "DOJO_K01_FOLDER"

# --------------------------------------------------------------------------- step 1: arithmetic


# Formulas a learner writes instead of node_rank * nproc_per_node + local_rank; one wrong answer
# alone can fit two of them (node 1, local 0, 3 per node: swapped and added both give 1), so the
# learner's function is tried on several layouts before one is named.
_WRONG_FORMULAS = {
    "swapped": lambda node, local, per_node: local * per_node + node,
    "added": lambda node, local, per_node: node + local,
    "from one": lambda node, local, per_node: node * per_node + local + 1,
}
_PROBES = [(1, 2, 3), (3, 1, 4), (2, 0, 5), (1, 0, 3), (0, 2, 3)]


def _formula_of(kata) -> str | None:
    try:
        got = {probe: kata.global_rank(*probe) for probe in _PROBES}
    except KataTodo:
        raise
    except Exception:  # the failing call itself is reported by the test
        return None
    for name, formula in _WRONG_FORMULAS.items():
        if all(got[probe] == formula(*probe) for probe in _PROBES):
            return name
    return None


def _explain_global_rank(kata, node: int, local: int, per_node: int, got) -> str:
    expected = node * per_node + local
    formula = _formula_of(kata)
    if formula == "swapped" or (formula is None and got == local * per_node + node):
        return t(
            "node_rank and local_rank are swapped: the node picks the block of nproc_per_node "
            "ranks (node_rank * nproc_per_node), the local rank the place inside that block"
        )
    if formula == "added" or (formula is None and got == node + local):
        return t(
            "node_rank and local_rank were added: each node before this one "
            "holds nproc_per_node ranks, so multiply node_rank by nproc_per_node"
        )
    if formula == "from one" or got == expected + 1:
        return t("one too many: ranks count from 0 (local rank 0 on node 0 is rank 0)")
    if node:
        if node == 1:
            nodes = t("node 0")
        elif node == 2:
            nodes = t("nodes 0 and 1")
        else:
            nodes = t("nodes 0 to {last}", last=node - 1)
        return t("the {count} ranks of {nodes} come first", count=node * per_node, nodes=nodes)
    return t("on node 0 the rank is the local rank")


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "node, local, per_node, expected",
    [
        pytest.param(0, 0, 3, 0, id="node0-local0-of3"),
        pytest.param(0, 2, 3, 2, id="node0-local2-of3"),
        pytest.param(1, 0, 3, 3, id="node1-local0-of3"),
        pytest.param(1, 2, 3, 5, id="node1-local2-of3"),
        pytest.param(3, 1, 4, 13, id="node3-local1-of4"),
        pytest.param(0, 0, 1, 0, id="node0-local0-of1"),
        pytest.param(5, 0, 1, 5, id="node5-local0-of1"),
    ],
)
def test_global_rank(kata, node, local, per_node, expected):
    got = kata.global_rank(node, local, per_node)
    assert got == expected, t(
        "global_rank(node_rank={node}, local_rank={local}, nproc_per_node={per_node}) returned "
        "{got!r}, expected {expected}: {why}",
        node=node,
        local=local,
        per_node=per_node,
        got=got,
        expected=expected,
        why=_explain_global_rank(kata, node, local, per_node, got),
    )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "nnodes, per_node, expected",
    [
        pytest.param(2, 3, 6, id="2-nodes-of-3"),
        pytest.param(1, 4, 4, id="1-node-of-4"),
        pytest.param(4, 8, 32, id="4-nodes-of-8"),
        pytest.param(3, 1, 3, id="3-nodes-of-1"),
    ],
)
def test_world_size_of(kata, nnodes, per_node, expected):
    got = kata.world_size_of(nnodes, per_node)
    if got == nnodes + per_node and got != expected:
        why = t(
            "it looks like nnodes + nproc_per_node: every node runs nproc_per_node processes, "
            "so multiply"
        )
    else:
        why = t("every one of the nnodes nodes runs nproc_per_node processes")
    assert got == expected, t(
        "world_size_of(nnodes={nnodes}, nproc_per_node={per_node}) returned {got!r}, expected "
        "{expected}: {why}",
        nnodes=nnodes,
        per_node=per_node,
        got=got,
        expected=expected,
        why=why,
    )


@pytest.mark.step(1)
def test_tutorial_layout_numbers_every_rank_once(kata):
    layout = [(node, local) for node in range(2) for local in range(3)]
    ranks = [kata.global_rank(node, local, 3) for node, local in layout]
    wrong = [(n, lo, r) for (n, lo), r in zip(layout, ranks) if r != n * 3 + lo]
    assert not wrong, t(
        "the tutorial's 2 nodes x 3 processes got ranks {ranks} (node 0's local ranks 0, 1, 2, "
        "then node 1's): expected [0, 1, 2, 3, 4, 5], every rank once; {why}",
        ranks=ranks,
        why=_explain_global_rank(kata, wrong[0][0], wrong[0][1], 3, wrong[0][2]),
    )


# --------------------------------------------------------------------------- step 2: the greeting


def _explain_greeting(got, rank: int, world_size: int) -> str:
    expected = f"world size:{world_size}. I'm rank {rank}."
    if got is None:
        return t(
            "greet returned None: return the line (print_greeting prints it); did you print it "
            "instead of returning it?"
        )
    if not isinstance(got, str):
        return t(
            "greet returned a {type_name}: return the line as a str", type_name=type(got).__name__
        )
    if got == f"world size:{rank}. I'm rank {world_size}.":
        return t(
            "the rank and the world size are swapped: greet(rank, world_size) gets the rank first"
        )
    if got.strip() == expected:
        return t("remove the spaces or newline at the ends")
    if got.replace(" ", "") == expected.replace(" ", ""):
        return t(
            "only the spaces differ: the tutorial writes no space after 'world size:' and one "
            "after the full stop"
        )
    if got.lower() == expected.lower():
        return t("only capital letters differ: copy the tutorial's text exactly")
    at = next(
        (i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))
    )
    return t(
        "they differ from character {at} on: {got!r} where the tutorial has {expected!r}",
        at=at,
        got=got[at : at + 12],
        expected=expected[at : at + 12],
    )


@pytest.mark.step(2)
@pytest.mark.parametrize("rank, world_size", [(2, 4), (0, 1)])
def test_greet(kata, rank, world_size):
    got = kata.greet(rank, world_size)
    expected = f"world size:{world_size}. I'm rank {rank}."
    assert got == expected, t(
        "greet({rank}, {world_size}) returned {got!r}, expected the tutorial's {expected!r}: {why}",
        rank=rank,
        world_size=world_size,
        got=got,
        expected=expected,
        why=_explain_greeting(got, rank, world_size),
    )


# --------------------------------------------------------------------------- step 3: one rank


def _answer(rank, world_size):
    return f"{rank} of {world_size}"


def _refuse(rank, world_size):
    raise ValueError(f"rank {rank} refuses")


def _drain(answers: queue.Queue) -> list:
    messages = []
    while not answers.empty():
        messages.append(answers.get_nowait())
    return messages


@pytest.mark.step(3)
def test_run_rank_reports_the_answer_with_its_rank(kata):
    answers = queue.Queue()
    kata.run_rank(_answer, 2, 4, answers)
    messages = _drain(answers)
    expected = (2, "ok", "2 of 4")
    assert messages, t(
        "run_rank(fn, rank=2, world_size=4, answers) put nothing on the queue: a spawned process "
        "cannot return a value to its parent, so put (rank, 'ok', fn(rank, world_size)) on it"
    )
    assert len(messages) == 1, t(
        "run_rank put {count} messages on the queue ({messages!r}): the launcher reads exactly "
        "one per rank",
        count=len(messages),
        messages=messages,
    )
    assert messages[0] == expected, t(
        "run_rank(fn, rank=2, world_size=4, answers) put {got!r} on the queue, expected "
        "{expected!r}: a 3-tuple of the rank (the launcher needs it to put answers back in rank "
        "order), the status 'ok' and fn(rank, world_size)'s answer",
        got=messages[0],
        expected=expected,
    )


@pytest.mark.step(3)
def test_run_rank_reports_an_error_instead_of_raising(kata):
    answers = queue.Queue()
    escaped = None
    try:
        kata.run_rank(_refuse, 1, 3, answers)
    except KataTodo:
        raise
    except Exception as error:
        escaped = error
    messages = _drain(answers)
    if escaped is not None and not messages:
        pytest.fail(
            t(
                "run_rank let fn's {error_type} escape and put nothing on the queue: in a spawned "
                "process the launcher would wait for an answer that never comes. Catch the "
                "exception and put (rank, 'error', traceback.format_exc()) on the queue instead",
                error_type=type(escaped).__name__,
            )
        )
    if escaped is not None:
        pytest.fail(
            t(
                "run_rank put {message!r} on the queue, then raised fn's {error_type} again: a "
                "spawned process would print a second traceback and end with an error. Report "
                "the error on the queue and return",
                message=messages[0],
                error_type=type(escaped).__name__,
            )
        )
    assert len(messages) == 1, t(
        "when fn raised, run_rank put {count} messages on the queue ({messages!r}): expected "
        "exactly one, (1, 'error', traceback_text)",
        count=len(messages),
        messages=messages,
    )
    got = messages[0]
    assert isinstance(got, tuple) and len(got) == 3 and got[:2] == (1, "error"), t(
        "when fn raised, run_rank put {got!r} on the queue, expected (1, 'error', "
        "traceback_text): the rank, the status 'error' and the traceback's text",
        got=got,
    )
    assert (
        isinstance(got[2], str) and "Traceback" in got[2] and "ValueError: rank 1 refuses" in got[2]
    ), t(
        "when fn raised ValueError('rank 1 refuses'), run_rank reported {got!r}: report the "
        "full traceback text, traceback.format_exc(), so the launcher can show where it failed",
        got=got[2],
    )


# --------------------------------------------------------------------------- step 4: the launcher
#
# The functions below run in the processes that the learner's launch starts. Each rank leaves its
# pid in a folder (the launcher's environment names it), so the test can tell whether the ranks
# really ran side by side and whether launch joined them. To prove that launch puts the answers in
# rank order, rank r returns only after rank r + 1's answer is on its way to the queue: the answers
# then arrive in reverse rank order, every time.


def _write(folder: str, name: str, text: str) -> None:
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _read(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read()
    except OSError:
        return None


def _pid_of(folder: str, rank: int) -> int | None:
    text = _read(folder, f"rank{rank}.pid")
    return int(text) if text else None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None if it is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _has_proc() -> bool:
    return os.path.isdir("/proc/self")


def _state(pid: int, parent: int) -> str:
    """'running', 'zombie' (ended, not joined) or 'gone' (joined), for a child of ``parent``."""
    stat = _proc_stat(pid)
    if stat is None or stat[1] != parent:
        return "gone"
    return "zombie" if stat[0] in ("Z", "X") else "running"


def _spawned_children(parent: int) -> set[int]:
    """The processes ``parent`` has spawned and that are still running (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is None or stat[1] != parent:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.add(int(entry))
        except OSError:
            continue
    return found


def _ranks_started(folder: str, world_size: int, grace: float = 1.0) -> int | None:
    """How many of the world's processes the launcher has started (None where /proc is missing).

    A launcher that starts every process first has started them all long before any of them gets
    here (each has imported torch since); one that waits for each rank before starting the next
    has started only this one.
    """
    if not _has_proc():
        return None
    end = time.monotonic() + grace
    while True:
        known = _spawned_children(os.getppid())
        known |= {p for p in (_pid_of(folder, r) for r in range(world_size)) if p is not None}
        if len(known) >= world_size or time.monotonic() > end:
            return len(known)
        time.sleep(0.05)


def _wait_for(folder: str, rank: int, what: str, limit: float = 30.0) -> bool:
    """Until rank ``rank`` has sent its answer (``what="sent"``) or its process has ended."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if what == "sent" and _read(folder, f"rank{rank}.sent") is not None:
            time.sleep(0.3)  # it was being pickled to go on the queue: let it get there first
            return True
        pid = _pid_of(folder, rank)
        if what == "ended" and pid is not None:
            if _has_proc():
                if _state(pid, os.getppid()) != "running":
                    return True
            elif _read(folder, f"rank{rank}.done") is not None:
                time.sleep(0.5)  # no /proc: give its answer a moment to reach the queue
                return True
        time.sleep(0.02)
    return False


class _Sent:
    """Part of a rank's answer: when its process pickles it to put it on the queue, it leaves a
    mark (the launcher receives the text "sent" in its place)."""

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank = folder, rank

    def __reduce__(self):
        _write(self.folder, f"rank{self.rank}.sent", "")
        return (str, ("sent",))


def _start_rank(rank: int, world_size: int, *, after: list[int], what: str = "sent") -> dict:
    """What every test rank does first: leave its pid, then wait for the ranks in ``after``."""
    folder = os.environ[_FOLDER_VAR]
    _write(folder, f"rank{rank}.pid", str(os.getpid()))
    started = _ranks_started(folder, world_size) if _LAUNCHER_MARK is None else None
    alone = started is not None and started < world_size
    if not alone:
        for other in after:
            _wait_for(folder, other, what)
    return {
        "rank": rank,
        "world_size": world_size,
        "pid": os.getpid(),
        "parent": os.getppid(),
        "mark": _LAUNCHER_MARK,
        "started": started,
        "sent": _Sent(folder, rank),
    }


def _finish_rank(rank: int, report: dict) -> dict:
    folder = os.environ[_FOLDER_VAR]
    shown = {k: v for k, v in report.items() if k != "sent"}
    _write(folder, f"rank{rank}.done", json.dumps({**shown, "at": time.monotonic()}))
    return report


def _identify(rank, world_size):
    """Answers in reverse rank order: rank r answers once rank r + 1's answer is on its way."""
    report = _start_rank(rank, world_size, after=[rank + 1] if rank + 1 < world_size else [])
    return _finish_rank(rank, report)


def _big_answer(rank, world_size):
    """An answer far bigger than a pipe holds (64 KiB): its process ends only once it is read."""
    report = _start_rank(rank, world_size, after=[])
    return {**_finish_rank(rank, report), "blob": b"x" * (512 * 1024)}


def _fail_on_rank_two(rank, world_size):
    """Rank 2 raises at once; the others answer once its process has ended (its error came first)."""
    report = _start_rank(rank, world_size, after=[] if rank == 2 else [2], what="ended")
    if rank == 2:
        _finish_rank(rank, report)
        raise ValueError("rank two refuses")
    return _finish_rank(rank, report)["rank"]


class _LaunchStuck(BaseException):
    """Raised in the launcher's main thread (by a signal) when launch can no longer finish."""


# How long a rank that has done its work may stay blocked writing its answer into the queue's
# pipe while launch is not reading, before the test calls it a deadlock: a launcher that reads
# unblocks it within moments, whatever the load.
_STUCK_AFTER_S = 5.0


def _blocked_writing(pid: int) -> bool:
    """Whether a thread of process ``pid`` sleeps in the kernel writing to a full pipe."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/wchan") as f:
                if "pipe_w" in f.read():  # pipe_write, anon_pipe_write, pipe_wait_writable
                    return True
        except OSError:
            continue
    return False


class _Watchdog(threading.Thread):
    """Watches the learner's launch from a thread of the launcher process: if ranks that finished
    their work stay blocked writing their answers while launch does not read them, it interrupts
    launch with ``_LaunchStuck`` (a deadlock would otherwise last until the harness's deadline)."""

    def __init__(self, folder: str, world_size: int):
        super().__init__(daemon=True)
        self.folder, self.world_size = folder, world_size
        self.main = threading.main_thread().ident
        self.finished = threading.Event()
        self.report = ""

    def run(self) -> None:
        fired, since = 0, {}
        while not self.finished.wait(0.2) and fired < 3:
            reading = self._main_thread_place()[0] == "reading"
            blocked = [] if reading else self._blocked_ranks()
            since = {rank: since.get(rank, time.monotonic()) for rank in blocked}
            stuck = [r for r, began in since.items() if time.monotonic() - began > _STUCK_AFTER_S]
            if stuck:
                self.report = self._describe(stuck)
                fired += 1
                os.kill(os.getpid(), signal.SIGUSR2)
                since = {}

    def _blocked_ranks(self) -> list[int]:
        blocked = []
        for rank in range(self.world_size):
            pid = _pid_of(self.folder, rank)
            done = _read(self.folder, f"rank{rank}.done") is not None
            if pid is not None and done and _blocked_writing(pid):
                blocked.append(rank)
        return blocked

    def _main_thread_place(self) -> tuple[str, str]:
        """("reading" | "joining" | "elsewhere", where in launch) for the launcher's main thread."""
        frame = sys._current_frames().get(self.main)
        place, where = "elsewhere", ""
        while frame is not None:
            code = frame.f_code
            path = code.co_filename.replace(os.sep, "/")
            if code.co_name == "get" and path.endswith("multiprocessing/queues.py"):
                place = "reading"
            elif code.co_name == "join" and "multiprocessing/" in path and place != "reading":
                place = "joining"
            if code.co_name == "launch" and not where:
                line = linecache.getline(code.co_filename, frame.f_lineno).strip()
                where = t("line {number} of launch, `{line}`", number=frame.f_lineno, line=line)
            frame = frame.f_back
        return place, where

    def _describe(self, stuck: list[int]) -> str:
        ranks = ", ".join(map(str, stuck))
        place, where = self._main_thread_place()
        waiting = t("waiting in process.join()") if place == "joining" else t("not reading them")
        return t(
            "rank(s) {ranks} finished fn and are blocked putting their answers (half a MiB each) "
            "on the queue, while launch is {waiting}{where}. A process that put something on a "
            "multiprocessing Queue ends only once the other side has read it, so joining before "
            "reading the answers deadlocks as soon as an answer is bigger than the pipe (64 "
            "KiB). Read every answer first (answers.get), then join the processes.",
            ranks=ranks,
            waiting=waiting,
            where=f" ({where})" if where else "",
        )


def _raise_stuck(signum, frame):
    raise _LaunchStuck()


def _leftovers(folder: str, world_size: int) -> dict[int, str]:
    """Rank -> 'running' or 'zombie' for every rank process launch did not join."""
    left = {}
    if _has_proc():
        for rank in range(world_size):
            pid = _pid_of(folder, rank)
            if pid is not None and (state := _state(pid, os.getpid())) != "gone":
                left[rank] = state
    else:
        alive = {p.pid for p in multiprocessing.active_children()}
        for rank in range(world_size):
            if _pid_of(folder, rank) in alive:
                left[rank] = "running"
    return left


def _kill_leftovers(folder: str, world_size: int) -> None:
    for rank in range(world_size):
        pid = _pid_of(folder, rank)
        if pid is not None and _state(pid, os.getpid()) != "gone":
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (OSError, ChildProcessError):
                pass


def _launch_in_isolation(_rank, _world_size, fn_name, world_size):
    """Runs inside one harness process, so a launcher that hangs or leaks is caught and cleaned."""
    global _LAUNCHER_MARK
    _LAUNCHER_MARK = "set in the launcher"
    folder = tempfile.mkdtemp(prefix="dojo-k01-")
    os.environ[_FOLDER_VAR] = folder
    try:
        return _launch_and_watch(folder, fn_name, world_size)
    finally:
        _kill_leftovers(folder, world_size)
        shutil.rmtree(folder, ignore_errors=True)


def _launch_and_watch(folder: str, fn_name: str, world_size: int) -> dict:
    # As in a real program that has used multiprocessing already, the start method is chosen.
    method = multiprocessing.get_start_method()
    kata = load_kata(KATA)
    watchdog = _Watchdog(folder, world_size)
    signal.signal(signal.SIGUSR2, _raise_stuck)
    watchdog.start()
    try:
        answers = kata.launch(world_size, globals()[fn_name])
        outcome = ("returned", answers)
    except _LaunchStuck:
        outcome = ("stuck", watchdog.report)
    except KataTodo:
        raise
    except Exception as error:
        outcome = ("raised", type(error).__name__, str(error))
    finally:
        watchdog.finished.set()
        watchdog.join()
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    return {
        "outcome": outcome,
        "launcher": os.getpid(),
        "leftovers": _leftovers(folder, world_size),
        "method": (method, multiprocessing.get_start_method(allow_none=True)),
    }


def _launched(fn_name: str, world_size: int) -> dict:
    [result] = run_world(
        _launch_in_isolation, 1, fn_name, world_size, init_group=False, deadline=90
    )
    return result


def _check_launch_did_not_break(result: dict, world_size: int, what: str) -> None:
    """What every launch must get right, whatever fn did: no set_start_method, no deadlock."""
    outcome = result["outcome"]
    if outcome[0] == "raised" and "context has already been set" in outcome[2]:
        raise AssertionError(
            t(
                "launch({world_size}, fn) raised {error_type}: {error}. launch called "
                "mp.set_start_method(), which may run only once per program (this one had chosen "
                "its start method already). Use mp.get_context('spawn') and start processes from "
                "that context instead.",
                world_size=world_size,
                error_type=outcome[1],
                error=outcome[2],
            )
        )
    before, after = result["method"]
    if before != after:
        raise AssertionError(
            t(
                "launch changed the program's start method from {before!r} to {after!r} "
                "(set_start_method(..., force=True)): that changes it for every other use of "
                "multiprocessing in the program. Use mp.get_context('spawn') instead.",
                before=before,
                after=after,
            )
        )
    if outcome[0] == "stuck":
        raise AssertionError(
            t(
                "launch({world_size}, fn) never returned{what}: {report}",
                world_size=world_size,
                what=what,
                report=outcome[1],
            )
        )


def _check_no_leftovers(result: dict, when: str) -> None:
    left = result["leftovers"]
    if not left:
        return
    running = sorted(r for r, s in left.items() if s == "running")
    ended = sorted(r for r, s in left.items() if s == "zombie")
    states = []
    if running:
        states.append(t("rank(s) {ranks} still running", ranks=", ".join(map(str, running))))
    if ended:
        states.append(t("rank(s) {ranks} ended but never joined", ranks=", ".join(map(str, ended))))
    message = (
        t(
            "launch returned without joining the processes it started ({states}): call "
            "process.join() on every process you started before leaving launch (kill one that "
            "does not end), on success and on failure alike, so that none is left behind",
            states="; ".join(states),
        )
        if when == "returned"
        else t(
            "launch raised without joining the processes it started ({states}): call "
            "process.join() on every process you started before leaving launch (kill one that "
            "does not end), on success and on failure alike, so that none is left behind",
            states="; ".join(states),
        )
    )
    raise AssertionError(message)


def _how_made(answer: dict, launcher: int) -> str | None:
    """Why a rank was not spawned by the launcher, or None if it was."""
    if answer["mark"] is not None:
        return t(
            "it saw the launcher's memory, so it was forked, not spawned (mp.Process without a "
            "context uses the program's default start method)"
        )
    if answer["parent"] != launcher:
        return t(
            "its parent is process {parent}, not the launcher ({launcher}): it was made by a "
            "forkserver, not spawned (mp.Process without a context uses the program's default "
            "start method)",
            parent=answer["parent"],
            launcher=launcher,
        )
    return None


@pytest.mark.step(4)
def test_launch_spawns_and_collects_in_rank_order(kata):
    result = _launched("_identify", 4)
    _check_launch_did_not_break(result, 4, "")
    outcome = result["outcome"]
    assert outcome[0] == "returned", t(
        "launch({world_size}, fn) raised {error_type}: {error}",
        world_size=4,
        error_type=outcome[1],
        error=outcome[2],
    )
    answers = outcome[1]
    assert isinstance(answers, list) and len(answers) == 4, t(
        "launch(4, fn) returned {answers!r}: expected a list of the 4 answers", answers=answers
    )
    assert all(a["world_size"] == 4 for a in answers), t(
        "the ranks were told world sizes {sizes}: every rank must be told world_size=4",
        sizes=[a["world_size"] for a in answers],
    )
    pids = {a["pid"] for a in answers}
    assert len(pids) == 4 and result["launcher"] not in pids, t(
        "the 4 ranks ran in processes {pids} (launcher {launcher}): each rank needs a process of "
        "its own",
        pids=sorted(pids),
        launcher=result["launcher"],
    )
    for answer in answers:
        wrong = _how_made(answer, result["launcher"])
        assert wrong is None, t(
            "rank {rank} was not spawned: {why}. Start processes from mp.get_context('spawn').",
            rank=answer["rank"],
            why=wrong,
        )
    alone = [a for a in answers if a["started"] is not None and a["started"] < 4]
    assert not alone, t(
        "rank {rank} ran while only {started} of the 4 rank processes had been started: launch "
        "waited for each process before starting the next, so the ranks ran one after another "
        "instead of side by side. Start every process first, then collect the answers, then join.",
        rank=alone[0]["rank"],
        started=alone[0]["started"],
    )
    ranks = [a["rank"] for a in answers]
    assert ranks == [0, 1, 2, 3], t(
        "launch returned the answers of ranks {ranks}, in the order they arrived (here the "
        "ranks answered 3, 2, 1, 0): return them in rank order, answers[r] being rank r's. The "
        "queue delivers them in whatever order the processes finish: keep them by the rank each "
        "message carries.",
        ranks=ranks,
    )
    _check_no_leftovers(result, "returned")


@pytest.mark.step(4)
def test_launch_reads_big_answers_before_joining(kata):
    result = _launched("_big_answer", 2)
    _check_launch_did_not_break(result, 2, t(" when each rank answered half a MiB"))
    outcome = result["outcome"]
    assert outcome[0] == "returned", t(
        "launch({world_size}, fn) raised {error_type}: {error}",
        world_size=2,
        error_type=outcome[1],
        error=outcome[2],
    )
    assert [a["rank"] for a in outcome[1]] == [0, 1], t(
        "launch(2, fn) returned the answers of ranks {ranks}, expected [0, 1]",
        ranks=[a["rank"] for a in outcome[1]],
    )
    sizes = [len(a["blob"]) for a in outcome[1]]
    assert sizes == [512 * 1024] * 2, t("the answers arrived cut short: {sizes} bytes", sizes=sizes)
    _check_no_leftovers(result, "returned")


@pytest.mark.step(4)
def test_launch_names_the_rank_that_failed(kata):
    result = _launched("_fail_on_rank_two", 3)
    _check_launch_did_not_break(result, 3, "")
    outcome = result["outcome"]
    assert outcome[0] == "raised", t(
        "rank 2 raised ValueError, but launch returned {answers!r}: a failed rank must make "
        "launch raise RankProcessFailed naming it, or the program carries on with a hole in its "
        "answers",
        answers=outcome[1],
    )
    assert outcome[1] == "RankProcessFailed", t(
        "launch raised {error_type}: {error!r}; expected the kata's RankProcessFailed, which "
        "callers catch to tell a failed rank from other errors",
        error_type=outcome[1],
        error=outcome[2],
    )
    message = outcome[2]
    # "rank 2" or "ranks [2]": either names it; "ranks [1, 2]" or "2 of 3 ranks" do not
    assert re.search(r"\branks?(?:\(s\))?\s*\[?\s*2\b(?!\s*,)", message), t(
        "the error must say which rank failed, with its number after the word rank ('rank 2' "
        "or 'ranks [2]'), so the user knows whose traceback follows; it said: {message!r}",
        message=message,
    )
    assert "rank two refuses" in message and "Traceback" in message, t(
        "the error must show rank 2's traceback (the text run_rank reported, ending in "
        "'ValueError: rank two refuses'), so the user sees why it failed; it said: {message!r}",
        message=message,
    )
    assert "rank 0" not in message and "rank 1" not in message, t(
        "only rank 2 failed, but the error names other ranks too: {message!r}", message=message
    )
    _check_no_leftovers(result, "raised")


@pytest.mark.step(4)
def test_program_prints_the_tutorial_lines(kata):
    """`python -m katas.k01_spawn` does what the tutorial's run_multiprocess.py does."""
    # 4 processes import torch: slow on a busy machine
    out = run_module_ok(KATA, "--world-size", "4", timeout=300).stdout
    for rank in range(4):
        line = f"[rank {rank}] world size:4. I'm rank {rank}."
        assert line in out.splitlines(), t(
            "expected the line {line!r} in:\n{out}", line=line, out=out
        )
