"""k23 · Hangs and mismatched collectives: turn a silent wait into an error that names the ranks.

THE IDEA
    A collective is a meeting: every rank of the group must call the same one, with tensors of
    the same shape and dtype, in the same order. When one rank does not come (it took another
    branch of an ``if rank == 0:``, it crashed, it skipped a step), the others wait for ever and
    say nothing. When one comes with something else (another shape, another collective), gloo
    may wait for ever, fail with an unrelated network error, or, worst, return wrong numbers:
    an all_reduce of float32[4] on three ranks and float32[3] on one really does "work" on gloo.

        rank 0   all_reduce(float32[4]) ---+
        rank 1   all_reduce(float32[4]) ---+--- waits ... for ever (or wrong numbers)
        rank 2   all_reduce(float32[3]) ---+
        rank 3   (took another branch)

    Two checks turn that into an error that names the culprits, on every rank:

    A barrier that names who did not come. Every rank writes "I am here" under its own key in
    the group's key-value store (the one the ranks used to find each other), then looks, without
    blocking, until every rank's key is there or the timeout has passed; then it raises naming
    the ranks whose key is missing. Nothing in it can hang: a store lookup returns at once. A
    barrier is called again and again (once per step), so every call has its own generation in
    the key: the third call waits for the third keys, never for the first's.

        key  k23/<name>/<generation>/<rank>          generation 1, 2, 3 ... per call
             rank 0: set k23/step/1/0, then check k23/step/1/0 .. k23/step/1/3 until all there

    A fingerprint check before a collective. Every rank describes the collective it is about to
    call, ``all_reduce(float32[4])``, and all ranks exchange their descriptions (one
    ``all_gather_object``, the same on every rank: that meeting cannot mismatch). If they
    differ, every rank raises the same message, the odd ones out first:

        rank 2 calls all_reduce(float32[3]); ranks 0, 1, 3 call all_reduce(float32[4])

    and the collective runs only when all agree. Naming matters: the rank that differs from
    the rest is the suspect, which need not be rank 0; and if only the odd rank raised, the
    others would walk into the collective and wait for it for ever.

    Torch has its own of both. ``dist.monitored_barrier(timeout=..., wait_all_ranks=True)``
    (gloo) makes rank 0 name the ranks that did not arrive ("Ranks 1, 3 failed to pass
    monitoredBarrier in 2000 ms"). With the debug level DETAIL (``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    in the environment before torch starts, or ``dist.set_debug_level`` before a group is
    made) torch wraps each new group so that every collective first checks a fingerprint
    (operation, shapes, dtypes) across the ranks and raises "Detected mismatch between
    collectives on ranks": the same idea as yours, paid on every call. Its message is each
    rank's own view, "I run this, but rank N runs that", N the first rank that differs from it:
    on the odd rank itself it blames rank 0 or 1, so read it on several ranks (yours names the
    odd one out). And every group has a timeout (``init_process_group(timeout=...)``,
    ``new_group(timeout=...)``): on gloo a collective that waits longer raises instead of
    hanging.

STEPS
    1. ``StoreBarrier.wait``: check in under this call's own key, wait for every rank's key
       until the timeout, then raise ``BarrierTimeout`` naming the ranks that did not arrive.
    2. ``fingerprint(op_name, tensor)`` and ``describe_mismatch(prints)``: a collective's
       description, and the sentence that names the ranks that differ (None when all agree).
    3. ``checked(collective, tensor, *args, group=None, **kwargs)``: exchange fingerprints, raise
       ``CollectiveMismatch`` on every rank when they differ, else run the collective.
    4. ``torch_checked_group(timeout_s)``: a new group of every rank on which torch itself
       checks every collective's fingerprint (DETAIL) and gives up after ``timeout_s``.

WHAT THE TESTS CHECK
    On 4 ranks and gloo, with timeouts of 1-3 s under the harness's deadline: that the barrier
    lets ranks through only once every rank has checked in (a late rank's arrival, recorded in
    the store, is seen by all), names exactly the ranks that never came (on every waiting rank,
    against ``dist.monitored_barrier`` on the same world), gives up after its timeout, and keeps
    repeated calls apart; ``fingerprint`` and ``describe_mismatch`` on shapes, dtypes and ranks
    where the odd one is rank 0 or a tie; that ``checked`` raises on every rank with the same
    message naming the rank that differs in shape, dtype or operation (as torch's DETAIL mode
    does on the same world; in a subgroup too), and otherwise runs the collective once with its
    result unchanged; that the group of step 4 catches a shape mismatch and a missing rank with
    torch's own errors and leaves the debug level as it was; bad input; the program (started
    with TORCH_DISTRIBUTED_DEBUG=DETAIL); and, where there are GPUs,
    ``checked`` on NCCL (a world of 1) and on gloo with CUDA tensors.

RUN IT
    .venv/bin/python -m katas.k23_hangs --world-size 4 --skip-rank 3 --mismatch-rank 2
    TORCH_DISTRIBUTED_DEBUG=DETAIL .venv/bin/python -m katas.k23_hangs --unchecked
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo

POLL_S = 0.02  # how often a waiting rank looks at the store again


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 0, 1, 3``: how the messages name ranks."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class BarrierTimeout(RuntimeError):
    """A barrier gave up; ``missing`` lists the ranks that did not arrive, in rank order."""

    def __init__(self, message: str, missing: Sequence[int]):
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self):  # travels intact from a rank process to the parent
        return (BarrierTimeout, (str(self), self.missing))


class CollectiveMismatch(RuntimeError):
    """The ranks were about to call different collectives; the message names who calls what."""


class StoreBarrier:
    """A barrier through the group's key-value store that names the ranks that did not arrive.

    ``StoreBarrier(name="barrier", timeout_s=30.0, store=None)``: ``store`` None means the
    default group's store. Every rank of the world makes one (the same name) and calls
    ``wait()`` as often as it likes; each call is a new generation of the barrier.
    """

    def __init__(self, name: str = "barrier", timeout_s: float = 30.0, store=None):
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not timeout_s > 0:
            raise ValueError(
                f"timeout_s must be positive, got {timeout_s!r}: a barrier that never gives up "
                "is the hang this kata turns into an error"
            )
        self.name = name
        self.timeout_s = float(timeout_s)
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.generation = 0  # how many times wait() was called on this rank

    def key(self, generation: int, rank: int) -> str:
        """The store key by which ``rank`` checks in to call number ``generation``."""
        return f"k23/{self.name}/{generation}/{rank}"

    def wait(self) -> None:
        """Return once every rank has called ``wait()`` as often as this one; raise
        ``BarrierTimeout`` naming the ranks that did not, after ``timeout_s`` seconds."""
        # TODO: return once every rank of the world has called wait() as many times as this rank
        # has (this call included); if that has not happened within self.timeout_s seconds, raise
        # BarrierTimeout with a message naming those ranks (as ranks_text writes them) and
        # missing= the ranks that did not arrive, in rank order. Check in through self.store under
        # self.key(generation, rank), with a generation of your own per call (self.generation counts
        # the calls), so that a call never mistakes an earlier call's keys for its own. Nothing here
        # may block for ever: store.get and store.wait without a timeout would. The tests: a rank
        # arriving late (every rank must see it arrived), ranks 3, then 1 and 3, then 0 never
        # arriving (missing=, the message, at least the timeout waited), a second call that one
        # rank skips, and torch's dist.monitored_barrier naming the same ranks.
        raise KataTodo("k23", 1, "StoreBarrier.wait: check in, wait, name who did not arrive")


def fingerprint(op_name: str, tensor: torch.Tensor) -> str:
    """``all_reduce(float32[3])``: the collective, its tensor's dtype and shape."""
    # TODO: "all_reduce(float32[3])": op_name, then the tensor's dtype (without "torch.") and its
    # sizes in brackets, joined by ", " ("broadcast(float64[2, 3])", a scalar: "all_reduce(float32[])").
    # An op_name that is not a non-empty string, or a tensor that is not a torch.Tensor, is a
    # ValueError saying what was wrong. The tests check five dtypes and shapes, and bad input.
    raise KataTodo("k23", 2, "fingerprint and describe_mismatch: describe, compare, name")


