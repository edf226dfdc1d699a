"""k03 world-size mismatch: both bad worlds started for real, each ending in a clear error fast."""

import gc
import os
import re
import signal
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dojo.harness.impl import load_kata
from dojo.harness.loopback import loopback_store
from dojo.harness.world import run_world
from dojo.lang import t
from dojo.spec.testing import run_module, with_free_port
from dojo.todo import KataTodo

KATA = "k03_world_size"
JOIN_TIMEOUT_S = 2.0
# A rank must have given up well within this (join timeout, rank 0's short wait for the others,
# and room for a loaded machine); a rank still waiting this long after it started never would.
GIVE_UP_WITHIN_S = JOIN_TIMEOUT_S + 8
STILL_WAITING_S = GIVE_UP_WITHIN_S + 2
# Once some ranks have returned (refused, or given up), the others may still be waiting out their
# own timeouts (join_timeout_s, timeout_s=4): the harness waits that long before it calls them stuck.
STRAGGLER_S = 15.0
# Harness deadline: the backstop behind the ranks' own watchdog, far below gloo's 30 minutes.
DEADLINE_S = 30.0

# --------------------------------------------------------------------------- step 1: check_rank


def _outcome(call):
    """("returned", None) or ("raised", error) for ``call()``; a todo goes straight through."""
    try:
        call()
    except KataTodo:
        raise
    except Exception as error:
        return "raised", error
    return "returned", None


@pytest.mark.step(1)
@pytest.mark.parametrize("rank, world_size", [(2, 2), (3, 2), (-1, 4), (7, 4)])
def test_check_rank_refuses_a_rank_outside_the_world(kata, rank, world_size):
    how, error = _outcome(lambda: kata.check_rank(rank, world_size))
    call = f"check_rank({rank}, {world_size})"
    if how == "returned":
        if rank == world_size:
            why = t(
                "rank {rank} is one past the last (the check is rank < world_size, not <=)",
                rank=world_size,
            )
        elif rank < 0:
            why = t("ranks are never negative")
        else:
            why = t("rank {rank} is beyond the last", rank=rank)
        pytest.fail(
            t(
                "{call} returned without an error: in a world of {world_size} the ranks are 0 to "
                "{last}, so {why}. Raise WorldSizeMismatch.",
                call=call,
                world_size=world_size,
                last=world_size - 1,
                why=why,
            )
        )
    if not isinstance(error, kata.WorldSizeMismatch):
        pytest.fail(
            t(
                "{call} raised {error_type}: {error}. Expected the kata's WorldSizeMismatch, "
                "which callers (and the program) catch to tell a wrong world size from any other "
                "failure.",
                call=call,
                error_type=type(error).__name__,
                error=error,
            )
        )
    message = str(error)
    assert f"rank {rank}" in message and str(world_size) in message, t(
        "{call} raised WorldSizeMismatch({message!r}): name the rank ({rank}) and the world size "
        "({world_size}), so the user knows which process and which number to fix",
        call=call,
        message=message,
        rank=rank,
        world_size=world_size,
    )


@pytest.mark.step(1)
@pytest.mark.parametrize("rank, world_size", [(0, 1), (0, 2), (1, 2), (3, 4)])
def test_check_rank_accepts_ranks_inside_the_world(kata, rank, world_size):
    how, error = _outcome(lambda: kata.check_rank(rank, world_size))
    assert how == "returned", t(
        "check_rank({rank}, {world_size}) raised {error_type}: {error}. Rank {rank} belongs to a "
        "world of {world_size} (ranks 0 to {last}): let it through.",
        rank=rank,
        world_size=world_size,
        error_type=type(error).__name__,
        error=error,
        last=world_size - 1,
    )


# --------------------------------------------------------------------------- step 2: wait_for_world
#
# Each rank opens the store itself (rank 0 hosts it) and hands wait_for_world a stand-in that
# records every call. A rank 0 whose wait_for_world has ended closes its store at once, as a
# process that leaves does.


