"""k07 point-to-point: ping-pong, a token ring, a shift that cannot deadlock, irecv and wait, a halo."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dojo.impl import load_kata
from dojo.testing import refusal, run_program
from dojo.world import WorldDeadlock, run_world

KATA = "k07_point_to_point"
DEADLINE_S = 10.0  # correct code finishes in well under a second; a deadlock ends here
BIG = 1 << 21  # int32 elements per rank in a shift: 8 MB, more than any backend buffers


def _run(fn, world_size, *args, hint="", deadline=DEADLINE_S):
    """run_world, with a hint for the learner in front of a deadlock report."""
    try:
        return run_world(fn, world_size, *args, deadline=deadline)
    except WorldDeadlock as deadlock:
        if not hint:
            raise
        report = str(deadlock)
    pytest.fail(f"{hint}\n\n{report}", pytrace=False)  # outside `except`: the report once


# ------------------------------------------------------------------------------ step 1


def _ping_pong(rank, world_size, rounds):
    return load_kata(KATA).ping_pong(rounds)


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ping_pong(world_size):
    rounds = 3
    results = _run(
        _ping_pong,
        world_size,
        rounds,
        hint="ping-pong deadlocked: rank 0 must send first while rank 1 receives first, and each "
        "send needs the other rank's matching recv.",
    )
    expected = {0: [1, 3, 5], 1: [0, 2, 4]}
    for rank, got in enumerate(results):
        want = expected.get(rank, [])
        if rank > 1:
            assert got == [], (
                f"rank {rank} returned {got!r}, expected []: only ranks 0 and 1 play ping-pong, "
                "the others return an empty list without sending anything"
            )
            continue
        assert isinstance(got, list) and all(type(v) is int for v in got), (
            f"rank {rank} returned {got!r}: return a list of Python ints (use tensor.item())"
        )
        assert got == want, (
            f"rank {rank} received {got}, expected {want} in {rounds} rounds: rank 0 serves 0, "
            "and whoever receives the counter adds 1 before sending it back"
        )


# ------------------------------------------------------------------------------ step 2


def _token_ring(rank, world_size, token):
    return load_kata(KATA).token_ring(token)


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_token_ring(world_size):
    results = _run(
        _token_ring,
        world_size,
        100,
        hint="the token ring deadlocked: if every rank starts with recv, nobody ever sends. Rank 0 "
        "sends first and receives last; every other rank receives first, then sends.",
    )
    for rank, got in enumerate(results):
        if rank == 0:
            want = 100 + sum(r + 1 for r in range(world_size))
            why = "the token goes all the way round, and every rank r adds r + 1 (rank 0 adds 1 before it sends)"
        else:
            want = 100 + sum(r + 1 for r in range(rank))
            why = f"ranks 0..{rank - 1} each added their rank + 1 before it reached rank {rank}"
        assert got == want, f"rank {rank} returned {got!r}, expected {want}: {why}"


# ------------------------------------------------------------------------------ step 3


def _pattern(rank):
    return torch.arange(BIG, dtype=torch.int32) + 1000 * rank


def _shift(rank, world_size, which):
    kata = load_kata(KATA)
    mine = _pattern(rank)
    got = (kata.shift_right if which == "yours" else _naive_shift_right)(mine)
    left = (rank - 1) % world_size
    return {
        "shape": tuple(got.shape),
        "dtype": str(got.dtype),
        "head": got[:3].tolist(),
        "from_left": torch.equal(got, _pattern(left)),
        "sent_intact": torch.equal(mine, _pattern(rank)),
    }


def _naive_shift_right(tensor):
    """The shift everyone writes first: blocking send, then recv. It deadlocks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    dist.send(tensor, dst=(rank + 1) % world_size)
    dist.recv(received, src=(rank - 1) % world_size)
    return received


