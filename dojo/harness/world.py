"""The rank harness: run a function on every rank of a fresh world and collect every answer.

    results = run_world(fn, world_size=4)   # fn(rank, world_size, *args) on 4 processes

What it guarantees, whatever the function does:

* rendezvous that cannot collide: the parent owns a TCPStore bound to port 0 for its whole life,
  and each world uses a fresh key prefix of it (safe under ``pytest -n auto``);
* nothing outside the machine can reach a world: the store listens on 127.0.0.1 only, and every
  rank's gloo on the loopback interface unless the caller's ``env`` names another
  (``dojo.harness.loopback``);
* a rank's exception comes back with its rank and traceback, and its peers are stopped at once;
* a deadlock ends at the deadline as a report of the stuck ranks and where each one waits; a
  world whose ranks wait idle inside torch.distributed calls at a line where an earlier world of
  this process deadlocked ends after a second (a spec's tests often share one deadlock);
* deadlines allow for a loaded machine: while a world's processes still use the CPU (a busy
  machine, a rank importing torch in a process it started) its deadline stretches, up to
  ``MAX_STRETCH`` times; idle ranks get what it says;
* a crash (segfault, abort, ``os._exit``) names the rank, the signal or exit code and its output;
* nothing is left running: every rank leads its own process group and the parent kills the
  group; a rank whose parent dies (even ``kill -9``) kills its own group;
* speed: ranks fork from a forkserver that has torch imported already, so a new world costs
  a fraction of a second instead of ~1.5 s of ``import torch`` per rank; and the ranks of a
  world that ended cleanly serve this process's next worlds (``dojo.harness.rank`` says when a rank
  may), which saves the fork and the exit (~0.1 s of CPU per rank). ``DOJO_FRESH_RANKS=1``
  forks every rank afresh. A program under test, forked from that forkserver
  (``dojo.spec.testing.run_module``), forks its ranks from it too (``use_parent_forkserver``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from dojo.harness import impl, known_errors, stacks
from dojo.harness import rank as _rank
from dojo.harness.loopback import loopback_store
from dojo.harness.stall import BusyWatch, StallWatch
from dojo.lang import t, tn
from dojo.todo import KataTodo

DEFAULT_DEADLINE_S = 20.0
# Once one rank has returned, its peers get this long to return too: a peer that does not is
# almost always stuck in a collective the others never called.
DEFAULT_STRAGGLER_S = 5.0
# Waiting ranks that sit idle inside torch.distributed calls this long, at a line where an earlier
# world of this process deadlocked, are taken to deadlock again (run_world's ``stall`` does the
# same for any line, for callers that know no call of theirs times out by itself).
KNOWN_STALL_S = 2.0
# Every rank of a world in the harness's own group idle inside torch.distributed calls this long:
# nothing can move them but the group's timeout, which lies past the deadline, so a deadlock.
# (A spec whose ranks wait on purpose in a call with a timeout of its own says stall=None.)
DEFAULT_STALL_S = 3.0
_LOOK_AGAIN_S = 3.0  # idle ranks outside torch.distributed: how often their stacks are read
# A deadline (or straggler window) stretches while the world's processes use the CPU, up to
# this many times itself: a loaded machine is slow, not stuck; a busy loop still ends.
MAX_STRETCH = 4.0
_POLL_S = 0.25  # how often a world with a deadline looks at its ranks' CPU time
_STACK_WAIT_S = 3.0  # how long stuck ranks get to write their stacks (they answer at once)
_TEARDOWN_WAIT_S = 10.0  # stretched as deadlines are, while ranks still work
FRESH_VAR = "DOJO_FRESH_RANKS"  # "1": no rank serves a second world
# How a deadlock report begins, in each language its catalogue has (a program prints it: the
# specs and the runner's test log find it in the program's output by these words)
DEADLOCK_MARKS = ("deadlock: rank(s)", "死锁：rank")


def deadlock_report(text: str) -> str | None:
    """The deadlock report in a program's output, from its first words on; None if none."""
    found = [text.index(mark) for mark in DEADLOCK_MARKS if mark in text]
    return text[min(found) :].rstrip() if found else None


_MAX_IDLE = 8  # ranks kept waiting for this process's next world
_MAX_SERVED = 200  # worlds a rank serves before it makes room for a fresh one