class _RecordingStore:
    """The real store, with every call counted and every failure kept."""

    def __init__(self, store):
        self._store = store
        self.calls = 0
        self.counted_in = {}  # key -> how many times this rank added 1 to it
        self.failures = []  # the store errors, in order

    def add(self, key, amount):
        self.calls += 1
        if amount == 1:
            self.counted_in[key] = self.counted_in.get(key, 0) + 1
        try:
            return self._store.add(key, amount)
        except RuntimeError as error:
            self.failures.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
            raise

    def __getattr__(self, name):
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def recorded(*args, **kwargs):
            self.calls += 1
            try:
                return attribute(*args, **kwargs)
            except RuntimeError as error:
                self.failures.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
                raise

        return recorded


class _StillWaiting(BaseException):
    """Raised in a rank (by a signal) that is still inside wait_for_world long after it started."""


def _raise_still_waiting(signum, frame):
    raise _StillWaiting()


def _open_store(rank: int, world_size: int, port: int):
    timeout = timedelta(seconds=10)
    if rank == 0:  # the server, on loopback only
        return loopback_store(port, world_size, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def _wait(kata, store, rank: int, world_size: int, join_timeout_s: float) -> dict:
    """wait_for_world on a recording store, interrupted if it is still waiting far too long."""
    proxy = _RecordingStore(store)
    signal.signal(signal.SIGUSR2, _raise_still_waiting)
    alarm = threading.Timer(STILL_WAITING_S, os.kill, (os.getpid(), signal.SIGUSR2))
    alarm.start()
    start = time.monotonic()
    try:
        kata.wait_for_world(proxy, rank, world_size, join_timeout_s)
        how, message = "returned", ""
    except kata.WorldSizeMismatch as error:
        how, message = "mismatch", str(error)
    except _StillWaiting:
        how, message = "still waiting", ""
    except KataTodo:
        raise
    except Exception as error:
        how, message = "other", f"{type(error).__name__}: {str(error).splitlines()[0]}"
    finally:
        alarm.cancel()
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    return {
        "how": how,
        "message": message,
        "join_timeout_s": join_timeout_s,
        "seconds": time.monotonic() - start,
        "started": start,
        "calls": proxy.calls,
        "counted_in": proxy.counted_in,
        "failures": proxy.failures,
    }


def _too_few_join(rank, processes, world_size, port):
    """One of ``processes`` ranks of a world that expects ``world_size``. Every rank counts in at
    once, but rank r gives up r seconds after rank 0: rank 0 would leave first, were nothing to
    hold it back."""
    kata = load_kata(KATA)
    store = _open_store(rank, world_size, port)
    store.add("test/connected", 1)
    while store.add("test/connected", 0) < processes:  # bounded by the harness's deadline
        time.sleep(0.01)
    result = _wait(kata, store, rank, world_size, JOIN_TIMEOUT_S + rank)
    del store  # rank 0 leaves: the store it hosts closes with it
    gc.collect()
    return result


def _check_stopped(rank: int, result: dict, joined: int, world_size: int) -> None:
    """A rank that cannot form the world must stop waiting, by raising WorldSizeMismatch."""
    how, message = result["how"], result["message"]
    if how == "still waiting":
        raise AssertionError(
            t(
                "rank {rank} was still waiting in wait_for_world {seconds} s after it started, "
                "with join_timeout_s={join_timeout} and only {joined} of {world_size} ranks "
                "started: once join_timeout_s has passed, stop waiting and raise "
                "WorldSizeMismatch",
                rank=rank,
                seconds=f"{STILL_WAITING_S:g}",
                join_timeout=f"{result['join_timeout_s']:g}",
                joined=joined,
                world_size=world_size,
            )
        )
    if how == "returned":
        extra = [
            t("{key!r} {count} times", key=key, count=n)
            for key, n in result["counted_in"].items()
            if n > 1
        ]
        said = t(
            "wait_for_world returned on rank {rank} although only {joined} of the {world_size} "
            "ranks ever started",
            rank=rank,
            joined=joined,
            world_size=world_size,
        )
        if extra:
            said += t(
                ": rank {rank} added 1 to {keys}. Count yourself in once (store.add(key, 1)), "
                "then only read the total (store.add(key, 0))",
                rank=rank,
                keys=", ".join(extra),
            )
        else:
            said += t(": wait until the count reaches world_size, or raise WorldSizeMismatch")
        raise AssertionError(said)
    if how == "other":
        raise AssertionError(
            t(
                "rank {rank} raised {message} instead of WorldSizeMismatch: turn the failure into "
                "your own error, which says how many ranks joined out of how many",
                rank=rank,
                message=message,
            )
        )


def _check_said(rank: int, result: dict, joined: int, world_size: int) -> None:
    """... in time, with a message that names the rank and the count."""
    message = result["message"]
    assert f"rank {rank}" in message and f"{joined} of {world_size}" in message, t(
        "rank {rank}'s WorldSizeMismatch should name the rank ('rank {rank}') and the count "
        "('{joined} of {world_size}', as _too_few does); it said: {message!r}",
        rank=rank,
        joined=joined,
        world_size=world_size,
        message=message,
    )
    assert result["seconds"] < GIVE_UP_WITHIN_S, t(
        "rank {rank} took {seconds} s to give up with join_timeout_s={join_timeout}: stop "
        "waiting once the join timeout has passed",
        rank=rank,
        seconds=f"{result['seconds']:.1f}",
        join_timeout=f"{result['join_timeout_s']:g}",
    )


@pytest.mark.step(2)
def test_wait_for_world_returns_once_every_rank_has_joined(kata):
    """Checked first: a wait that never returns (or waits out the timeout) is named here."""
    results = with_free_port(
        lambda port: run_world(
            _right_size_join, 3, port, init_group=False, deadline=DEADLINE_S, straggler=STRAGGLER_S
        )
    )
    last_joined = max(r["started"] for r in results)
    for rank, result in enumerate(results):
        assert result["how"] == "returned", t(
            "rank {rank} of a world of 3 in which all 3 ranks joined ended with {how} "
            "{message!r}: wait_for_world must return once world_size ranks have counted "
            "themselves in. Re-read the count (store.add(key, 0)) while you wait: the total you "
            "got when you counted yourself in does not grow by itself.",
            rank=rank,
            how=result["how"],
            message=result["message"],
        )
        waited = result["started"] + result["seconds"] - last_joined
        assert waited < 4.0, t(
            "rank {rank} returned {seconds} s after the last rank had joined, with "
            "join_timeout_s=8: return as soon as the count reaches world_size (poll it), not "
            "after the join timeout",
            rank=rank,
            seconds=f"{waited:.1f}",
        )


@pytest.mark.step(2)
def test_wait_for_world_gives_up_when_too_few_join(kata):
    """World size 4 but 2 ranks: both give up within seconds, rank 0 last, saying 2 of 4."""
    results = with_free_port(
        lambda port: run_world(_too_few_join, 2, 4, port, init_group=False, deadline=DEADLINE_S)
    )
    for rank, result in enumerate(results):
        _check_stopped(rank, result, 2, 4)
    late = results[1]
    if late["failures"]:
        raise AssertionError(
            t(
                "rank 0 left while rank 1 was still waiting: rank 1's next store call failed "
                "({failure}). Rank 0 owns the store, and when its process leaves the store goes "
                "with it (a program then prints a C++ stack trace for every rank still polling). "
                "Rank 0 must leave last: before raising, call _rank_zero_leaves_last(store, rank, "
                "joined), which waits until every rank that joined has given up.",
                failure=late["failures"][0],
            )
        )
    for rank, result in enumerate(results):
        _check_said(rank, result, 2, 4)
        polls = result["calls"] / max(result["seconds"], 0.1)
        assert polls < 200, t(
            "rank {rank} called the store {calls} times in {seconds} s: each call is a round "
            "trip to rank 0's store. Sleep a little (0.05 s) between polls.",
            rank=rank,
            calls=result["calls"],
            seconds=f"{result['seconds']:.1f}",
        )


def _rank_zero_vanishes(rank, processes, world_size, port):
    """Rank 0 opens the store and leaves once rank 1 has counted itself in (as if it crashed)."""
    kata = load_kata(KATA)
    store = _open_store(rank, world_size, port)
    if rank == 0:
        end = time.monotonic() + 5.0
        while store.add(kata.JOINED_KEY, 0) < 1 and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.3)
        return None
    return _wait(kata, store, rank, world_size, join_timeout_s=5.0)


