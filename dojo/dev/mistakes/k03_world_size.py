"""k03's mistakes catalogue: real mistakes in refusing a rank, counting who joined and joining
the world, and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each
list promises.

The stand-ins call the kata's own helpers (``_too_few``, ``_rank_zero_leaves_last``,
``check_rank``, ``wait_for_world``) through ``_kata()``, as the learner's code calls them by name.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness.impl import load_kata


def _kata():
    """The kata module under test (the reference, with this entry swapped in)."""
    return load_kata("k03_world_size")


# --------------------------------------------------------------------------- check_rank


def rank_up_to_world_size(rank, world_size):
    if not 0 <= rank <= world_size:  # one past the last rank slips through
        raise _kata().WorldSizeMismatch(
            f"rank {rank} cannot join a world of size {world_size} (ranks 0 to {world_size - 1})"
        )


def negative_rank_allowed(rank, world_size):
    if rank >= world_size:  # "ranks only go wrong at the top"
        raise _kata().WorldSizeMismatch(
            f"rank {rank} cannot join a world of size {world_size} (ranks 0 to {world_size - 1})"
        )


def generic_error(rank, world_size):
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")


def vague_rank_error(rank, world_size):
    if not 0 <= rank < world_size:
        raise _kata().WorldSizeMismatch("invalid rank")


# --------------------------------------------------------------------------- wait_for_world


def _key():
    return _kata().JOINED_KEY


def no_deadline(store, rank, world_size, join_timeout_s):
    joined = store.add(_key(), 1)
    while joined < world_size:  # waits for ranks that never come, for ever
        time.sleep(0.05)
        joined = store.add(_key(), 0)


def rank_zero_leaves_first(store, rank, world_size, join_timeout_s):
    kata = _kata()
    joined = store.add(_key(), 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:
        if time.monotonic() > give_up:  # rank 0 raises (and its store closes) at once
            raise kata._too_few(rank, joined, world_size, join_timeout_s)
        time.sleep(0.05)
        try:
            joined = store.add(_key(), 0)
        except RuntimeError:
            raise kata._too_few(rank, joined, world_size, join_timeout_s) from None


def counted_at_every_poll(store, rank, world_size, join_timeout_s):
    kata = _kata()
    give_up = time.monotonic() + join_timeout_s
    joined = 0
    while joined < world_size:
        joined = store.add(_key(), 1)  # counts itself in again at every look
        if joined >= world_size:
            return
        if time.monotonic() > give_up:
            kata._rank_zero_leaves_last(store, rank, joined)
            raise kata._too_few(rank, joined, world_size, join_timeout_s)
        time.sleep(0.05)


def busy_poll(store, rank, world_size, join_timeout_s):
    kata = _kata()
    joined = store.add(_key(), 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:
        if time.monotonic() > give_up:
            kata._rank_zero_leaves_last(store, rank, joined)
            raise kata._too_few(rank, joined, world_size, join_timeout_s)
        try:
            joined = store.add(_key(), 0)  # no pause: thousands of round trips a second
        except RuntimeError:
            raise kata._too_few(rank, joined, world_size, join_timeout_s) from None


def store_error_escapes(store, rank, world_size, join_timeout_s):
    kata = _kata()
    joined = store.add(_key(), 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:
        if time.monotonic() > give_up:
            kata._rank_zero_leaves_last(store, rank, joined)
            raise kata._too_few(rank, joined, world_size, join_timeout_s)
        time.sleep(0.05)
        joined = store.add(_key(), 0)  # a vanished rank 0 surfaces as a raw DistNetworkError


def keeps_polling_a_dead_store(store, rank, world_size, join_timeout_s):
    kata = _kata()
    joined = store.add(_key(), 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:
        if time.monotonic() > give_up:
            kata._rank_zero_leaves_last(store, rank, joined)
            raise kata._too_few(rank, joined, world_size, join_timeout_s)
        time.sleep(0.05)
        try:
            joined = store.add(_key(), 0)
        except RuntimeError:
            continue  # "maybe it comes back": a C++ warning at every try, until the timeout


def waits_out_the_timeout(store, rank, world_size, join_timeout_s):
    kata = _kata()
    store.add(_key(), 1)
    time.sleep(join_timeout_s)  # gives everyone the full time, even when all have joined
    joined = store.add(_key(), 0)
    if joined < world_size:
        kata._rank_zero_leaves_last(store, rank, joined)
        raise kata._too_few(rank, joined, world_size, join_timeout_s)


def never_rereads(store, rank, world_size, join_timeout_s):
    kata = _kata()
    joined = store.add(_key(), 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:  # `joined` is the count at this rank's arrival, never updated
        if time.monotonic() > give_up:
            kata._rank_zero_leaves_last(store, rank, joined)
            raise kata._too_few(rank, joined, world_size, join_timeout_s)
        time.sleep(0.05)


def vague_too_few(store, rank, world_size, join_timeout_s):
    kata = _kata()
    joined = store.add(_key(), 1)
    give_up = time.monotonic() + join_timeout_s
    while joined < world_size:
        if time.monotonic() > give_up:
            kata._rank_zero_leaves_last(store, rank, joined)
            raise kata.WorldSizeMismatch("not every rank joined in time")
        time.sleep(0.05)
        try:
            joined = store.add(_key(), 0)
        except RuntimeError:
            raise kata.WorldSizeMismatch("not every rank joined in time") from None


# --------------------------------------------------------------------------- join_world


def _store_for(rank, world_size, join_timeout_s, is_master=None):
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        return dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=(rank == 0) if is_master is None else is_master,
            timeout=timedelta(seconds=join_timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, TimeoutError) as error:
        raise _kata().WorldSizeMismatch(
            f"rank {rank} could not reach rank 0's store at {addr}:{port} ({error})"
        ) from None


def no_rank_check(rank, world_size, backend="gloo", join_timeout_s=5.0, timeout_s=30.0):
    store = _store_for(rank, world_size, join_timeout_s)  # ranks 2 and 3 of 2 get this far
    _kata().wait_for_world(store, rank, world_size, join_timeout_s)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def every_rank_opens_the_store(
    rank, world_size, backend="gloo", join_timeout_s=5.0, timeout_s=30.0
):
    _kata().check_rank(rank, world_size)
    store = _store_for(rank, world_size, join_timeout_s, is_master=True)  # not only rank 0
    _kata().wait_for_world(store, rank, world_size, join_timeout_s)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def init_without_the_store(rank, world_size, backend="gloo", join_timeout_s=5.0, timeout_s=30.0):
    _kata().check_rank(rank, world_size)
    store = _store_for(rank, world_size, join_timeout_s)
    _kata().wait_for_world(store, rank, world_size, join_timeout_s)
    dist.init_process_group(  # env:// opens a second store on MASTER_PORT
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def skips_the_count(rank, world_size, backend="gloo", join_timeout_s=5.0, timeout_s=30.0):
    _kata().check_rank(rank, world_size)
    store = _store_for(rank, world_size, join_timeout_s)
    dist.init_process_group(  # "init_process_group waits for the others anyway"
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def store_error_not_wrapped(rank, world_size, backend="gloo", join_timeout_s=5.0, timeout_s=30.0):
    _kata().check_rank(rank, world_size)
    store = dist.TCPStore(  # a rank 0 that cannot be reached raises a raw DistNetworkError
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=(rank == 0),
        timeout=timedelta(seconds=join_timeout_s),
        wait_for_workers=False,
    )
    _kata().wait_for_world(store, rank, world_size, join_timeout_s)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


# Right answers written differently: the checks must accept every one.


def check_rank_with_range(rank, world_size):
    if rank not in range(world_size):
        raise _kata().WorldSizeMismatch(
            f"rank {rank} is not one of the {world_size} ranks 0..{world_size - 1} of this world: "
            f"start {world_size} processes, or make world_size match the processes you start"
        )


def wait_with_attempts(store, rank, world_size, join_timeout_s):
    """Counts its polls instead of reading the clock, and reads the count at the loop's top."""
    kata = _kata()
    pause = 0.1
    joined = store.add(_key(), 1)
    for _ in range(int(join_timeout_s / pause) + 1):
        if joined >= world_size:
            return
        time.sleep(pause)
        try:
            joined = store.add(_key(), 0)
        except RuntimeError:
            raise kata._too_few(rank, joined, world_size, join_timeout_s) from None
    if joined < world_size:
        kata._rank_zero_leaves_last(store, rank, joined)
        raise kata._too_few(rank, joined, world_size, join_timeout_s)


