"""k04 · All-reduce and gradient averaging.

THE IDEA
    A collective is a call that every rank of the group makes together. ``all_reduce`` is the
    one data-parallel training lives on: every rank hands in a tensor, the tensors are combined
    element by element (summed, multiplied, the smallest or the largest kept), and every rank
    gets the combined result back *in place*, in its own tensor.

    The tutorial's demonstration, four ranks each holding its own rank number:

        before                  dist.all_reduce(t, op=SUM)         after
        rank 0  tensor([0]) --+                               +--> rank 0  tensor([6])
        rank 1  tensor([1]) --+--->   0 + 1 + 2 + 3 = 6   ----+--> rank 1  tensor([6])
        rank 2  tensor([2]) --+                               +--> rank 2  tensor([6])
        rank 3  tensor([3]) --+                               +--> rank 3  tensor([6])

    The reduce ops: ``ReduceOp.SUM`` (6), ``PRODUCT`` (0 * 1 * 2 * 3 = 0), ``MIN`` (0) and
    ``MAX`` (3). Every rank must call the collective, with a tensor of the same shape and dtype:
    a rank that skips it leaves the others waiting for ever (here: until the harness reports
    a deadlock and shows where each rank waits).

    Gradient averaging. In data-parallel training every rank holds a replica of the model and
    computes gradients on its own part of the batch. Before the optimizer step the replicas
    must agree on one gradient, the mean of theirs, or they drift apart:

        rank r computed  p.grad = g_r          (for every parameter p)
        all_reduce SUM   p.grad = g_0 + g_1 + ... + g_{N-1}      on every rank
        divide by N      p.grad = the mean                       on every rank

    Averaging (not summing) keeps the step the size it would be for one process on the whole
    batch, whatever the number of ranks. Reduce ``p.grad``, never ``p.data`` (that is the
    weights themselves), and skip parameters whose ``.grad`` is None (frozen or unused in this
    step): there is nothing to average.

STEPS
    1. ``tutorial_allreduce``: make ``torch.tensor([rank])`` on this rank's device, keep a copy
       of it, SUM all-reduce it, and return ``(before, after)``.
    2. ``all_reduce_with``: all-reduce a tensor in place with an op named "sum", "product",
       "min" or "max" (``dist.ReduceOp``), and return it; an unknown name is a ValueError.
    3. ``average_gradients``: after it, every parameter's ``.grad`` on every rank is the mean of
       that parameter's gradients over all ranks (``dist.get_world_size()``).

WHAT THE TESTS CHECK
    The demonstration on 4 and 3 ranks; each reduce op on values that differ per rank; and
    ``average_gradients`` on ranks that hold different gradients: the exact mean on every
    rank, for every parameter, with parameter values untouched, ``.grad`` None left alone, and
    a world of 1. Each failure names the likely mistake (summed but not divided, ``.data``
    instead of ``.grad``, only some parameters, ranks that disagree, a rank that skips the call).

RUN IT
    .venv/bin/python -m katas.k04_allreduce --world-size 4       (add --op max to try another op)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo

OPS = ("sum", "product", "min", "max")


def tutorial_allreduce(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank holds ``tensor([rank])``; SUM all-reduce it. Returns ``(before, after)``."""
    # TODO: every rank returns two tensors on rank_device(): ``before``, its own tensor([rank])
    # as it was, and ``after``, that tensor once summed over every rank of the world (4 ranks:
    # tensor([6]) on every rank). The tests run it on 4 and 3 ranks and check both on each rank.
    raise KataTodo("k04", 1, "the tutorial's all-reduce of every rank's number")


def all_reduce_with(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce ``tensor`` in place with the op named ``op`` ("sum", "product", "min", "max")."""
    # TODO: afterwards the caller's own tensor holds, on every rank, the element-wise sum,
    # product, smallest or largest over all ranks, and the function returns that same tensor.
    # A name not in OPS raises ValueError, listing the names it knows, before any communication.
    # The tests try every op on values that differ per rank, and the name "median".
    raise KataTodo("k04", 2, "all-reduce with a named reduce op")


def average_gradients(model: nn.Module) -> None:
    """Replace every parameter's ``.grad`` by its mean over all ranks (``.grad`` None: skipped)."""
    # TODO: afterwards, on every rank, each parameter's .grad holds the mean over all ranks of
    # that parameter's gradient (every layer, weights and biases); the parameters' values are
    # untouched and a .grad that is None stays None. The tests give every rank different
    # gradients, on worlds of 4, 3, 2 and 1 ranks.
    raise KataTodo("k04", 3, "average every gradient over the ranks")


def show_allreduce(rank: int, world_size: int, op: str = "sum") -> list:
    """What each rank of the tutorial's program does: print its tensor before and after."""
    if op == "sum":
        before, after = tutorial_allreduce(rank, world_size)
    else:
        before = torch.tensor([rank], device=rank_device())
        after = all_reduce_with(before.clone(), op)
    say_in_rank_order(rank, world_size, f"before all_reduce: {before}")
    say_in_rank_order(rank, world_size, f"after  all_reduce({op.upper()}): {after}")
    return after.tolist()


def say_in_rank_order(rank: int, world_size: int, text: str) -> None:
    """Print one line per rank, rank 0 first: each rank waits for its turn at a barrier."""
    for turn in range(world_size):
        if turn == rank:
            say(rank, text)
        dist.barrier()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The tutorial's multiprocess_allreduce.py.")
    add_launch_arguments(parser)
    parser.add_argument("--op", choices=OPS, default="sum", help="the reduce op (default: sum)")
    args = parser.parse_args(argv)
    results = launch_world(
        show_allreduce, args.world_size, args.op, backend=args.backend, device=args.device
    )
    if all(result == results[0] for result in results):
        say(None, f"every rank holds {results[0]} after the all-reduce")
    else:
        say(None, f"the ranks disagree after the all-reduce: {results}")
    return 0


if __name__ == "__main__":
    run_program(main)