_SHIFT_DEADLOCK_HINT = (
    "shift_right deadlocked with 8 MB tensors: every rank was stuck in a send while its neighbour "
    "was stuck in one too. Post dist.isend and dist.irecv first, then wait() on both requests."
)


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shift_right(world_size):
    results = _run(_shift, world_size, "yours", hint=_SHIFT_DEADLOCK_HINT)
    for rank, got in enumerate(results):
        left = (rank - 1) % world_size
        assert got["shape"] == (BIG,) and got["dtype"] == "torch.int32", (
            f"rank {rank} returned a tensor of shape {got['shape']} and dtype {got['dtype']}, expected "
            f"({BIG},) int32 like the one it sent: receive into torch.empty_like(tensor)"
        )
        assert got["sent_intact"], (
            f"rank {rank}'s own tensor changed while it was being sent: receive into a new buffer, "
            "never into the tensor an isend is still sending"
        )
        assert got["from_left"], (
            f"rank {rank} returned a tensor starting {got['head']}, expected rank {left}'s, starting "
            f"{_pattern(left)[:3].tolist()}: send to (rank + 1) % world_size, receive from "
            "(rank - 1) % world_size, and wait() on both requests before returning"
        )


def _settle(rank, world_size):
    dist.barrier()


@pytest.mark.step(3)
def test_naive_shift_deadlocks_where_yours_does_not():
    """The proof that test_shift_right can catch a deadlocking shift: the naive one is caught."""
    world_size = 3
    _run(_shift, world_size, "yours", hint=_SHIFT_DEADLOCK_HINT)
    # How long a world takes to start and join its group right now (slow on a busy machine): the
    # naive shift gets three times that to reach its sends and stick there.
    start = time.monotonic()
    run_world(_settle, world_size)
    took = time.monotonic() - start
    try:
        run_world(_shift, world_size, "naive", deadline=1.0 + 3 * took)
    except WorldDeadlock as report:
        text = str(report)
        assert (
            report.stuck == list(range(world_size)) and text.count("dist.send(tensor") == world_size
        ), (
            f"the naive shift should leave every rank stuck in its send, but the report says:\n{text}"
        )
    else:
        pytest.fail(
            "the naive 'send, then recv' shift finished: this backend buffered 8 MB sends, so the "
            "shift tests cannot prove that a shift does not deadlock (raise BIG in this test file)"
        )


# ------------------------------------------------------------------------------ step 4

_SENDER_DELAY_S = 0.3  # the message leaves this long after the receiver has started working
_WAIT_FOR_WORK_S = 5.0


def _receive_while_working(rank, world_size, flag_path):
    expected = torch.arange(1000, dtype=torch.int64) + 100
    if rank == 0:  # the test's sender: it starts only once rank 1's work has begun
        give_up = time.monotonic() + _WAIT_FOR_WORK_S
        while not os.path.exists(flag_path):
            if time.monotonic() > give_up:
                raise AssertionError(
                    f"rank 1 did not call work() within {_WAIT_FOR_WORK_S:g} s while rank 0 held back "
                    "its message: receive_while_working must post dist.irecv (which returns at once) "
                    "and call work() before waiting. A blocking dist.recv waits for the data first."
                )
            time.sleep(0.01)
        time.sleep(_SENDER_DELAY_S)
        dist.send(expected, dst=1)
        return None

    def work():
        open(flag_path, "w").close()
        return "work done"

    buffer = torch.zeros(1000, dtype=torch.int64)
    got, result = load_kata(KATA).receive_while_working(0, buffer, work)
    snapshot = got.clone()  # what the caller sees the moment the function returns
    return {
        "matches": torch.equal(snapshot, expected),
        "head": snapshot[:3].tolist(),
        "result": result,
    }


@pytest.mark.step(4)
def test_receive_while_working_reads_the_buffer_only_after_wait(tmp_path):
    results = _run(_receive_while_working, 2, str(tmp_path / "work-started"))
    got = results[1]
    assert got["result"] == "work done", (
        f"receive_while_working returned {got['result']!r} as work's result, expected 'work done': "
        "return (buffer, work())"
    )
    assert got["matches"], (
        f"rank 1's buffer held {got['head']}... when receive_while_working returned, expected "
        f"[100, 101, 102]...: it was read before the message arrived (the test's sender waits "
        f"{_SENDER_DELAY_S:g} s after your work starts). Call wait() on the irecv's request before "
        "returning the buffer."
    )


# ------------------------------------------------------------------------------ step 5


