"""k03 world-size mismatch: both bad worlds started for real, each ending in a clear error fast."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from dojo.impl import load_kata
from dojo.testing import run_program, with_free_port
from dojo.world import run_world

KATA = "k03_world_size"
JOIN_TIMEOUT_S = 2.0
# Harness deadline: generous next to the 2 s join timeout, far below gloo's 30 minutes.
DEADLINE_S = 20.0


@pytest.mark.step(1)
@pytest.mark.parametrize("rank, world_size", [(2, 2), (3, 2), (-1, 4), (7, 4)])
def test_check_rank_refuses_a_rank_outside_the_world(kata, rank, world_size):
    with pytest.raises(kata.WorldSizeMismatch) as caught:
        kata.check_rank(rank, world_size)
    message = str(caught.value)
    assert f"rank {rank}" in message and str(world_size) in message, (
        f"the error must name rank {rank} and the world size {world_size}; it said: {message!r}"
    )


@pytest.mark.step(1)
@pytest.mark.parametrize("rank, world_size", [(0, 1), (0, 2), (1, 2), (3, 4)])
def test_check_rank_accepts_ranks_inside_the_world(kata, rank, world_size):
    kata.check_rank(rank, world_size)  # must not raise


def _join(rank, processes, world_size, port):
    """One of ``processes`` processes, each told that the world has ``world_size`` ranks."""
    kata = load_kata(KATA)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.monotonic()
    try:
        kata.join_world(rank, world_size, join_timeout_s=JOIN_TIMEOUT_S)
    except kata.WorldSizeMismatch as error:
        return {"outcome": "mismatch", "message": str(error), "seconds": time.monotonic() - start}
    except Exception as error:
        if type(error).__name__ == "KataTodo":
            raise
        return {
            "outcome": "other",
            "message": f"{type(error).__name__}: {error}",
            "seconds": time.monotonic() - start,
        }
    total = torch.tensor([1])
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    return {"outcome": "joined", "sum": int(total.item()), "seconds": time.monotonic() - start}


def _check_mismatch(rank, result, must_mention):
    assert result["outcome"] != "other", (
        f"rank {rank} failed with {result['message']!r} instead of your WorldSizeMismatch: turn the "
        "raw failure into your own error"
    )
    assert result["outcome"] == "mismatch", (
        f"rank {rank} should have raised WorldSizeMismatch, but it {result['outcome']}"
    )
    for text in must_mention:
        assert re.search(text, result["message"]), (
            f"rank {rank}'s error should mention {text!r}; it said: {result['message']!r}"
        )
    assert result["seconds"] < JOIN_TIMEOUT_S + 5, (
        f"rank {rank} took {result['seconds']:.1f} s to give up with join_timeout_s={JOIN_TIMEOUT_S}: "
        "stop waiting once the join timeout has passed"
    )


@pytest.mark.step(3)
def test_too_many_processes_the_tutorials_failure(kata):
    """4 processes, world size 2: ranks 0 and 1 form the world; ranks 2 and 3 are refused."""
    results = with_free_port(
        lambda port: run_world(_join, 4, 2, port, init_group=False, deadline=DEADLINE_S)
    )
    for rank in (0, 1):
        assert results[rank]["outcome"] == "joined", (
            f"rank {rank} belongs to the world of 2 but did not join it: {results[rank].get('message')}"
        )
        assert results[rank]["sum"] == 2, (
            f"the world of 2 all-reduced to {results[rank]['sum']}, expected 2"
        )
    for rank in (2, 3):
        _check_mismatch(rank, results[rank], [rf"\brank {rank}\b", r"\b2\b"])


@pytest.mark.step(2)
def test_too_few_processes_fails_fast_instead_of_hanging(kata):
    """World size 4 but 2 processes: both ranks give up within seconds, saying 2 of 4 joined."""
    results = with_free_port(
        lambda port: run_world(_join, 2, 4, port, init_group=False, deadline=DEADLINE_S)
    )
    for rank in (0, 1):
        _check_mismatch(rank, results[rank], [rf"\brank {rank}\b", r"\b2 of 4\b"])


@pytest.mark.step(3)
def test_the_right_world_size_still_forms(kata):
    results = with_free_port(
        lambda port: run_world(_join, 3, 3, port, init_group=False, deadline=DEADLINE_S)
    )
    for rank, result in enumerate(results):
        assert result["outcome"] == "joined", (
            f"rank {rank} of a correct world of 3 did not join: {result.get('message')}"
        )
        assert result["sum"] == 3, (
            f"rank {rank}: the world of 3 all-reduced to {result['sum']}, expected 3"
        )


@pytest.mark.step(3)
def test_program_fails_like_the_tutorial_with_a_clear_error(kata):
    result = with_free_port(lambda port: run_program(KATA, "--master-port", str(port), timeout=90))
    assert result.returncode != 0, (
        "4 processes with world size 2 must make the program fail (non-zero exit)"
    )
    for rank in (2, 3):
        assert re.search(rf"\[rank {rank}\] WorldSizeMismatch: .*rank {rank}", result.stdout), (
            f"expected rank {rank}'s WorldSizeMismatch in the output:\n{result.stdout}\n{result.stderr}"
        )


@pytest.mark.step(2)
def test_program_with_fewer_processes_fails_within_seconds(kata):
    result = with_free_port(
        lambda port: run_program(KATA, "--fewer", "--master-port", str(port), timeout=90)
    )
    assert result.returncode != 0, "world size 4 with 2 processes must make the program fail"
    assert "2 of 4" in result.stdout, (
        f"expected '2 of 4' in the output:\n{result.stdout}\n{result.stderr}"
    )