class WorldFailure(AssertionError):
    """A world did not finish cleanly. Subclasses say how; the message is written for a learner."""


class RankFailed(WorldFailure):
    """A rank raised an exception. ``raw``: it reaches the learner in words that are not the
    kata's (the spec's own code crashed, or torch's text that nothing explains)."""

    def __init__(self, message: str, rank: int, error: BaseException | None, raw: bool = False):
        super().__init__(message)
        self.rank, self.error, self.raw = rank, error, raw


class RankCrashed(WorldFailure):
    """A rank process died without a Python exception (signal, abort, os._exit)."""


class WorldDeadlock(WorldFailure):
    """Some ranks did not finish by the deadline. ``advice``: the general advice its message
    gives (``dojo.harness.stacks.advice``, read from where the ranks wait)."""

    def __init__(self, message: str, stuck: list[int], advice: str = ""):
        super().__init__(message)
        self.stuck, self.advice = stuck, advice

    def without_advice(self) -> str:
        """The report without its general advice: behind a spec's own diagnosis, which stands
        alone."""
        return str(self).replace(f" {self.advice}", "", 1) if self.advice else str(self)


@dataclass
class _Rank:
    number: int
    process: Any
    results: Any  # parent's end of the result pipe
    lifeline: Any  # parent's end of the lifeline pipe; closing it tells the rank to die
    log_path: str
    outcome: tuple | None = None
    served: int = 0  # worlds this process served before this one
    idle: bool = False  # released, torn down, and waiting for this process's next world

    @property
    def stack_path(self) -> str:
        return _rank.stack_path(self.log_path)  # ("ok", value) or ("error", RankError)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline: float | None = DEFAULT_DEADLINE_S,
    straggler: float | None = DEFAULT_STRAGGLER_S,
    init_group: bool = True,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    capture_output: bool = True,
    threads: int = 1,
    hang_report: float | None = None,
    hang_fails: bool = False,
    stall: float | None | str = "auto",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    With ``init_group`` (the default) each rank joins a fresh process group first (``backend``,
    gloo by default) and the group is destroyed after the function returns. Without it, the
    function sets up whatever it needs itself (katas 01-03 do). ``fn`` must be defined at module
    level, so that rank processes can import it. Returns the results in rank order; raises a
    ``WorldFailure`` (or the ``KataTodo`` a rank raised) otherwise.

    A world whose ranks all wait idle inside torch.distributed calls, some at a line where an
    earlier world of this process deadlocked, ends as a ``WorldDeadlock`` after ``KNOWN_STALL_S``
    (the same wait would hang again). With ``stall`` seconds, any such wait ends it that soon:
    by default (``"auto"``) ``DEFAULT_STALL_S`` for a world in the harness's group with a
    deadline, whose calls time out only long past it; else only the deadline, as a rank may be
    inside a call that times out by itself (a group, a barrier or a store wait given a timeout):
    ``stall=None`` says so.
    ``deadline=None`` waits for ever (programs; Ctrl-C still stops every rank, after saying where
    each one was). There ``hang_report`` seconds without progress (no rank returns, the waiting
    ranks idle) print which ranks wait where, and the world keeps waiting; with ``hang_fails``
    that report ends the world as a ``WorldDeadlock`` instead (a program under test). With
    ``capture_output`` (tests) each rank's output goes to a log that failures quote and that is
    echoed, rank-prefixed, afterwards; without it ranks print straight to the terminal.

    Tensors among ``args`` reach the ranks in shared memory (torch's pickler): every rank sees
    the same buffer, so a rank that changes one in place changes it for all. Clone first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    _check_importable(fn)
    if stall == "auto":
        stall = DEFAULT_STALL_S if init_group and deadline is not None else None
    context = rank_context()
    world_id = f"{os.getpid()}-{next(_world_numbers)}"
    if os.environ.get(
        "DOJO_TRACE_DIR"
    ):  # dojo.harness.timeline: every rank's calls, for a timeline
        from dojo.harness.timeline import TracedRank

        fn = TracedRank(fn, os.environ["DOJO_TRACE_DIR"], world_id, world_size)
    log_dir = tempfile.mkdtemp(prefix=f"dojo-world-{world_id}-")
    ranks: list[_Rank] = []
    # Only plain worlds reuse ranks: a kata that sets up its own group (k01-k03), NCCL or a
    # device, a program's output or an environment of the caller's get fresh processes.
    reusable = (
        init_group
        and backend == "gloo"
        and capture_output
        and not env
        and threads == 1
        and os.environ.get(FRESH_VAR, "") in ("", "0")
        and not os.environ.get("DOJO_TRACE_DIR")
    )
    try:
        for number in range(world_size):
            ranks.append(
                _start_rank(
                    context,
                    fn,
                    args,
                    kwargs,
                    number,
                    world_size,
                    world_id,
                    log_dir,
                    store_port=_store_port() if init_group else None,
                    backend=backend,
                    # The harness's deadline must fire before the group's own timeout does.
                    group_timeout_s=(deadline or 1800.0) * MAX_STRETCH + 30.0,
                    env={**_program_env(capture_output), **(env or {}), **impl.environment()},
                    capture_output=capture_output,
                    # a program's ranks print where it prints (its forkserver may be another's)
                    output=None if capture_output else _rank.LauncherOutput(),
                    threads=threads,
                    reusable=reusable,
                )
            )
        try:
            _collect(ranks, deadline, straggler, hang_report, hang_fails, stall)
        except KeyboardInterrupt as interrupt:
            report = _interrupted_report(ranks)  # where every rank was
            if not capture_output:  # a learner's program: on its terminal
                _say(report)
            else:  # a test's: in the interrupt, for whoever runs the tests (dojo check)
                interrupt.args = (report,)
            raise
        except KataTodo:
            if reusable:
                _keep_after_todo(ranks)
            raise
        _release(ranks, keep=reusable)
        results = [_load_result(r) for r in ranks]
        if capture_output:
            _echo(ranks)
        _keep_idle(ranks)
        return results
    finally:
        _kill([r for r in ranks if not any(r is i for i in _idle)])
        shutil.rmtree(log_dir, ignore_errors=True)


# --------------------------------------------------------------------------- starting ranks

_world_numbers = iter(range(1, 1 << 62))
_lock = threading.Lock()
_store = None


def rank_context():
    """A forkserver context whose server has torch imported (spawn where there is no fork).

    Never ranks forked from this process itself, though it may have torch loaded already: by
    then the harness's store serves from a thread of its own, and a fork taken while another
    thread holds a lock leaves the child waiting on it for ever (seen: a program's rank 3 stuck
    in its own fork)."""
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dojo.harness.preload"])
    return context


def _store_port() -> int:
    """Port of the store this process owns for all its worlds (created on first use)."""
    global _store
    with _lock:
        if _store is None:
            _store = loopback_store(wait_for_workers=False)
        return _store.port


def _program_env(capture_output: bool) -> dict[str, str]:
    """A program's ranks see the program's whole environment, as processes it started would,
    whichever process started the forkserver that forks them (``use_parent_forkserver``)."""
    return {} if capture_output else dict(os.environ)


def use_parent_forkserver() -> bool:
    """In a process that the harness's forkserver forked (a program under test): start ranks
    from that same forkserver, which has torch imported already, instead of a new one of this
    process's own (a second ``import torch``, ~1.5 s). False where that cannot be done (a
    Python whose forkserver works otherwise): ranks then come from a new forkserver, as usual."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if (
        sys.version_info >= (3, 14)  # its forkserver authenticates its clients (a key we lack)
        or getattr(server, "_forkserver_address", None) is None
        or getattr(server, "_forkserver_alive_fd", None) is None
        or getattr(server, "_forkserver_pid", 0) is not None
    ):
        return False
    # ensure_running would start a server of this process's own, since it did not start one
    server.ensure_running = resource_tracker.ensure_running
    return True


def _check_importable(fn: Callable[..., Any]) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_world needs a function defined at module level, got {qualname!r}: rank "
            "processes import it by name, so move it to the top level of its module"
        )


def _start_rank(
    context, fn, args, kwargs, number, world_size, world_id, log_dir, **options
) -> _Rank:
    log_path = os.path.join(log_dir, f"rank{number}.log")
    spec = _rank.RankSpec(fn, args, kwargs, number, world_size, world_id, log_path, **options)
    while spec.reusable and _idle:
        rank = _idle.pop()
        try:
            rank.lifeline.send(("task", spec))
        except (OSError, ValueError):  # it died while it waited
            _kill([rank])
            continue
        except BaseException:  # the task does not pickle: say so as a fresh start would
            _idle.append(rank)
            raise
        return _Rank(
            number, rank.process, rank.results, rank.lifeline, log_path, served=rank.served + 1
        )
    results_parent, results_child = context.Pipe(duplex=False)
    lifeline_child, lifeline_parent = context.Pipe(duplex=False)
    process = context.Process(
        # Not a daemon: a rank may start processes of its own (katas 01-03 do). The harness
        # kills every rank itself, and each rank dies with its parent.
        target=_rank.main,
        args=(spec, results_child, lifeline_child),
        name=f"dojo-rank{number}",
    )
    process.start()
    results_child.close()
    lifeline_child.close()
    return _Rank(number, process, results_parent, lifeline_parent, log_path)


# --------------------------------------------------------------------------- watching ranks


def _collect(
    ranks: list[_Rank],
    deadline: float | None,
    straggler: float | None,
    hang_report: float | None = None,
    hang_fails: bool = False,
    stall: float | None = None,
) -> None:
    """Wait for every rank's outcome; raise on the first error, crash, deadlock or missed
    deadline."""
    window = _Window(deadline)  # the deadline; once some ranks return, the straggler window
    watch = StallWatch() if hang_report is not None or deadline is not None else None
    busy = BusyWatch()
    looked = 0.0  # how idle the ranks were when their stacks were last looked at
    while True:
        waiting = [r for r in ranks if r.outcome is None]
        if not waiting:
            return
        if window.straggler is None and straggler is not None and len(waiting) < len(ranks):
            window.stragglers(straggler)
        now = time.monotonic()
        if now >= window.end - busy.every:  # from a second before the end: busy since then?
            working = busy.busy([r.process.pid for r in waiting])
        if now >= window.end:
            if now < window.hard_end and working:
                window.end = min(window.hard_end, now + _POLL_S)  # still at work: not stuck
            else:
                raise _deadlock(
                    ranks,
                    waiting,
                    window.seconds,
                    window.straggler is not None,
                    stretched=window.stretched(now),
                )
        timeout = window.end - time.monotonic()
        if watch is not None:
            stalled = watch.check([r.process.pid for r in waiting], len(ranks) - len(waiting))
            if hang_report is not None and stalled >= hang_report:
                if hang_fails:
                    raise _deadlock(ranks, waiting, hang_report, straggling=False, stalled=True)
                _say(_stall_report(ranks, waiting, stalled))
                watch.moved()  # the next report after as long again
            elif stall is not None or _known_deadlocks:
                if stalled < looked:
                    looked = 0.0  # something moved since
                verdict = _idle_verdict(waiting, stalled, looked, stall)
                if verdict is not None:
                    looked = stalled
                    if verdict[0]:
                        raise _deadlock(
                            ranks,
                            waiting,
                            stalled,
                            window.straggler is not None,
                            stalled=True,
                            dumps=verdict[1],
                            known=verdict[0] == "known",
                        )
            timeout = min(timeout, _POLL_S if stall is not None or _known_deadlocks else 1.0)
        pipes = [r.results for r in waiting] + [r.process.sentinel for r in waiting]
        ready = wait(pipes, None if timeout == float("inf") else max(0.0, timeout))
        for rank in waiting:
            if rank.results in ready or rank.results.poll():
                try:
                    rank.outcome = rank.results.recv()
                except (EOFError, OSError):
                    raise _crashed(rank, ranks) from None
                if rank.outcome[0] == "error":
                    raise _first_cause(rank, ranks)
            elif rank.process.sentinel in ready:
                raise _crashed(rank, ranks)


class _Window:
    """When a world gives up: ``end`` (stretched while ranks work, never past ``hard_end``)."""

    def __init__(self, deadline: float | None):
        self.began = time.monotonic()
        self.seconds = deadline
        self.end = self.began + deadline if deadline is not None else float("inf")
        self.hard_end = self.began + deadline * MAX_STRETCH if deadline is not None else self.end
        self.straggler: float | None = None

    def stragglers(self, seconds: float) -> None:
        """Some ranks returned: the rest have ``seconds`` (stretched likewise) to return too."""
        now = time.monotonic()
        self.began, self.seconds, self.straggler = now, seconds, seconds
        self.end = min(self.end, now + seconds)
        self.hard_end = min(self.hard_end, now + seconds * MAX_STRETCH)

    def stretched(self, now: float) -> float | None:
        """How long the window lasted, where that is longer than it says."""
        lasted = now - self.began
        return lasted if self.seconds is not None and lasted > self.seconds + 1.5 else None


# Where worlds of this process deadlocked: (*the implementation's identity, file, line).
_known_deadlocks: set[tuple] = set()


def _place_key(dump: str) -> tuple | None:
    line = stacks.own_line(dump)
    if line is None:
        return None
    return (*impl.identity(), *line)


def _idle_verdict(
    waiting: list[_Rank], idle: float, looked: float, stall: float | None
) -> tuple[str | None, dict[int, str]] | None:
    """Look at idle ranks' stacks now and then: ``("stalled" or "known", dumps)`` when every one
    waits inside torch.distributed (at a known place, or for ``stall`` seconds), ``(None,
    dumps)`` when not (asleep, waiting for a process: the deadline decides), None when it is not
    time to look."""
    first = min(t for t in (stall, KNOWN_STALL_S if _known_deadlocks else None) if t is not None)
    due = first if looked == 0.0 else looked + (stall or _LOOK_AGAIN_S)
    if idle < due:
        return None
    dumps = _dump_stacks(waiting)
    if not all(stacks.waits_in_torch_distributed(d) for d in dumps.values()):
        return None, dumps
    keys = {_place_key(d) for d in dumps.values()} - {None}
    with _lock:
        known = bool(keys & _known_deadlocks)
    if stall is not None and idle >= stall:
        return "stalled", dumps
    return ("known", dumps) if known else (None, dumps)


def _remember(dumps: dict[int, str]) -> None:
    """A world deadlocked: where its ranks waited, for later worlds (when they all waited inside
    torch.distributed calls; ranks asleep or computing are no deadlock to remember)."""
    if dumps and all(stacks.waits_in_torch_distributed(d) for d in dumps.values()):
        with _lock:
            _known_deadlocks.update({_place_key(d) for d in dumps.values()} - {None})


def _release(ranks: list[_Rank], keep: bool = False) -> None:
    """Let every rank tear down, and make sure each one ends cleanly: exits, or (``keep``) waits
    for another world, as it was when it was forked."""
    for rank in ranks:
        rank.lifeline.send(("release", keep))
    end = time.monotonic() + _TEARDOWN_WAIT_S
    hard_end = time.monotonic() + _TEARDOWN_WAIT_S * MAX_STRETCH
    busy = BusyWatch()
    for rank in ranks:
        while True:
            signs = [rank.process.sentinel] + ([rank.results] if keep else [])
            wait(signs, max(0.0, min(end - time.monotonic(), 1.0)))
            if keep and rank.results.poll():
                _read_idle(rank)
            if rank.idle or not rank.process.is_alive() or time.monotonic() >= hard_end:
                rank.process.join(0 if rank.idle else 1.0)
                break
            if time.monotonic() >= end:
                alive = [r.process.pid for r in ranks if r.process.exitcode is None]
                if not busy.busy(alive):
                    break
                end = time.monotonic() + 1.0  # still tearing down on a busy machine
    for rank in ranks:
        code = rank.process.exitcode
        if not rank.idle and code != _rank.EXIT_OK:
            how = t("did not exit") if code is None else _describe_exit(code)
            said = t(
                "rank {rank} returned its result but then {how} while tearing down its process "
                "group.",
                rank=rank.number,
                how=how,
            )
            raise RankCrashed(f"{said}\n{_tail(rank.log_path)}")


_TODO_WAIT_S = 1.0  # how long the other ranks get to stop at a todo too, and to tear down


def _keep_after_todo(ranks: list[_Rank]) -> None:
    """A rank stopped at a step not written yet (a stub: a learner's first runs, the gate's
    check of the stubs). When every rank stops at one within moments, nothing is left half
    done between them: they tear down and wait for the next world, as after a world that
    passed. Otherwise run_world ends them."""
    end = time.monotonic() + _TODO_WAIT_S
    for rank in ranks:
        if rank.outcome is None and rank.results.poll(max(0.0, end - time.monotonic())):
            try:
                rank.outcome = rank.results.recv()
            except (EOFError, OSError):
                return
        error = rank.outcome[1] if rank.outcome and rank.outcome[0] == "error" else None
        if not isinstance(getattr(error, "error", None), KataTodo):
            return
    for rank in ranks:
        rank.lifeline.send(("release", True))
    end = time.monotonic() + _TODO_WAIT_S
    for rank in ranks:
        if rank.results.poll(max(0.0, end - time.monotonic())):
            _read_idle(rank)
    _keep_idle(ranks)


def _read_idle(rank: _Rank) -> None:
    """Read a released rank's answer: it waits for another world, or it is ending."""
    try:
        rank.idle = rank.results.recv() == ("idle", None)
    except (EOFError, OSError):
        pass


# Ranks that served a world of this process and wait for its next one (dojo.harness.rank's loop).
_idle: list[_Rank] = []


def _keep_idle(ranks: list[_Rank]) -> None:
    """Keep the ranks that are waiting for another world, as many as may wait."""
    global _ending_registered
    for rank in ranks:
        if rank.idle and rank.served < _MAX_SERVED and len(_idle) < _MAX_IDLE:
            rank.outcome = None
            _idle.append(rank)
        else:
            rank.idle = False  # run_world's cleanup ends it
    if _idle and not _ending_registered:
        # Registered after multiprocessing's own exit handler, so it runs first: that one
        # would wait for ever for these ranks to end.
        atexit.register(end_idle_ranks)
        _ending_registered = True


_ending_registered = False


def end_idle_ranks() -> None:
    """End the ranks waiting for another world (at exit, or to start afresh)."""
    waiting, _idle[:] = list(_idle), []
    _kill(waiting)


def _load_result(rank: _Rank) -> Any:
    return pickle.loads(rank.outcome[1])


# --------------------------------------------------------------------------- reports


def _failed(error: _rank.RankError, ranks: list[_Rank]) -> BaseException:
    original = error.error
    if isinstance(original, KataTodo):
        return original  # run_world ends the ranks, or keeps them (_keep_after_todo)
    _kill(ranks)
    if error.type_name == "Skipped":  # pytest.skip() inside a rank (its class does not pickle)
        import pytest

        return pytest.skip.Exception(
            t("rank {rank}: {words}", rank=error.rank, words=error.message)
        )
    output = _tail(ranks[error.rank].log_path, header=t("rank {rank}'s output:", rank=error.rank))
    words = known_errors.said(error.type_name, error.message, error.culprit)
    if error.culprit is None:
        head = t("rank {rank} raised {words}", rank=error.rank, words=words)
    else:
        head = t("rank {rank}: {words}", rank=error.rank, words=words)
    traceback = t("rank {rank}'s traceback:", rank=error.rank)
    text = f"{head}\n\n{traceback}\n{error.traceback.rstrip()}"
    if output:
        text += f"\n\n{output}"
    raw = known_errors.is_raw(error.type_name, error.message, error.culprit)
    return RankFailed(text, error.rank, original, raw)


# What gloo says on a rank whose peer died or was killed: a consequence, not the cause.
_PEER_LOST = re.compile(
    r"connection (reset|closed) by peer|broken pipe|socket closed|connection refused", re.I
)
_CAUSE_WAIT_S = 3.0  # how long a rank that lost its peer waits for the peer's own outcome


def _first_cause(rank: _Rank, ranks: list[_Rank]) -> BaseException:
    """The report for ``rank``'s error, unless it only says a peer went away: then the peer's
    crash or error, which came first (gloo's "Connection reset by peer" follows it)."""
    error = rank.outcome[1]
    if not _PEER_LOST.search(error.message):
        return _failed(error, ranks)
    others = [r for r in ranks if r.outcome is None]
    end = time.monotonic() + _CAUSE_WAIT_S
    while others and time.monotonic() < end:
        ready = wait([r.results for r in others] + [r.process.sentinel for r in others], 0.1)
        for other in others:
            if other.results in ready or other.results.poll():
                try:
                    other.outcome = other.results.recv()
                except (EOFError, OSError):
                    return _crashed(other, ranks, lost=[rank.number])
                if other.outcome[0] == "error" and not _PEER_LOST.search(other.outcome[1].message):
                    return _failed(other.outcome[1], ranks)
            elif other.process.sentinel in ready:
                return _crashed(other, ranks, lost=[rank.number])
        others = [r for r in others if r.outcome is None]
    return _failed(error, ranks)


# gloo aborts a rank whose peer sent an operation of another size than the one it waits in.
_GLOO_MISMATCH = ("op.preamble.length <= op.nbytes", "op.nbytes", "preamble")


def _crashed(rank: _Rank, ranks: list[_Rank], lost: list[int] | None = None) -> RankCrashed:
    rank.process.join(2.0)
    _kill(ranks)
    code = rank.process.exitcode
    how = t("is still running but closed its pipe") if code is None else _describe_exit(code)
    output, _, dump = _read_from(rank.log_path, 0).partition("Fatal Python error:")
    text = t(
        "rank {rank} {how} without a Python exception (a crash, an abort or os._exit), and its "
        "peers were stopped.",
        rank=rank.number,
        how=how,
    )
    if lost:
        text += t(
            " (rank(s) {ranks} then lost the connection to it: that error follows this.)",
            ranks=_join(lost),
        )
    if any(sign in output for sign in _GLOO_MISMATCH):
        text += "\n" + t(
            "gloo aborted it: a peer's message did not fit the operation this rank was in. "
            "The ranks' calls did not match: a collective only some ranks call, calls in a "
            "different order, or tensors of different sizes."
        )
    if "bootstrapping phase" in output:
        text += "\n" + t(
            "It failed while starting: the main module starts processes when it is imported. "
            'Put that code under `if __name__ == "__main__":`.'
        )
    if dump:
        text += "\n\n" + t("where it crashed (most recent call last):")
        text += f"\n{stacks.format_stack_dump(dump)}"
    tail = _tail_of(output)
    return RankCrashed(f"{text}\n\n{tail}" if tail else text)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = t("signal {number}", number=-code)
        return t("died from {signal} (exit code {code})", signal=name, code=code)
    return t("exited with code {code}", code=code)


def _deadlock(
    ranks: list[_Rank],
    stuck: list[_Rank],
    seconds: float,
    straggling: bool,
    stalled: bool = False,
    dumps: dict[int, str] | None = None,
    known: bool = False,
    stretched: float | None = None,
) -> WorldDeadlock:
    dumps = dumps if dumps is not None else _dump_stacks(stuck)
    _remember(dumps)
    numbers = [r.number for r in stuck]
    finished = [r.number for r in ranks if r.outcome is not None]
    advice = stacks.advice(dumps)
    # TRANSLATORS: every deadlock report begins with the words of DEADLOCK_MARKS (world.py)
    values = {
        "ranks": _join(numbers),
        "seconds": f"{seconds:.0f}",
        "finished": _join(finished),
        "advice": advice,
    }
    if known:
        head = tn(
            "deadlock: rank(s) {ranks} waits where an earlier test's ranks deadlocked, and made "
            "no progress for {seconds} s: ended at once rather than waiting again. {advice}",
            "deadlock: rank(s) {ranks} wait where an earlier test's ranks deadlocked, and made "
            "no progress for {seconds} s: ended at once rather than waiting again. {advice}",
            len(numbers),
            **values,
        )
    elif stalled and straggling:
        head = tn(
            "deadlock: rank(s) {ranks} waits inside torch.distributed calls, making no progress "
            "for {seconds} s, after rank(s) {finished} returned: a call its peers never make. "
            "{advice}",
            "deadlock: rank(s) {ranks} wait inside torch.distributed calls, making no progress "
            "for {seconds} s, after rank(s) {finished} returned: a call its peers never make. "
            "{advice}",
            len(numbers),
            **values,
        )
    elif stalled:
        head = t(
            "deadlock: rank(s) {ranks} made no progress for {seconds} s (no rank returned, none "
            "computed). {advice}",
            **values,
        )
    elif straggling:
        head = t(
            "deadlock: rank(s) {ranks} still had not returned {lasted} after rank(s) {finished} "
            "had. {advice}",
            lasted=_lasted(seconds, stretched),
            **values,
        )
    else:
        head = t(
            "deadlock: rank(s) {ranks} did not return within the {lasted}. {advice}",
            lasted=_lasted(seconds, stretched, deadline=True),
            **values,
        )
    if stacks.only_in_checking_code(dumps):
        head += t(
            " No rank is inside your code: they wait in the test's own call, after your code "
            "returned, for something it left unmatched (a collective or a send that only some "
            "ranks started, an asynchronous one included)."
        )
    text = f"{head}\n{stacks.summary(dumps, finished)}\n\n{stacks.grouped_stacks(dumps)}"
    _kill(ranks)
    return WorldDeadlock(text, numbers, advice)


def _lasted(seconds: float, stretched: float | None, deadline: bool = False) -> str:
    """``20 s deadline`` or ``20 s deadline (stretched to 45 s while the ranks were busy)``."""
    shown = f"{seconds:g}"
    text = t("{seconds} s deadline", seconds=shown) if deadline else t("{seconds} s", seconds=shown)
    if stretched is not None:
        text += t(
            " (stretched to {seconds} s while they still used the CPU)",
            seconds=f"{stretched:.0f}",
        )
    return text


def _stall_report(ranks: list[_Rank], stuck: list[_Rank], seconds: float) -> str:
    dumps = _dump_stacks(stuck)
    finished = [r.number for r in ranks if r.outcome is not None]
    said = t(
        "no progress for {seconds} s: {summary}.\nStill waiting (Ctrl-C stops every rank). "
        "{advice}",
        seconds=f"{seconds:.0f}",
        summary=stacks.summary(dumps, finished),
        advice=stacks.advice(dumps),
    )
    return f"{said}\n\n{stacks.grouped_stacks(dumps)}"


def _interrupted_report(ranks: list[_Rank]) -> str:
    stuck = [r for r in ranks if r.outcome is None and r.process.is_alive()]
    if not stuck:
        return t("interrupted")
    dumps = _dump_stacks(stuck)
    finished = [r.number for r in ranks if r.outcome is not None]
    said = t("interrupted: {summary}", summary=stacks.summary(dumps, finished))
    return f"{said}\n\n{stacks.grouped_stacks(dumps)}"


def _say(text: str) -> None:
    """A report to the program's terminal, as whole lines (ranks may be printing too)."""
    data = "".join(f"[main] {line}\n" for line in text.splitlines())
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), data.encode())


