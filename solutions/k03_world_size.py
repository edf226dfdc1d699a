"""k03 · World-size mismatch: too many processes, too few, and errors that say so.

THE IDEA
    ``world_size`` is a promise: "exactly this many ranks, numbered 0 .. world_size-1, will
    come". Nothing checks the promise against the processes you really started, and both ways
    of breaking it fail badly:

    too many (the tutorial's 4 processes, world size 2):

        rank 0  rank 1  | rank 2  rank 3
        └── world of 2 ─┘ └ no place for them: gloo aborts them with
                            "[enforce fail at gloo/context.cc] rank < size. 2 vs 2"
                            (or a connect timeout), a C++ message that names no fix

    too few (world size 4, 2 processes):

        rank 0  rank 1  ... rank 2? rank 3? never come
        └ both wait in init_process_group for the full timeout (30 minutes by default),
          then fail with "Timed out ... 2/4 clients joined" or a bare "Wait timeout"

    Your checks turn both into a ``WorldSizeMismatch`` within seconds, saying which rank, how
    many joined out of how many, and what to change.

    How to count who joined: rank 0 opens the rendezvous store (a TCPStore); every rank adds 1
    to a counter key in it (``store.add(key, 1)`` is atomic and returns the new total), then
    polls the total (``store.add(key, 0)``) until it reaches world_size or its own short
    deadline passes. Only then does it call ``init_process_group`` with that store.

STEPS
    1. ``check_rank``: a rank outside 0 .. world_size-1 raises WorldSizeMismatch at once.
    2. ``wait_for_world``: count this rank in, then wait until world_size ranks have, or raise
       WorldSizeMismatch with "<joined> of <world_size>" after ``join_timeout_s``. Rank 0 owns
       the store, so it must leave last: before raising, call the given
       ``_rank_zero_leaves_last``. If rank 0 is gone anyway (crashed), the next store call
       raises a RuntimeError: report that as the same mismatch.
    3. ``join_world``: check_rank; open (rank 0) or reach (others) the TCPStore on MASTER_ADDR/
       MASTER_PORT with a timeout of ``join_timeout_s``; a rank that cannot reach it raises
       WorldSizeMismatch too; wait_for_world; then ``dist.init_process_group(backend,
       store=store, rank=rank, world_size=world_size, timeout=...)``.

WHAT THE TESTS CHECK
    The tutorial's failure for real (4 processes, world size 2) and its opposite (world size 4,
    2 processes): each rank that cannot form the world raises your error, naming its rank, the
    count that joined and the expected world size, within seconds; a world of the right size
    still forms and all-reduces.

RUN IT
    .venv/bin/python -m katas.k03_world_size             (4 processes, world size 2: fails, as the tutorial's)
    .venv/bin/python -m katas.k03_world_size --fewer     (world size 4, 2 processes)
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from datetime import timedelta

import torch.distributed as dist

from dojo.console import run_program, say

from .k01_spawn import launch

JOINED_KEY = "k03/joined"
GAVE_UP_KEY = "k03/gave_up"


class WorldSizeMismatch(RuntimeError):
    """The processes started do not match world_size; the message says which rank and what to fix."""


def check_rank(rank: int, world_size: int) -> None:
    """Refuse a rank that has no place in a world of ``world_size``."""
    # BEGIN STEP 1: refuse a rank outside the world
    # TODO: a rank with a place in the world (0 .. world_size-1) passes silently; any other
    # (rank 2 or 3 of a world of 2, rank -1, ...) raises WorldSizeMismatch at once, never another
    # error. The tests check that the message names the rank and the world size; say what to
    # change too (start world_size processes, or set world_size to the processes you start).
    if not 0 <= rank < world_size:
        raise WorldSizeMismatch(
            f"rank {rank} cannot join a world of size {world_size} (ranks 0 to {world_size - 1}): "
            f"more processes were started than world_size says. Start {world_size} processes, "
            f"or set world_size to the number of processes you start."
        )
    # END STEP 1


def wait_for_world(store, rank: int, world_size: int, join_timeout_s: float) -> None:
    """Count this rank in, then wait until all ``world_size`` ranks have counted themselves in."""
    # BEGIN STEP 2: count who joined, give up after the join timeout
    # TODO: count this rank in once, under JOINED_KEY, then return as soon as world_size ranks have
    # counted themselves in. The tests hold it to this, with the store's calls recorded:
    #   - too few ranks: it raises _too_few(...)'s WorldSizeMismatch ("rank 1: only 2 of 4 ...")
    #     once join_timeout_s has passed, never waiting for ever, and polls the count gently (a
    #     few times a second, not thousands);
    #   - rank 0 owns the store, so it leaves last: no other rank's store call may fail because
    #     rank 0 has already gone (the given _rank_zero_leaves_last sees to it);
    #   - if rank 0 is gone anyway (crashed), the store calls raise RuntimeError: report that,
    #     at once, as the same mismatch;
    #   - when every rank joins, every rank returns within moments of the last one's arrival.
    joined = store.add(JOINED_KEY, 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:
        if time.monotonic() > give_up:
            _rank_zero_leaves_last(store, rank, joined)
            raise _too_few(rank, joined, world_size, join_timeout_s)
        time.sleep(0.05)
        try:
            joined = store.add(JOINED_KEY, 0)
        except RuntimeError:  # rank 0 is gone (it crashed, or gave up first): the same mismatch
            raise _too_few(rank, joined, world_size, join_timeout_s) from None
    # END STEP 2


def _rank_zero_leaves_last(store, rank: int, joined: int, grace_s: float = 10.0) -> None:
    """Before giving up, let rank 0 wait until every rank that joined has given up too.

    The store lives in rank 0's process: if rank 0 left first, a peer's next store call would
    hit a closed socket and print a long C++ warning before your clear error. Each peer gives up
    join_timeout_s after it joined, so the wait is short; ``grace_s`` only bounds it, should a
    peer never give up (it crashed).
    """
    store.add(GAVE_UP_KEY, 1)
    if rank != 0:
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        everyone = max(joined, store.add(JOINED_KEY, 0))  # latecomers included
        if store.add(GAVE_UP_KEY, 0) >= everyone:
            return
        time.sleep(0.05)


def _too_few(rank: int, joined: int, world_size: int, join_timeout_s: float) -> WorldSizeMismatch:
    return WorldSizeMismatch(
        f"rank {rank}: only {joined} of {world_size} ranks joined within {join_timeout_s:g} s: "
        f"fewer processes were started than world_size says. Start {world_size} processes "
        f"(ranks 0 to {world_size - 1}), or set world_size={joined}."
    )


def join_world(
    rank: int,
    world_size: int,
    backend: str = "gloo",
    join_timeout_s: float = 5.0,
    timeout_s: float = 30.0,
) -> None:
    """Join the world at MASTER_ADDR:MASTER_PORT, or raise WorldSizeMismatch within seconds."""
    # BEGIN STEP 3: join the world through the checked store
    # TODO: form the default process group of world_size ranks through the one store that rank 0
    # hosts on MASTER_ADDR:MASTER_PORT (env:// would open a second one there), after making sure
    # every rank came. The tests start real worlds: 4 processes told world size 2 (ranks 2 and 3
    # are refused before they touch anything), 2 told world size 4, 3 told 3 (they must form the
    # group and all-reduce), and a rank 1 with no rank 0 anywhere; every rank that cannot form
    # the world raises WorldSizeMismatch within seconds, naming itself (and rank 0, if that is
    # whom it could not reach), never a raw error.
    check_rank(rank, world_size)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=(rank == 0),
            timeout=timedelta(seconds=join_timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, TimeoutError) as error:  # DistStoreError is a RuntimeError
        raise WorldSizeMismatch(
            f"rank {rank} could not reach rank 0's store at {addr}:{port} within {join_timeout_s:g} s "
            f"({error}). Is rank 0 running, and do MASTER_ADDR/MASTER_PORT point at it?"
        ) from None
    wait_for_world(store, rank, world_size, join_timeout_s)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    # END STEP 3


def _demo_rank(rank: int, processes: int, world_size: int, port: int) -> str:
    """One process of the demo: ``processes`` were started, each believing in ``world_size``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        join_world(rank, world_size, join_timeout_s=3.0)
    except WorldSizeMismatch as error:
        say(rank, f"WorldSizeMismatch: {error}")
        return "mismatch"
    dist.barrier()
    dist.destroy_process_group()
    say(rank, f"joined the world of {world_size}")
    return "joined"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="The tutorial's multiprocess_comm.py with a wrong world size."
    )
    parser.add_argument(
        "--fewer",
        action="store_true",
        help="world size 4 with 2 processes (default: 4 processes, world size 2)",
    )
    parser.add_argument("--master-port", type=int, default=29500)
    args = parser.parse_args(argv)
    processes, world_size = (2, 4) if args.fewer else (4, 2)
    say(None, f"starting {processes} processes that each believe world_size={world_size}")
    outcomes = launch(
        processes, functools.partial(_demo_rank, world_size=world_size, port=args.master_port)
    )
    failed = [rank for rank, outcome in enumerate(outcomes) if outcome == "mismatch"]
    if failed:
        say(
            None,
            f"rank(s) {', '.join(map(str, failed))} could not form the world: fix the world size",
        )
        return 1
    return 0


if __name__ == "__main__":
    run_program(main)