@pytest.mark.step(2)
def test_wait_for_world_reports_a_vanished_rank_zero_as_a_mismatch(kata):
    results = with_free_port(
        lambda port: run_world(
            _rank_zero_vanishes, 2, 4, port, init_group=False, deadline=DEADLINE_S, straggler=None
        )
    )
    result = results[1]
    if len(result["failures"]) > 1:
        raise AssertionError(
            t(
                "rank 1 called rank 0's store {count} times after it had failed ({failure}): "
                "rank 0 is gone and will not come back, so raise WorldSizeMismatch at once",
                count=len(result["failures"]),
                failure=result["failures"][0],
            )
        )
    if result["how"] == "other":
        raise AssertionError(
            t(
                "rank 0 went away while rank 1 waited for the world, and rank 1 raised "
                "{message}: when rank 0 is gone (it crashed, or gave up first) the store calls "
                "raise a RuntimeError; report that as the same WorldSizeMismatch (_too_few)",
                message=result["message"],
            )
        )
    _check_stopped(1, result, 1, 4)
    _check_said(1, result, 1, 4)


def _right_size_join(rank, world_size, port):
    kata = load_kata(KATA)
    store = _open_store(rank, world_size, port)
    result = _wait(kata, store, rank, world_size, join_timeout_s=8.0)
    store.add("test/done", 1)
    if rank == 0:  # keep the store open until every rank has finished with it
        end = time.monotonic() + 10.0
        while store.add("test/done", 0) < world_size and time.monotonic() < end:
            time.sleep(0.05)
    return result