def _dump_stacks(stuck: list[_Rank]) -> dict[int, str]:
    """Ask every stuck rank for its Python stacks (faulthandler on SIGUSR1) and read them."""
    offsets = {}
    for rank in stuck:
        offsets[rank.number] = _size(rank.stack_path)
        if not os.path.exists(rank.stack_path):
            continue  # still starting: it cannot answer yet (dojo.harness.rank makes the file first)
        try:
            os.kill(rank.process.pid, signal.SIGUSR1)
        except (OSError, AttributeError):
            pass
    end = time.monotonic() + _STACK_WAIT_S
    dumps = {}
    for rank in stuck:
        text = ""
        while time.monotonic() < end and os.path.exists(rank.stack_path):
            text = _read_from(rank.stack_path, offsets[rank.number])
            if "most recent call first" in text and text.endswith("\n"):
                time.sleep(0.05)  # let the dump finish
                text = _read_from(rank.stack_path, offsets[rank.number])
                break
            time.sleep(0.02)
        dumps[rank.number] = text
    return dumps


# --------------------------------------------------------------------------- output and cleanup


def _kill(ranks: list[_Rank]) -> None:
    """Kill every rank and everything it started; never raises."""
    for rank in ranks:
        pid = rank.process.pid
        if pid is None:
            continue
        for kill in (getattr(os, "killpg", None), os.kill):
            if kill is None:
                continue
            try:
                kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
    for rank in ranks:
        if rank.process.pid is not None:
            rank.process.join(5.0)
        for pipe in (rank.results, rank.lifeline):
            pipe.close()


def _echo(ranks: list[_Rank]) -> None:
    """Show what each rank printed, prefixed with its rank (pytest captures it)."""
    for rank in ranks:
        text = _read_from(rank.log_path, 0)
        for line in text.splitlines():
            print(f"[rank {rank.number}] {line}")


def _tail(path: str, lines: int = 20, header: str | None = None) -> str:
    return _tail_of(_read_from(path, 0), lines, header)


def _tail_of(text: str, lines: int = 20, header: str | None = None) -> str:
    """The last ``lines`` of a rank's output, under ``header`` (default: "its last output")."""
    text = text.rstrip()
    if not text:
        return ""
    last = text.splitlines()[-lines:]
    heading = t("its last output:") if header is None else header
    return heading + "\n" + "\n".join(f"  | {line}" for line in last)


def _join(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