def describe_mismatch(prints: Sequence[str]) -> str | None:
    """None when every rank's fingerprint is the same; else who calls what, the odd ones first.

    ``prints[r]`` is rank r's fingerprint. Ranks that call the same thing form one group; the
    groups are listed smallest first (a tie: the group with the lowest rank first), each as
    ``rank 2 calls all_reduce(float32[3])`` or ``ranks 0, 1, 3 call ...``, joined by ``; ``.
    """
    # TODO: None when all of prints are the same (or there is only one); else the sentence of the
    # docstring: "rank 2 calls all_reduce(float32[3]); ranks 0, 1, 3 call all_reduce(float32[4])".
    # The tests check the odd rank in the middle and at rank 0, a tie, three kinds and two ranks.
    raise KataTodo("k23", 2, "fingerprint and describe_mismatch: describe, compare, name")


def checked(collective: Callable, tensor: torch.Tensor, /, *args, group=None, **kwargs):
    """``collective(tensor, *args, group=group, **kwargs)`` (``dist.all_reduce``, ...), once
    every rank of ``group`` is known to call the same collective on the same shape and dtype;
    ``CollectiveMismatch`` on every rank otherwise."""
    # TODO: every rank of group learns every rank's fingerprint of the call it is about to make;
    # when they differ, every rank (not only the odd one: the others would wait in the collective
    # for ever) raises CollectiveMismatch whose message holds describe_mismatch's sentence;
    # otherwise the collective runs once, on tensor, with the other arguments passed on, and its
    # result is returned. The tests: a rank that differs in shape, dtype or operation (every rank
    # raises the same sentence and calls no collective of that name), torch's DETAIL mode blaming
    # the same rank, a subgroup [1, 2] of 3 ranks (the group's own rank numbers), and all_reduce
    # (MAX too), broadcast and async_op=True where all agree.
    raise KataTodo("k23", 3, "checked: share the fingerprints, raise everywhere or run")