# --------------------------------------------------------------------------- step 3: join_world


def _join(rank, processes, world_size, port):
    """One of ``processes`` processes, each told that the world has ``world_size`` ranks."""
    kata = load_kata(KATA)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.monotonic()
    try:
        kata.join_world(rank, world_size, join_timeout_s=JOIN_TIMEOUT_S, timeout_s=4.0)
    except kata.WorldSizeMismatch as error:
        return {"outcome": "mismatch", "message": str(error), "seconds": time.monotonic() - start}
    except KataTodo:
        raise
    except Exception as error:
        return {
            "outcome": "other",
            "message": f"{type(error).__name__}: {str(error).splitlines()[0]}",
            "seconds": time.monotonic() - start,
            # a store opened by init_process_group (env://) or by join_world's own code
            "in_init": any(
                frame.name == "init_process_group"
                for frame in traceback.extract_tb(error.__traceback__)
            ),
        }
    total = torch.tensor([1])
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    return {"outcome": "joined", "sum": int(total.item()), "seconds": time.monotonic() - start}


def _why_not_mismatch(rank: int, world_size: int, message: str, in_init: bool = False) -> str:
    """The likely mistake behind a raw failure where a WorldSizeMismatch was expected
    (``in_init``: it was raised inside init_process_group)."""
    text = message.lower()
    if rank >= world_size:
        return t(
            "rank {rank} has no place in a world of {world_size}: refuse it before touching the "
            "store (check_rank first)",
            rank=rank,
            world_size=world_size,
        )
    if "address already in use" in text and in_init:
        return t(
            "rank 0's own store already holds MASTER_PORT, and init_process_group opened a "
            "second one there (env://): init_process_group must reuse it (store=store)"
        )
    if "address already in use" in text:
        return t(
            "rank {rank} tried to open the store on MASTER_PORT as well: only rank 0 opens the "
            "store (is_master=(rank == 0)); the others connect to it",
            rank=rank,
        )
    # a store client that cannot connect: timed out, or (on a busy machine) its wait cut short
    if any(word in text for word in ("timed out", "timeout", "distnetworkerror", "interrupted")):
        return t(
            "something waited for ranks that never came: count who joined (wait_for_world) "
            "before init_process_group, and turn a store that cannot be reached into "
            "WorldSizeMismatch"
        )
    return _raw_failure()


