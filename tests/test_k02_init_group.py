"""k02 init group: env:// rendezvous with a timeout, a barrier, destroy, two worlds side by side."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dojo.impl import load_kata
from dojo.testing import free_port, run_program, with_free_port
from dojo.world import run_world

KATA = "k02_init_group"


@pytest.mark.step(1)
def test_set_master_writes_the_environment(kata, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "unset")  # restored after the test
    monkeypatch.setenv("MASTER_PORT", "unset")
    kata.set_master("127.0.0.1", 29511)
    got = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    assert got == ("127.0.0.1", "29511"), (
        f"after set_master('127.0.0.1', 29511) the environment holds MASTER_ADDR, MASTER_PORT = {got}; "
        "env:// reads these two variables, as strings"
    )


@pytest.mark.step(1)
@pytest.mark.parametrize("port", [0, 70000, -1, "29500"])
def test_set_master_refuses_a_bad_port(kata, monkeypatch, port):
    monkeypatch.setenv("MASTER_ADDR", "unset")
    monkeypatch.setenv("MASTER_PORT", "unset")
    with pytest.raises(ValueError, match="(?i)port") as caught:
        kata.set_master("127.0.0.1", port)
    assert str(port) in str(caught.value), (
        f"say which port was wrong; the message was: {caught.value}"
    )


def _whoami(rank, world_size):
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
    }


def _join(rank, world_size, port):
    """Run the learner's init_process, recording how it called init_process_group."""
    kata = load_kata(KATA)
    calls = []
    original = dist.init_process_group

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    dist.init_process_group = recording
    try:
        kata.set_master("127.0.0.1", port)
        seen = kata.init_process(rank, world_size, _whoami, timeout_s=12.5)
    finally:
        dist.init_process_group = original
    return {"seen": seen, "calls": calls, "still_initialized": dist.is_initialized()}


@pytest.mark.step(2)
def test_four_ranks_join_with_their_rank_a_world_of_four_and_a_timeout(kata):
    results = with_free_port(lambda port: run_world(_join, 4, port, init_group=False))
    for rank, result in enumerate(results):
        assert len(result["calls"]) == 1, (
            f"rank {rank} called dist.init_process_group {len(result['calls'])} times, expected once "
            "(call it as dist.init_process_group so the test can see it)"
        )
        args, kwargs = result["calls"][0]
        timeout = kwargs.get("timeout")
        assert timeout == timedelta(seconds=12.5), (
            f"rank {rank} called init_process_group with timeout={timeout!r}; pass "
            "timeout=timedelta(seconds=timeout_s): gloo's default would freeze a broken world for 30 minutes"
        )
        seen = result["seen"]
        assert (seen["rank"], seen["world_size"]) == (rank, 4), (
            f"the process started as rank {rank} of 4 joined as rank {seen['rank']} of {seen['world_size']}: "
            "pass rank= and world_size= to init_process_group"
        )
        assert seen["backend"] == "gloo", (
            f"rank {rank}'s group uses {seen['backend']}, expected gloo"
        )
        assert not result["still_initialized"], (
            f"rank {rank}'s process group still exists after init_process returned: call "
            "dist.destroy_process_group() before leaving"
        )


def _slow_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(1.0)
    return time.monotonic()  # CLOCK_MONOTONIC is shared by every process on the machine


def _timed_join(rank, world_size, port):
    kata = load_kata(KATA)
    kata.set_master("127.0.0.1", port)
    finished_work = kata.init_process(rank, world_size, _slow_rank_zero)
    return finished_work, time.monotonic()


@pytest.mark.step(3)
def test_barrier_keeps_every_rank_until_the_slowest_has_finished(kata):
    results = with_free_port(lambda port: run_world(_timed_join, 3, port, init_group=False))
    slowest_done = results[0][0]
    for rank, (_, left) in enumerate(results[1:], start=1):
        assert left >= slowest_done, (
            f"rank {rank} left init_process {slowest_done - left:.2f} s before rank 0 had finished "
            "its work: call dist.barrier() after fn, so no rank leaves while another still works"
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
        assert result["raised"], (
            f"fn raised ValueError on rank {rank}, but init_process swallowed it"
        )
        assert not result["still_initialized"], (
            f"fn raised on rank {rank} and the group was left behind: destroy it in a finally block"
        )


def _sum_of_ranks_plus_one(rank, world_size):
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return int(t.item())


def _two_worlds(rank, world_size, port_a, port_b):
    """Harness ranks 0-1 form world A on port_a, ranks 2-3 world B on port_b, at the same time."""
    kata = load_kata(KATA)
    kata.set_master("127.0.0.1", port_a if rank < 2 else port_b)
    return kata.init_process(rank % 2, 2, _sum_of_ranks_plus_one)


@pytest.mark.step(2)
def test_two_worlds_side_by_side_do_not_interfere(kata):
    results = with_free_port(lambda a: run_world(_two_worlds, 4, a, free_port(), init_group=False))
    assert results == [3, 3, 3, 3], (
        f"two worlds of 2 on two ports each summed (its rank + 1) and got {results}, expected 3 in "
        "each: a world must only meet the ranks that share its MASTER_PORT"
    )


@pytest.mark.step(3)
def test_program_prints_every_rank_from_the_group(kata):
    result = with_free_port(
        lambda port: run_program(KATA, "--world-size", "4", "--master-port", str(port), timeout=90)
    )
    assert result.returncode == 0, (
        f"the program failed (exit {result.returncode}):\n{result.stderr}"
    )
    for rank in range(4):
        line = f"[rank {rank}] world size:4. I'm rank {rank}."
        assert line in result.stdout.splitlines(), (
            f"expected the line {line!r} in:\n{result.stdout}"
        )