def torch_checked_group(timeout_s: float) -> dist.ProcessGroup:
    """A new group of every rank whose collectives torch checks (debug level DETAIL) and which
    raises after ``timeout_s`` seconds instead of waiting for ever; the debug level is left as
    it was."""
    # TODO: a new process group of every rank on which torch itself checks every collective's
    # fingerprint across the ranks (the debug level DETAIL, the one TORCH_DISTRIBUTED_DEBUG=DETAIL
    # sets when torch starts) and whose collectives raise after timeout_s seconds instead of
    # waiting for ever; afterwards the debug level is what it was. A timeout that is not a positive
    # number of seconds is a ValueError. The tests: a shape mismatch on the group raises torch's
    # "Detected mismatch between collectives" on every rank, a missing rank ends in torch's
    # "failed to pass monitoredBarrier" after (not before) the timeout, and the debug level after.
    raise KataTodo("k23", 4, "torch_checked_group: torch's own checks and timeout")


# --------------------------------------------------------------------------- the program


def _first_line(error: BaseException, width: int = 160) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= width else text[: width - 3] + "..."


_DETAIL = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(.*?OpType=(\w+), "
    r"TensorShape=\[([^\]]*)\], TensorDtypes=(\w+).*?but Rank (\d+) is running collective: "
    r"CollectiveFingerPrint\(.*?OpType=(\w+), TensorShape=\[([^\]]*)\], TensorDtypes=(\w+)",
    re.S,
)


def _torch_said(error: BaseException) -> str:
    """Torch's DETAIL mismatch error, shortened to who runs what; else its first line."""
    found = _DETAIL.search(str(error))
    if not found:
        return _first_line(error)
    me, op, shape, dtype, other, op2, shape2, dtype2 = found.groups()
    return (
        f"Detected mismatch between collectives on ranks: rank {me} runs {op}({dtype}[{shape}]), "
        f"but rank {other} runs {op2}({dtype2}[{shape2}])"
    )


def _stay_until_done(store, key: str, world_size: int, rank: int) -> None:
    """The misbehaving rank stays alive (as a real straggler would) until the others are done."""
    store.wait([f"{key}/{r}" for r in range(world_size) if r != rank], timedelta(seconds=60))