def _raw_failure() -> str:
    """The last resort of _why_not_mismatch (``_check_joined`` says more in its place)."""
    return t("turn the raw failure into your own error")


def _check_mismatch(rank, world_size, result, must_mention):
    if result["outcome"] == "other":
        raise AssertionError(
            t(
                "rank {rank} failed with {message!r} instead of your WorldSizeMismatch: {why}",
                rank=rank,
                message=result["message"],
                why=_why_not_mismatch(rank, world_size, result["message"], result["in_init"]),
            )
        )
    assert result["outcome"] == "mismatch", t(
        "rank {rank} should have raised WorldSizeMismatch, but it {outcome}",
        rank=rank,
        outcome=result["outcome"],
    )
    # A rank beyond the world must be refused for that reason, not for what went wrong after.
    why = f": {_why_not_mismatch(rank, world_size, '')}" if rank >= world_size else ""
    for text in must_mention:
        assert re.search(text, result["message"]), t(
            "rank {rank}'s error should mention {text!r}; it said: {message!r}{why}",
            rank=rank,
            text=text,
            message=result["message"],
            why=why,
        )
    assert result["seconds"] < GIVE_UP_WITHIN_S, t(
        "rank {rank} took {seconds} s to give up with join_timeout_s={join_timeout}: stop "
        "waiting once the join timeout has passed",
        rank=rank,
        seconds=f"{result['seconds']:.1f}",
        join_timeout=JOIN_TIMEOUT_S,
    )


def _check_joined(world_size: int, results: dict) -> None:
    """Every rank in ``results`` (rank -> outcome) belongs to the world and must have joined it."""
    failed = {r: res for r, res in results.items() if res["outcome"] != "joined"}
    if failed:
        # The rank whose own error shows the mistake, rather than a peer left waiting for it.
        telling = sorted(  # rank 0 last: it may only have lost the race to bind the port
            (r for r, res in failed.items() if "already in use" in res["message"]),
            key=lambda r: r == 0,
        )
        rank = (
            telling or [r for r, res in failed.items() if res["outcome"] == "other"] or [*failed]
        )[0]
        message = failed[rank]["message"]
        why = _why_not_mismatch(rank, world_size, message, failed[rank].get("in_init", False))
        if failed[rank]["outcome"] == "mismatch" and why == _raw_failure():
            why = t(
                "all {world_size} ranks were started, so no rank may give up: does every rank "
                "reach rank 0's store and count itself in?",
                world_size=world_size,
            )
        raise AssertionError(
            t(
                "rank {rank} belongs to the world of {world_size} but did not join it: {message}",
                rank=rank,
                world_size=world_size,
                message=message,
            )
            + f"\n{why}"
        )
    for rank, result in results.items():
        assert result["sum"] == world_size, t(
            "rank {rank}: the world of {world_size} all-reduced to {total}, expected {world_size}",
            rank=rank,
            world_size=world_size,
            total=result["sum"],
        )


@pytest.mark.step(3)
def test_too_many_processes_the_tutorials_failure(kata):
    """4 processes, world size 2: ranks 0 and 1 form the world; ranks 2 and 3 are refused."""
    results = with_free_port(
        lambda port: run_world(
            _join, 4, 2, port, init_group=False, deadline=DEADLINE_S, straggler=STRAGGLER_S
        )
    )
    for rank in (2, 3):
        _check_mismatch(rank, 2, results[rank], [rf"\brank {rank}\b", r"\b2\b"])
    _check_joined(2, {0: results[0], 1: results[1]})


@pytest.mark.step(3)
def test_too_few_processes_fails_fast_instead_of_hanging(kata):
    """World size 4 but 2 processes: both ranks give up within seconds, saying 2 of 4 joined."""
    results = with_free_port(
        lambda port: run_world(
            _join, 2, 4, port, init_group=False, deadline=DEADLINE_S, straggler=STRAGGLER_S
        )
    )
    for rank in (0, 1):
        _check_mismatch(rank, 4, results[rank], [rf"\brank {rank}\b", r"\b2 of 4\b"])


