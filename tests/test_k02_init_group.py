"""k02 init group: env:// rendezvous with a timeout, a barrier, destroy, two worlds side by side."""

import inspect
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.lang import t
from dojo.spec.testing import free_port, run_module_ok, with_free_port
from dojo.todo import KataTodo

KATA = "k02_init_group"

# --------------------------------------------------------------------------- step 1: set_master


@pytest.mark.step(1)
def test_set_master_writes_the_environment(kata, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "unset")  # restored after the test
    monkeypatch.setenv("MASTER_PORT", "unset")
    try:
        kata.set_master("127.0.0.1", 29511)
    except TypeError as error:
        pytest.fail(
            t(
                "set_master('127.0.0.1', 29511) raised TypeError: {error}. os.environ holds "
                "strings only: store the port as str(port)",
                error=error,
            )
        )
    got = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if got[1] == "29500":
        pytest.fail(
            t(
                "after set_master('127.0.0.1', 29511) MASTER_PORT is '29500', the tutorial's "
                "port: use the port set_master was given (two jobs on one machine need two ports)"
            )
        )
    assert got == ("127.0.0.1", "29511"), t(
        "after set_master('127.0.0.1', 29511) the environment holds MASTER_ADDR, MASTER_PORT = "
        "{got}, expected ('127.0.0.1', '29511'): env:// reads these two variables, as strings",
        got=got,
    )


_WHY_BAD = {  # said when the test fails, in the learner's language
    0: lambda: t(
        "a port is a number from 1 to 65535; port 0 asks the system for any free port, which "
        "the other ranks could not know"
    ),
    70000: lambda: t("port numbers end at 65535"),
    -1: lambda: t("port numbers start at 1"),
    "29500": lambda: t(
        "a port must be an int from 1 to 65535, and this is the str '29500': os.environ holds "
        "strings, but set_master takes the number, checks it, and converts it itself"
    ),
}


def _port_id(port) -> str:
    return f"{type(port).__name__}-{port!r}"


@pytest.mark.step(1)
@pytest.mark.parametrize("port", list(_WHY_BAD), ids=_port_id)
def test_set_master_refuses_a_bad_port(kata, monkeypatch, port):
    monkeypatch.setenv("MASTER_ADDR", "unset")
    monkeypatch.setenv("MASTER_PORT", "unset")
    call = f"set_master('127.0.0.1', {port!r})"
    try:
        kata.set_master("127.0.0.1", port)
    except ValueError as error:
        message = str(error)
    except KataTodo:
        raise
    except Exception as error:
        pytest.fail(
            t(
                "{call} raised {error_type}: {error}. Expected a ValueError that names the port: "
                "{why}. Check the port before using it.",
                call=call,
                error_type=type(error).__name__,
                error=error,
                why=_WHY_BAD[port](),
            )
        )
    else:
        pytest.fail(
            t(
                "{call} returned without an error; expected a ValueError that names the port: "
                "{why}",
                call=call,
                why=_WHY_BAD[port](),
            )
        )
    assert str(port) in message and "port" in message.lower(), t(
        "{call} raised ValueError({message!r}): say that the port is wrong and which port it was "
        "({port!r}), so the caller can fix the call",
        call=call,
        message=message,
        port=port,
    )
    assert os.environ["MASTER_PORT"] == "unset", t(
        "{call} raised ValueError but left MASTER_PORT={port!r} in the environment: check the "
        "port first, and change nothing when it is wrong",
        call=call,
        port=os.environ["MASTER_PORT"],
    )


# --------------------------------------------------------------------------- step 2: init


def _whoami(rank, world_size):
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
    }


def _call_of(original, args, kwargs) -> dict:
    """How init_process_group was called, by parameter name."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError:
        bound = dict(kwargs)
    return {
        name: bound.get(name, default)
        for name, default in (
            ("backend", None),
            ("init_method", None),
            ("timeout", None),
            ("world_size", -1),
            ("rank", -1),
        )
    } | {"store": bound.get("store") is not None}


def _join(rank, world_size, port):
    """Run the learner's init_process, recording how it called init_process_group."""
    kata = load_kata(KATA)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)  # env:// must learn them from init_process's arguments
    calls = []
    original = dist.init_process_group

    def recorded(*args, **kwargs):
        calls.append(_call_of(original, args, kwargs))
        return original(*args, **kwargs)

    dist.init_process_group = recorded
    seen, error = None, None
    try:
        kata.set_master("127.0.0.1", port)
        seen = kata.init_process(rank, world_size, _whoami, timeout_s=12.5)
    except KataTodo:
        raise
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    finally:
        dist.init_process_group = original
    return {
        "seen": seen,
        "error": error,
        "calls": calls,
        "still_initialized": dist.is_initialized(),
    }