def show_checks(
    rank: int,
    world_size: int,
    skip_rank: int,
    mismatch_rank: int,
    timeout_s: float,
    unchecked: bool = False,
):
    """Each check on a world where one rank misbehaves; every rank prints what it caught."""
    device = rank_device()
    store = dist.distributed_c10d._get_default_store()
    barrier = StoreBarrier("demo", timeout_s=timeout_s)

    barrier.wait()
    if rank == 0:
        say(rank, f"1. StoreBarrier: every rank arrived (call {barrier.generation})")
    if rank == skip_rank:
        _stay_until_done(store, "demo/barrier-done", world_size, rank)
    else:
        try:
            barrier.wait()
            say(rank, "passed the barrier (unexpected)")
        except BarrierTimeout as error:
            say(rank, f"caught BarrierTimeout: {error} (missing={error.missing})")
        store.set(f"demo/barrier-done/{rank}", "1")

    size = 3 if rank == mismatch_rank else 4
    tensor = torch.ones(size, device=device)
    try:
        checked(dist.all_reduce, tensor)
        say(rank, "all_reduce ran (unexpected)")
    except CollectiveMismatch as error:
        if rank in (0, mismatch_rank):
            say(rank, f"2. checked: {error}")
    tensor = torch.full((4,), float(rank), device=device)
    checked(dist.all_reduce, tensor)
    if rank == 0:
        say(
            rank,
            f"   with the same shapes it runs: the sum of the ranks' numbers {tensor.tolist()}",
        )

    group = torch_checked_group(timeout_s)
    try:
        dist.all_reduce(torch.ones(size, device=device), group=group)
        say(rank, "torch's DETAIL group let a mismatch through (unexpected)")
    except RuntimeError as error:
        if rank in (0, mismatch_rank):
            say(rank, f"3. torch (DETAIL): {_torch_said(error)}")
    group = torch_checked_group(timeout_s)
    if rank == skip_rank:
        _stay_until_done(store, "demo/torch-done", world_size, rank)
    else:
        try:
            dist.all_reduce(torch.ones(4, device=device), group=group)
            say(rank, "all_reduce without a rank returned (unexpected)")
        except RuntimeError as error:
            if rank == 0:
                say(rank, f"   torch (timeout {timeout_s:g} s): {_first_line(error)}")
        store.set(f"demo/torch-done/{rank}", "1")

    if unchecked:  # the mismatch on the world group itself, no check of ours in the way
        level = dist.get_debug_level().name
        tensor = torch.ones(size, device=device)
        try:
            dist.all_reduce(tensor)
            say(rank, f"4. unchecked all_reduce (debug level {level}): returned {tensor.tolist()}")
        except RuntimeError as error:
            say(rank, f"4. unchecked all_reduce (debug level {level}): {_torch_said(error)}")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Barriers and fingerprint checks that name the ranks behind a hang."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument("--skip-rank", type=int, default=3, help="the rank that skips (default 3)")
    parser.add_argument(
        "--mismatch-rank", type=int, default=2, help="the rank with another shape (default 2)"
    )
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument(
        "--unchecked",
        action="store_true",
        help="last, the mismatched all_reduce on the world group with no check of ours: run with "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL to see torch's check; without it gloo may return wrong "
        "numbers or fail",
    )
    args = parser.parse_args(argv)
    for option, value in (("--skip-rank", args.skip_rank), ("--mismatch-rank", args.mismatch_rank)):
        if not 0 <= value < args.world_size:
            parser.error(f"{option} must be a rank of the world, 0 to {args.world_size - 1}")
    if args.world_size < 2:
        parser.error("--world-size must be at least 2: a hang needs someone to wait for")
    if not args.timeout > 0:
        parser.error("--timeout must be positive")
    say(
        None,
        f"{args.world_size} ranks; rank {args.skip_rank} skips, rank {args.mismatch_rank} "
        f"calls with another shape; timeouts {args.timeout:g} s",
    )
    launch_world(
        show_checks,
        args.world_size,
        args.skip_rank,
        args.mismatch_rank,
        args.timeout,
        args.unchecked,
        backend=args.backend,
        device=args.device,
    )
    say(None, "every hang above ended as an error naming its ranks")
    return 0


if __name__ == "__main__":
    run_program(main)