@pytest.mark.step(3)
def test_the_right_world_size_still_forms(kata):
    results = with_free_port(
        lambda port: run_world(
            _join, 3, 3, port, init_group=False, deadline=DEADLINE_S, straggler=STRAGGLER_S
        )
    )
    _check_joined(3, dict(enumerate(results)))


def _join_without_rank_zero(rank, world_size, port):
    return _join(1, 2, 2, port)  # rank 1 of a world of 2, and no rank 0 anywhere


@pytest.mark.step(3)
def test_a_rank_that_cannot_reach_rank_zero_fails_fast(kata):
    [result] = with_free_port(
        lambda port: run_world(
            _join_without_rank_zero, 1, port, init_group=False, deadline=DEADLINE_S
        )
    )
    _check_mismatch(1, 2, result, [r"\brank 1\b", r"(?i)rank 0"])


# --------------------------------------------------------------------------- the program

_RAW = re.compile(
    r"Exception raised from|frame #\d|TCPStore\.cpp|socket\.cpp|Traceback \(most recent|"
    r"\b(?:RuntimeError|DistNetworkError|DistStoreError)\b"
)


def _check_clear_output(result, command: str) -> None:
    """The program's output holds the WorldSizeMismatch lines only: no C++ trace, no raw error."""
    output = f"{result.stdout}\n{result.stderr}"
    found = _RAW.search(output)
    if not found:
        return
    lines = output[output.rfind("\n", 0, found.start()) + 1 :].splitlines()[:3]
    if re.search(r"(?i)connection was likely closed|failed to recv|connection reset", output):
        why = t(
            "a rank's store call failed because rank 0 had already left: rank 0 owns the store "
            "and must leave last (in wait_for_world, call _rank_zero_leaves_last(store, rank, "
            "joined) before raising)"
        )
    else:
        why = t("a raw error escaped: turn every failure to form the world into WorldSizeMismatch")
    raise AssertionError(
        t(
            "`{command}` printed a C++ stack trace or a raw error instead of only the clear "
            "WorldSizeMismatch lines: {why}. It printed:",
            command=command,
            why=why,
        )
        + "\n"
        + "\n".join(lines)
        + "\n...\n"
        + f"stdout:\n{result.stdout}"
    )


@pytest.mark.step(3)
def test_program_fails_like_the_tutorial_with_a_clear_error(kata):
    result = with_free_port(lambda port: run_module(KATA, "--master-port", str(port), timeout=90))
    command = f"python -m katas.{KATA}"
    assert result.returncode != 0, t(
        "4 processes with world size 2 must make `{command}` fail (non-zero exit); it exited 0:"
        "\n{stdout}",
        command=command,
        stdout=result.stdout,
    )
    for rank in (2, 3):
        assert re.search(rf"\[rank {rank}\] WorldSizeMismatch: .*rank {rank}", result.stdout), t(
            "expected rank {rank}'s WorldSizeMismatch in the output:\n{stdout}\n{stderr}",
            rank=rank,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    _check_clear_output(result, command)


@pytest.mark.step(3)
def test_program_with_fewer_processes_fails_within_seconds(kata):
    result = with_free_port(
        lambda port: run_module(KATA, "--fewer", "--master-port", str(port), timeout=90)
    )
    command = f"python -m katas.{KATA} --fewer"
    assert result.returncode != 0, t(
        "world size 4 with 2 processes must make `{command}` fail; it exited 0:\n{stdout}",
        command=command,
        stdout=result.stdout,
    )
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] WorldSizeMismatch: .*of 4", result.stdout), t(
            "expected rank {rank}'s WorldSizeMismatch in the output:\n{stdout}\n{stderr}",
            rank=rank,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    assert "2 of 4" in result.stdout, t(
        "expected '2 of 4' (ranks joined of the world size) in the output:\n{stdout}",
        stdout=result.stdout,
    )
    _check_clear_output(result, command)