def _check_the_call(rank: int, call: dict, error: str | None) -> None:
    if call["rank"] == -1 or call["world_size"] == -1:
        raise AssertionError(
            t(
                "rank {rank} called init_process_group without rank= and world_size=, so env:// "
                "looked for them in the environment variables RANK and WORLD_SIZE, which nobody "
                "set here{error}. Pass rank=rank and world_size=world_size.",
                rank=rank,
                error=f" ({error})" if error else "",
            )
        )
    assert (call["rank"], call["world_size"]) == (rank, 4), t(
        "the process started as rank {rank} of 4 called init_process_group with "
        "rank={given_rank!r}, world_size={given_size!r}: pass init_process's own rank and "
        "world_size",
        rank=rank,
        given_rank=call["rank"],
        given_size=call["world_size"],
    )
    timeout = call["timeout"]
    if timeout is None:
        raise AssertionError(
            t(
                "rank {rank} called init_process_group without a timeout: gloo's default would "
                "freeze a broken world for 30 minutes. Pass timeout=timedelta(seconds=timeout_s).",
                rank=rank,
            )
        )
    if not isinstance(timeout, timedelta):
        raise AssertionError(
            t(
                "rank {rank} called init_process_group with timeout={timeout!r}, a {type_name}: "
                "it takes a datetime.timedelta (a number raises TypeError). Pass "
                "timeout=timedelta(seconds=timeout_s).",
                rank=rank,
                timeout=timeout,
                type_name=type(timeout).__name__,
            )
        )
    if timeout == timedelta(days=12.5):
        raise AssertionError(
            t(
                "rank {rank} called init_process_group with timeout={timeout!r}, 12.5 days: "
                "timedelta's first argument is days. Write timedelta(seconds=timeout_s).",
                rank=rank,
                timeout=timeout,
            )
        )
    assert timeout == timedelta(seconds=12.5), t(
        "init_process(..., timeout_s=12.5) called init_process_group with timeout={timeout!r} "
        "on rank {rank}: pass timeout=timedelta(seconds=timeout_s)",
        timeout=timeout,
        rank=rank,
    )


@pytest.mark.step(2)
def test_four_ranks_join_with_their_rank_a_world_of_four_and_a_timeout(kata):
    results = with_free_port(lambda port: run_world(_join, 4, port, init_group=False))
    for rank, result in enumerate(results):
        assert len(result["calls"]) == 1, t(
            "rank {rank} called dist.init_process_group {count} times, expected once (call it as "
            "dist.init_process_group so the test can see it){error}",
            rank=rank,
            count=len(result["calls"]),
            error=t("; init_process raised {error}", error=result["error"])
            if result["error"]
            else "",
        )
        _check_the_call(rank, result["calls"][0], result["error"])
        assert result["error"] is None, t(
            "rank {rank}: init_process raised {error}", rank=rank, error=result["error"]
        )
        seen = result["seen"]
        assert seen is not None, t(
            "init_process returned None on rank {rank}: return fn's result, fn(rank, world_size)",
            rank=rank,
        )
        assert (seen["rank"], seen["world_size"]) == (rank, 4), t(
            "the process started as rank {rank} of 4 joined as rank {joined} of {world_size}: "
            "pass rank= and world_size= to init_process_group",
            rank=rank,
            joined=seen["rank"],
            world_size=seen["world_size"],
        )
        assert seen["backend"] == "gloo", t(
            "rank {rank}'s group uses {backend}, expected gloo: pass init_process's backend on",
            rank=rank,
            backend=seen["backend"],
        )
        assert not result["still_initialized"], t(
            "rank {rank}'s process group still exists after init_process returned: call "
            "dist.destroy_process_group() before leaving",
            rank=rank,
        )


def _sum_of_ranks_plus_one(rank, world_size):
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return int(total.item())


def _two_worlds(rank, world_size, port_a, port_b):
    """Harness ranks 0-1 form world A on port_a, ranks 2-3 world B on port_b, at the same time."""
    kata = load_kata(KATA)
    kata.set_master("127.0.0.1", port_a if rank < 2 else port_b)
    return kata.init_process(rank % 2, 2, _sum_of_ranks_plus_one)


@pytest.mark.step(2)
def test_two_worlds_side_by_side_do_not_interfere(kata):
    results = with_free_port(lambda a: run_world(_two_worlds, 4, a, free_port(), init_group=False))
    assert results == [3, 3, 3, 3], t(
        "two worlds of 2 on two ports each summed (its rank + 1) and got {results}, expected 3 "
        "in each: a world must only meet the ranks that share its MASTER_PORT",
        results=results,
    )


# --------------------------------------------------------------------------- step 3: leave


_RECORD = {}  # inside a rank: the calls recorded so far, and how many there were when fn ended


def _slow_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(1.0)
    _RECORD["at_fn_end"] = len(_RECORD["calls"])
    return time.monotonic()  # CLOCK_MONOTONIC is shared by every process on the machine