def _halo(rank, world_size):
    calls = []
    real = dist.batch_isend_irecv

    def counting(ops):
        calls.append(len(ops))
        return real(ops)

    dist.batch_isend_irecv = counting  # this rank process only: see how the learner posts
    try:
        strip = torch.arange(3, dtype=torch.int64) + 10 * rank
        halo = load_kata(KATA).halo_exchange(strip)
    finally:
        dist.batch_isend_irecv = real
    return {"halo": halo.tolist(), "strip": strip.tolist(), "batches": calls}


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_halo_exchange(world_size):
    results = _run(
        _halo,
        world_size,
        hint="the halo exchange deadlocked: post all four operations in one batch_isend_irecv and "
        "wait() on every request it returns.",
    )
    for rank, got in enumerate(results):
        left, right = (rank - 1) % world_size, (rank + 1) % world_size
        strip = [10 * rank + i for i in range(3)]
        want = [10 * left + 2, *strip, 10 * right]
        assert got["batches"], (
            f"rank {rank} never called dist.batch_isend_irecv: this step posts its sends and "
            "receives as one batch of dist.P2POp"
        )
        assert got["strip"] == strip, (
            f"rank {rank}'s strip changed to {got['strip']}: leave it as it was"
        )
        if world_size == 2 and got["halo"] == [10 * left, *strip, 10 * right + 2]:
            pytest.fail(
                f"rank {rank} got {got['halo']}, expected {want}: the two edges are swapped. On a ring "
                "of two, left and right are the same rank, so both messages travel between the same "
                "pair: give 'to the left' and 'to the right' each its own tag, and receive each "
                "direction with the tag it was sent with.",
                pytrace=False,
            )
        assert got["halo"] == want, (
            f"rank {rank} returned {got['halo']}, expected {want}: [left neighbour's last, *strip, "
            f"right neighbour's first], where the left neighbour is rank {left} and the right rank {right}"
        )


# ------------------------------------------------------------------------------ bad input


def _bad_arguments(rank, world_size):
    kata = load_kata(KATA)
    kata.ping_pong(1)  # the functions work ...
    return {  # ... and refuse what cannot work
        "ping_pong(0)": refusal(lambda: kata.ping_pong(0)),
        "halo_exchange(empty strip)": refusal(lambda: kata.halo_exchange(torch.zeros(0))),
        "halo_exchange(2-D strip)": refusal(lambda: kata.halo_exchange(torch.zeros(2, 2))),
    }


def _world_of_one(rank, world_size):
    kata = load_kata(KATA)
    return {
        "ping_pong": refusal(lambda: kata.ping_pong(1)),
        "token_ring": refusal(lambda: kata.token_ring(0)),
        "shift_right": refusal(lambda: kata.shift_right(torch.zeros(1))),
        "halo_exchange": refusal(lambda: kata.halo_exchange(torch.zeros(3))),
    }


@pytest.mark.step(1)
def test_bad_arguments_raise_value_error():
    for outcomes in (_run(_bad_arguments, 2)[0], _run(_world_of_one, 1)[0]):
        for call, outcome in outcomes.items():
            assert outcome is None, (
                f"{call} {outcome}, expected a ValueError that says what is wrong"
            )


# ------------------------------------------------------------------------------ the program


@pytest.mark.step(5)
def test_program_shows_every_exchange(kata, capsys):
    result = run_program(KATA, "--world-size", "3", timeout=120)
    assert result.returncode == 0, (
        f"the program failed (exit {result.returncode}):\n{result.stderr}"
    )
    out = result.stdout
    for lines in (
        ["[rank 0] ping-pong: received [1, 3, 5]", "[rank 1] ping-pong: received [0, 2, 4]"],
        [
            "[rank 0] token ring: got the token back as 106",
            "[rank 1] token ring: received the token as 101",
            "[rank 2] token ring: received the token as 103",
        ],
        ["[rank 0] shift right: sent [0, 0], received [2, 2]"],
        ["[rank 1] halo exchange: [10, 11, 12] -> [2, 10, 11, 12, 20]"],
        ["[main] 3 ranks exchanged messages point to point, and none deadlocked"],
    ):
        block = "\n".join(lines)
        assert block in out, (
            f"the program's output lacks these lines, in this order:\n{block}\n\nit printed:\n{out}"
        )
    with pytest.raises(SystemExit) as stopped:  # in this process: no second torch start-up
        kata.main(["--world-size", "1"])
    message = capsys.readouterr().err
    assert stopped.value.code == 2 and "at least two ranks" in message, (
        f"--world-size 1 should stop the program with 'at least two ranks', got exit "
        f"{stopped.value.code}:\n{message}"
    )