def join_with_keywords(rank, world_size, backend="gloo", join_timeout_s=5.0, timeout_s=30.0):
    kata = _kata()
    kata.check_rank(rank, world_size)
    try:
        store = dist.TCPStore(
            host_name=os.environ["MASTER_ADDR"],
            port=int(os.environ["MASTER_PORT"]),
            world_size=world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=join_timeout_s),
            wait_for_workers=False,
        )
    except dist.DistError as error:
        raise kata.WorldSizeMismatch(
            f"rank {rank}: rank 0's store is not there ({error}); is rank 0 running?"
        ) from None
    kata.wait_for_world(store, rank, world_size, join_timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


# --------------------------------------------------------------------------- the catalogue

_REFUSES = "test_check_rank_refuses_a_rank_outside_the_world"
_TOO_FEW = "test_wait_for_world_gives_up_when_too_few_join"
_VANISHED = "test_wait_for_world_reports_a_vanished_rank_zero_as_a_mismatch"
_ALL_JOINED = "test_wait_for_world_returns_once_every_rank_has_joined"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "rank_up_to_world_size",
        replaces="check_rank",
        fails=[f"{_REFUSES}[2-2]"],
        says=["returned without an error", "rank < world_size, not <="],
    ),
    Mistake(
        "negative_rank_allowed",
        replaces="check_rank",
        fails=[f"{_REFUSES}[-1-4]"],
        says=["returned without an error", "ranks are never negative"],
    ),
    Mistake(
        "generic_error",
        replaces="check_rank",
        fails=[_REFUSES],
        says=["raised ValueError", "Expected the kata's WorldSizeMismatch"],
    ),
    Mistake(
        "vague_rank_error",
        replaces="check_rank",
        fails=[_REFUSES],
        says=["WorldSizeMismatch('invalid rank')", "name the rank"],
    ),
    Mistake(
        "no_deadline",
        replaces="wait_for_world",
        fails=[_TOO_FEW],
        says=["was still waiting in wait_for_world", "once join_timeout_s has passed"],
    ),
    Mistake(
        "rank_zero_leaves_first",
        replaces="wait_for_world",
        fails=[_TOO_FEW],
        says=["rank 0 left while rank 1 was still waiting", "Rank 0 must leave last"],
    ),
    Mistake(
        "counted_at_every_poll",
        replaces="wait_for_world",
        fails=[_TOO_FEW],
        says=["returned on rank 0 although only 2 of the 4", "Count yourself in once"],
    ),
    Mistake(
        "busy_poll",
        replaces="wait_for_world",
        fails=[_TOO_FEW],
        says=["called the store", "Sleep a little (0.05 s) between polls"],
    ),
    Mistake(
        "store_error_escapes",
        replaces="wait_for_world",
        fails=[_VANISHED],
        says=["rank 1 raised DistNetworkError", "report that as the same WorldSizeMismatch"],
    ),
    Mistake(
        "keeps_polling_a_dead_store",
        replaces="wait_for_world",
        fails=[_VANISHED],
        says=["after it had failed", "raise WorldSizeMismatch at once"],
    ),
    Mistake(
        "waits_out_the_timeout",
        replaces="wait_for_world",
        fails=[_ALL_JOINED],
        says=["after the last rank had joined", "return as soon as the count reaches world_size"],
    ),
    Mistake(
        "never_rereads",
        replaces="wait_for_world",
        fails=[_ALL_JOINED],
        says=["in which all 3 ranks joined", "Re-read the count"],
    ),
    Mistake(
        "vague_too_few",
        replaces="wait_for_world",
        fails=[_TOO_FEW],
        says=["should name the rank", "'2 of 4'"],
    ),
    Mistake(
        "no_rank_check",
        replaces="join_world",
        fails=["test_too_many_processes_the_tutorials_failure"],
        says=[
            "has no place in a world of 2",
            "refuse it before touching the store (check_rank first)",
        ],
    ),
    Mistake(
        "every_rank_opens_the_store",
        replaces="join_world",
        fails=[
            "test_too_many_processes_the_tutorials_failure",
            "test_the_right_world_size_still_forms",
        ],
        says=["did not join it", "only rank 0 opens the store (is_master=(rank == 0))"],
    ),
    Mistake(
        "init_without_the_store",
        replaces="join_world",
        fails=[
            "test_too_many_processes_the_tutorials_failure",
            "test_the_right_world_size_still_forms",
        ],
        says=["did not join it", "init_process_group must reuse it (store=store)"],
    ),
    Mistake(
        "skips_the_count",
        replaces="join_world",
        fails=["test_too_few_processes_fails_fast_instead_of_hanging"],
        says=["instead of your WorldSizeMismatch", "count who joined (wait_for_world)"],
    ),
    Mistake(
        "store_error_not_wrapped",
        replaces="join_world",
        fails=["test_a_rank_that_cannot_reach_rank_zero_fails_fast"],
        says=["instead of your WorldSizeMismatch", "a store that cannot be reached"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("check_rank_with_range", replaces="check_rank"),
    RightAnswer("wait_with_attempts", replaces="wait_for_world"),
    RightAnswer("join_with_keywords", replaces="join_world"),
]