def _timed_join(rank, world_size, port):
    kata = load_kata(KATA)
    kata.set_master("127.0.0.1", port)
    with recording() as calls:
        _RECORD.update(calls=calls, at_fn_end=None)
        finished_work = kata.init_process(rank, world_size, _slow_rank_zero)
    collectives = [c.name for c in calls]
    end = _RECORD["at_fn_end"]
    return {
        "finished_work": finished_work,
        "left": time.monotonic(),
        "before_fn_end": collectives[:end] if end is not None else collectives,
        "after_fn_end": collectives[end:] if end is not None else [],
    }


@pytest.mark.step(3)
def test_barrier_keeps_every_rank_until_the_slowest_has_finished(kata):
    # Ranks 1 and 2 may return a second before rank 0 (that is the mistake this test names): a
    # wide straggler window keeps a loaded machine from turning that into a deadlock report.
    results = with_free_port(
        lambda port: run_world(_timed_join, 3, port, init_group=False, straggler=20)
    )
    for rank, result in enumerate(results):
        if not result["after_fn_end"]:
            early = "barrier" in result["before_fn_end"]
            said = (
                t("rank {rank} called dist.barrier() before fn, not after it", rank=rank)
                if early
                else t("rank {rank} called no dist.barrier()", rank=rank)
            )
            raise AssertionError(
                said
                + t(
                    ": a rank whose fn finished first then left init_process (and destroyed its "
                    "group) while rank 0's fn was still working. Call dist.barrier() after fn, "
                    "so that no rank leaves before every rank has finished."
                )
            )
    slowest_done = results[0]["finished_work"]
    for rank, result in enumerate(results[1:], start=1):
        assert result["left"] >= slowest_done, t(
            "rank {rank} left init_process {seconds} s before rank 0 had finished its work: "
            "call dist.barrier() after fn, so no rank leaves while another still works",
            rank=rank,
            seconds=f"{slowest_done - result['left']:.2f}",
        )


def _raise_inside(rank, world_size):
    # Fail only once every rank is in the group: a rank that destroys its group while a peer is
    # still connecting (gloo's init is not a barrier) breaks that peer's init, which is not what
    # this test is about.
    dist.barrier()
    raise ValueError("fn failed on purpose")


def _join_failing(rank, world_size, port):
    kata = load_kata(KATA)
    kata.set_master("127.0.0.1", port)
    try:
        kata.init_process(rank, world_size, _raise_inside)
    except ValueError:
        return {"raised": True, "still_initialized": dist.is_initialized()}
    return {"raised": False, "still_initialized": dist.is_initialized()}


@pytest.mark.step(3)
def test_group_is_destroyed_even_when_fn_raises(kata):
    results = with_free_port(lambda port: run_world(_join_failing, 2, port, init_group=False))
    for rank, result in enumerate(results):
        assert result["raised"], t(
            "fn raised ValueError on rank {rank}, but init_process returned as if all was well: "
            "let fn's error through to the caller (clean up in a finally block, do not catch it)",
            rank=rank,
        )
        assert not result["still_initialized"], t(
            "fn raised on rank {rank} and the group was left behind: call "
            "dist.destroy_process_group() in a finally block, which runs when fn raises too",
            rank=rank,
        )


def _join_a_taken_port(rank, world_size):
    """Rank 0 of a world of 1, on a port another program is listening on."""
    kata = load_kata(KATA)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        kata.set_master("127.0.0.1", taken.getsockname()[1])
        try:
            kata.init_process(0, 1, _whoami, timeout_s=10.0)
        except KataTodo:
            raise
        except Exception as error:
            return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.step(3)
def test_a_failed_init_is_reported_as_itself(kata):
    [error] = run_world(_join_a_taken_port, 1, init_group=False)
    assert error is not None, t(
        "init_process returned although MASTER_PORT was taken by another program: "
        "init_process_group's error must reach the caller"
    )
    assert "address already in use" in error.lower(), t(
        "MASTER_PORT was taken by another program, so dist.init_process_group failed with "
        "'address already in use'; but init_process raised something else:\n  {error}\n"
        "The cleanup ran although no group was ever made, and its own error hid the real one. "
        "Call init_process_group before the try: only a group that exists can be destroyed.",
        error=error.splitlines()[0],
    )


@pytest.mark.step(3)
def test_program_prints_every_rank_from_the_group(kata):
    out = with_free_port(
        lambda port: run_module_ok(
            KATA, "--world-size", "4", "--master-port", str(port), timeout=90
        )
    ).stdout
    for rank in range(4):
        line = f"[rank {rank}] world size:4. I'm rank {rank}."
        assert line in out.splitlines(), t(
            "expected the line {line!r} in:\n{out}", line=line, out=out
        )
