"""Helpers for tests that run a kata's program the way an instructor would."""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from dojo.commands import python
from dojo.console import EXIT_TODO
from dojo.curriculum import ROOT
from dojo.harness import impl
from dojo.harness.loopback import keep_gloo_on_loopback
from dojo.lang import t
from dojo.todo import find_todo

# A program under test that makes no progress for this long ends with the harness's report of
# where each rank waits, as a unit test's deadlock does (dojo.launch reads both).
PROGRAM_HANG_S = 5.0
# "1": every program under test runs in a new interpreter (``python -m``), not forked.
FRESH_PROGRAM_VAR = "DOJO_FRESH_PROGRAMS"


def run_module(
    module: str, *args: str, timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m <impl>.<module> *args`` with a deadline; nothing it starts survives it.

    ``module`` is a kata (``"k04_allreduce"``, run from the implementation under test) or a
    dotted module name run as it is (``"benchmarks.allreduce"``).

    Raises the program's ``KataTodo`` when it stopped at a step not written yet, and fails the
    test when its ranks hang (with the report of where each one waits, within seconds), when it
    runs past ``timeout``, or when it leaves processes running after it exits. Whatever ends the
    test (a failure, pytest's timeout, Ctrl-C), the program and its ranks go with it.
    """
    target = module if "." in module else f"{impl.current()}.{module}"
    shown = f"{python()} -m {' '.join([target, *args])}"  # as the learner can type it
    environment = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DOJO_HANG_REPORT_S": str(PROGRAM_HANG_S),
        "DOJO_HANG_FAILS": "1",
        **(env or {}),
    }
    # a world of this machine, the groups the program makes itself too (k01-k03's, k06's)
    keep_gloo_on_loopback(environment)
    # An environment of the test's own may change what torch read as it was imported: a fresh
    # interpreter then, as the learner's.
    forked = env is None and os.environ.get(FRESH_PROGRAM_VAR, "") in ("", "0")
    run = _run_forked if forked and _forkserver() is not None else _run_fresh
    returncode, out, err = run(target, list(args), environment, timeout, shown)
    if returncode == EXIT_TODO:
        todo = find_todo(AssertionError(err))
        if todo is not None:
            raise todo
    from dojo.harness.world import deadlock_report

    report = deadlock_report(err)
    if report is not None:
        raise AssertionError(
            t("`{command}` hung: its ranks stopped making progress.", command=shown) + "\n" + report
        )
    return subprocess.CompletedProcess([sys.executable, "-m", target, *args], returncode, out, err)


def _run_fresh(target, args, environment, timeout, shown) -> tuple[int, str, str]:
    """``python -m target *args`` in a new interpreter, in a session of its own."""
    process = subprocess.Popen(
        [sys.executable, "-m", target, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session: every process it starts can be found and killed
        preexec_fn=_die_with_parent,  # and if pytest itself is killed, the program dies too
        env=environment,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        out, err = process.communicate()
        raise AssertionError(
            t(
                "`{command}` did not finish within {seconds} s.",
                command=shown,
                seconds=f"{timeout:g}",
            )
            + f"\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    finally:  # an exception (pytest's timeout, Ctrl-C) must not leave the program running
        if process.poll() is None:
            kill_session(process.pid)
            process.wait()
    _check_nothing_left(process.pid, shown)
    return process.returncode, out, err


def _forkserver():
    """The harness's forkserver context (torch imported), or None where there is none."""
    from dojo.harness import world

    context = world.rank_context()
    return context if context.get_start_method() == "forkserver" else None


def _run_forked(target, args, environment, timeout, shown) -> tuple[int, str, str]:
    """The program forked from the harness's forkserver, and its ranks too: what ``python -m``
    does, without the two ``import torch`` of a new interpreter and of its own forkserver
    (~3.5 s of CPU per program on a slow machine, a tenth of the gate's time)."""
    context = _forkserver()
    with tempfile.TemporaryDirectory(prefix="dojo-program-") as folder:
        out_path, err_path = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        lifeline, keep_alive = context.Pipe(duplex=False)
        process = context.Process(
            target=_forked_main,
            args=(target, args, environment, str(ROOT), out_path, err_path, lifeline),
            name="dojo-program",
        )
        process.start()
        lifeline.close()
        try:
            process.join(timeout)
            if process.exitcode is None:
                kill_session(process.pid)
                process.join()
                raise AssertionError(
                    t(
                        "`{command}` did not finish within {seconds} s.",
                        command=shown,
                        seconds=f"{timeout:g}",
                    )
                    + f"\nstdout:\n{_read(out_path)}\nstderr:\n{_read(err_path)}"
                )
        finally:  # an exception (pytest's timeout, Ctrl-C) must not leave the program running
            if process.exitcode is None:
                kill_session(process.pid)
                process.join()
            keep_alive.close()
        _check_nothing_left(process.pid, shown)
        return process.exitcode, _read(out_path), _read(err_path)


def _forked_main(target, args, environment, cwd, out_path, err_path, lifeline) -> None:
    """In the forked program's process: become what ``python -m target *args`` would be (its
    own session, the environment, the working directory, output to files), run it, exit."""
    os.setsid()
    _die_with_test(lifeline)
    if hasattr(signal, "SIGUSR1"):  # the forkserver ignores it for its ranks; a program does not
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out_path), (2, err_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    from dojo.harness import world

    world.use_parent_forkserver()
    sys.argv = [target, *args]
    try:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:  # sys.exit(None | status | message), as the interpreter reads it
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as an interpreter's exit would (multiprocessing's children skip it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_test(lifeline) -> None:
    """End the forked program's group when the test's process is gone, however it went. Its
    parent is the forkserver, which outlives it (a forkserver ends only once every process it
    forked has), so no death signal of a parent's: SIGIO instead, which the kernel sends when
    the pipe's far end closes and which ends a process unless it is handled. Its ranks then see
    their own lifelines close, and go too."""
    import fcntl

    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fd = lifeline.fileno()
    fcntl.fcntl(fd, fcntl.F_SETOWN, -os.getpgrp())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    global _lifeline
    _lifeline = lifeline  # open for the program's whole life
    if lifeline.poll(0):  # it closed before the kernel was told to say so
        os._exit(1)


_lifeline = None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _check_nothing_left(session: int, shown: str) -> None:
    leftovers = _wait_for_session_to_end(session)
    if leftovers:
        kill_session(session)
        raise AssertionError(
            t(
                "`{command}` exited but left processes running: {leftovers}",
                command=shown,
                leftovers=leftovers,
            )
        )


def hears_ctrl_c() -> None:
    """``preexec_fn`` for a process a test presses Ctrl-C on (SIGINT): it gets it as a terminal's
    foreground process does, even where the test runs with SIGINT ignored (a script's background
    job, ``make test &``, passes that on to every process it starts)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _die_with_parent() -> None:
    """In the program's process, before it runs: SIGTERM when its parent (pytest) dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the lifelines of the program's ranks still end them with the program


def session_members(session: int) -> list[int]:
    """Processes of a session, read from /proc (an empty list where there is no /proc)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # fields[3] is the session id
                members.append(int(entry))
    return members


def _wait_for_session_to_end(session: int, grace: float = 5.0) -> list[int]:
    """Ranks notice their parent's exit within moments; give them ``grace`` seconds to go."""
    end = time.monotonic() + grace
    while True:
        members = session_members(session)
        if not members or time.monotonic() > end:
            return members
        time.sleep(0.05)


def kill_session(session: int) -> None:
    for pid in session_members(session) or [session]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def free_port() -> int:
    """A TCP port that was free a moment ago.

    Only for katas that teach env:// rendezvous (MASTER_PORT), where the port must be known
    before any process starts: another process could take it in between, a small race the
    harness itself avoids by owning its store. Tests that use it retry once on "address in use".
    """
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_port_clash(error: BaseException | str) -> bool:
    """Whether ``error`` (or a program's output) is the rare race ``free_port`` can lose."""
    text = str(error).lower()
    return "address already in use" in text or "eaddrinuse" in text


def with_free_port(run):
    """``run(port)`` with a free port; once more with a new port if the first was taken meanwhile."""
    try:
        return run(free_port())
    except AssertionError as error:
        if not is_port_clash(error):
            raise
        return run(free_port())


def refusal(call) -> str | None:
    """None if ``call()`` raised ValueError (bad input refused), else what it did instead.

    A ``KataTodo`` goes straight through, so an unwritten step still reads as one.
    """
    from dojo.todo import KataTodo

    try:
        value = call()
    except ValueError:
        return None
    except KataTodo:
        raise
    except Exception as error:
        return t("raised {error_type}: {error}", error_type=type(error).__name__, error=error)
    if hasattr(value, "tolist"):
        value = value.tolist()
    return t("returned {value!r}", value=value)


def assert_refuses_missing_keys(call: str, outcome: str, message: str, lacking) -> None:
    """Hold a loader to refusing a file that lacks ``lacking`` keys with a ValueError naming each.

    ``outcome`` is "returned", "ValueError" or another exception's name; ``message`` its text (or
    what was returned).
    """
    what = t("a file without {keys}", keys=", ".join(map(repr, lacking)))
    if outcome == "returned":
        raise AssertionError(
            t(
                "{call} of {what} returned {message}: check the keys first and raise ValueError "
                "naming the ones it lacks",
                call=call,
                what=what,
                message=message,
            )
        )
    if outcome != "ValueError":
        raise AssertionError(
            t(
                "{call} of {what} raised {outcome}: {message}. Raise ValueError naming the keys "
                "it lacks (a KeyError names one, and not why)",
                call=call,
                what=what,
                outcome=outcome,
                message=message,
            )
        )
    unnamed = [key for key in lacking if key not in message]
    assert not unnamed, t(
        "{call} of {what} raised ValueError({message!r}): name every key it lacks ({unnamed} "
        "not named)",
        call=call,
        what=what,
        message=message,
        unnamed=", ".join(map(repr, unnamed)),
    )


# What some tests need of torch beyond pyproject.toml's floor, in one place: the tests carry
# ``needs_torch(NAME)``, and ``dojo doctor`` names what an older torch skips. NAME: (the first
# torch that has it, the kata, what of it needs that torch).
NEWER_TORCH = {
    "gloo all_to_all": (
        "2.12",
        "k08",
        "all_to_all_rows: dist.all_to_all (lists of tensors) on gloo",
    ),
    "selective checkpoint seen by hooks": (
        "2.14",
        "k32",
        "torch's selective checkpoint measured by saved_tensors_hooks "
        "(checkpoint's respect_saved_tensors_hooks)",
    ),
}


def torch_older_than(version: str, installed: str | None = None) -> bool:
    """Whether the installed torch (or ``installed``, "2.11.0+cu128") is older than ``version``
    ("2.12"), by release number."""
    if installed is None:
        import torch

        installed = torch.__version__
    return _release(installed) < _release(version)


def _release(version: str) -> tuple[int, ...]:
    numbers = re.match(r"\d+(\.\d+)*", str(version))
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else ()


def needs_torch(name: str):
    """A mark for a test that needs the newer torch ``NEWER_TORCH[name]`` names: with an older
    one it skips, saying which torch it needs and why, instead of failing with torch's own words
    ("Backend gloo does not support alltoall")."""
    import pytest
    import torch

    version, kata, what = NEWER_TORCH[name]
    return pytest.mark.skipif(
        torch_older_than(version),
        reason=t(
            "{kata} needs torch {version} or newer for {what}; this is torch {installed} (`make "
            "clean-venv && make learn` installs the torch the suite runs on)",
            kata=kata,
            version=version,
            what=what,
            installed=torch.__version__,
        ),
    )


def require_gpus(count: int) -> None:
    """Skip the test (or the rank, which skips the test) unless ``count`` CUDA GPUs are present."""
    import pytest
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < count:
        pytest.skip(t("needs {count} CUDA GPU(s), found {found}", count=count, found=found))


def fake_hosts_or_skip(count: int = 2, **options):
    """``dojo.spec.hosts.FakeHosts(count, **options)``, for ``with``; skips the test with the reason
    where this machine cannot make fake hosts (not Linux, not root, no iproute2, ...)."""
    import pytest

    from dojo.spec.hosts import FakeHosts, availability

    reason = availability()
    if reason:
        pytest.skip(reason)
    return FakeHosts(count, **options)


def ranks_phrase(numbers) -> str:
    """``rank 0``, ``ranks 1 and 2``, ``ranks 0, 1 and 2``: ranks named in a sentence."""
    numbers = [str(n) for n in numbers]
    if len(numbers) == 1:
        return t("rank {rank}", rank=numbers[0])
    return t("ranks {ranks} and {last}", ranks=", ".join(numbers[:-1]), last=numbers[-1])


def shared_run(function):
    """Share one world run between the tests of a step: its result or its failure, kept per
    implementation and catalogue swap (a deadlock costs its deadline once, not once per test)."""
    done = {}

    def shared(*args, **kwargs):
        key = (*impl.identity(), *args, *sorted(kwargs.items()))
        if key not in done:
            try:
                done[key] = ("ok", function(*args, **kwargs))
            except BaseException as error:  # a todo included: every test then reports it
                done[key] = ("error", error)
        outcome, value = done[key]
        if outcome == "error":
            raise value.with_traceback(None)
        return value

    return shared


class _StillRunning(BaseException):
    """Raised inside a call that ran past its limit, to stop it (see ``returns_within``)."""


class DidNotReturn(AssertionError):
    """A call that needs nothing outside itself ran past its short limit."""


def returns_within(what: str, function, *args, limit: float = 3.0):
    """``function(*args)``, given a short limit of its own: it needs no other rank and no I/O,
    so one that has not returned by then never will (the specs' calls take microseconds: a
    machine a thousand times slower still returns well within it). The AssertionError names the
    call instead of a harness timeout minutes later; the call is stopped (an exception raised
    inside it)."""
    box: dict = {}

    def run():
        try:
            box["value"] = function(*args)
        except BaseException as error:  # carried to the caller as it was
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_StillRunning)
        )
        raise DidNotReturn(
            t(
                "{what} did not return within {seconds} s: it waits for no other rank and reads "
                "nothing, so it is going round a loop for ever. Does every turn of the loop "
                "change what its condition tests (an index that moves on, a rank that makes "
                "progress)?",
                what=what,
                seconds=f"{limit:g}",
            )
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_module_ok(
    module: str, *args: str, timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``run_module(module, *args)`` that must exit with status 0: otherwise the test fails,
    showing the command as the learner types it and both of its streams."""
    done = run_module(module, *args, timeout=timeout, env=env)
    if done.returncode != 0:
        typed = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), python(), *done.args[1:]])
        raise AssertionError(
            t("`{command}` exited with status {status}", command=typed, status=done.returncode)
            + f"\n{streams(done)}"
        )
    return done


def streams(done: subprocess.CompletedProcess) -> str:
    """A finished program's stdout and stderr, each named, for a message."""
    return f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def outcome_of(call) -> tuple[str, str]:
    """What ``call()`` did, as ``assert_refuses_missing_keys`` reads it: ``("returned", repr of
    the value)`` or ``(the exception's name, its message)``. A ``KataTodo`` goes straight
    through, so an unwritten step still reads as one."""
    from dojo.todo import KataTodo

    try:
        value = call()
    except KataTodo:
        raise
    except Exception as error:
        return type(error).__name__, str(error)
    return "returned", repr(value)


def check_refuses_naming(call, shown: str, wrong: str, why: str, returned) -> None:
    """``call()`` (``shown``: the call as the learner would write it) must raise ValueError whose
    message names the wrong number ``wrong``, since ``why``; ``returned(value)`` says what is
    amiss with a value it returned instead. A ``KataTodo`` goes straight through."""
    import re

    from dojo.todo import KataTodo

    try:
        got = call()
    except ValueError as error:
        message = str(error)
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            t(
                "{call} raised {error_type}: {error}. {why}: raise ValueError, saying so",
                call=shown,
                error_type=type(error).__name__,
                error=error,
                why=why,
            )
        ) from None
    else:
        raise AssertionError(f"{shown} {returned(got)}")
    assert re.search(rf"(?<![\d-]){re.escape(wrong)}(?!\d)", message), t(
        "{call} raised ValueError({message!r}): say which number is wrong ({wrong}) and why "
        "({why}), so that whoever called it can fix the call",
        call=shown,
        message=message,
        wrong=wrong,
        why=why,
    )


def succeeded(result: dict) -> dict:
    """A rank's result that notes what its call raised under "failure" (None: nothing): the
    test fails with that, if there is one; else the result, to read on."""
    if result["failure"]:
        raise AssertionError(result["failure"])
    return result
