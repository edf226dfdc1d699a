"""k11 · Gradient accumulation.

THE IDEA
    A batch too big for one backward can still be one optimizer step: cut each rank's part of
    it into k micro-batches, run forward and backward on each in turn, and let ``.grad`` add
    them up (backward adds to ``.grad``, it never overwrites it). Only memory changes: the
    activations of one micro-batch at a time instead of the whole batch.

    Two things make the sum equal the gradient of the whole batch:

    - each micro-batch's loss is its own mean, so k of them add up to k times the batch's
      mean loss: divide each by k before backward (the gradient of the sum of ``loss_i / k`` is
      the gradient of the mean over the whole batch, micro-batches of equal size);
    - the ranks average once, after the last micro-batch's backward: averaging is linear, so
      the mean of the sums is the sum of the means, and k all-reduces of every gradient would
      send k times the bytes for the same result.

    One optimizer step, 2 ranks, k = 3 micro-batches each (global batch 2 x 3 x m):

        rank 0   mb0 -> backward(loss/3) -> mb1 -> backward(loss/3) -> mb2 -> backward(loss/3)
                 .grad:   g00/3                g00/3 + g01/3              g00/3 + g01/3 + g02/3
        rank 1   mb0 ... the same on its own micro-batches .............. g10/3 + g11/3 + g12/3
                                                                        |
                 average_gradients(model): one all-reduce per gradient  +-> mean of the ranks'
                 optimizer.step() on every rank: one step on the whole global batch

    torch's ``DistributedDataParallel`` all-reduces during every backward by itself, so
    accumulating with it needs ``ddp_model.no_sync()``: inside that context a backward only adds
    to ``.grad``; the backward of the last micro-batch, outside it, all-reduces the sums. The
    switch is read at forward time, so the forward must be inside the context too.

    Exactness: the micro-batch sums add the same numbers in another order than one mean over
    the whole batch, so the weights agree with one process to rounding (about 1e-7), not
    bitwise; the ranks, which all receive the same all-reduced bits, agree exactly.

STEPS
    1. ``split_batch``: cut ``(inputs, targets)`` into k micro-batches of equal size, in
       order; ``ValueError`` when k < 1 or k does not divide the batch.
    2. ``accumulation_step``: one optimizer step over k micro-batches: each loss divided by k,
       one backward each, gradients averaged over the ranks once (k04's
       ``average_gradients``), then the step; return this rank's batch loss as a float.
    3. ``ddp_accumulation_step``: the same with torch's DDP, its ``no_sync()`` around every
       micro-batch but the last.

WHAT THE TESTS CHECK
    The micro-batches (sizes, order, pairs kept, bad k refused). On 2 ranks with the frozen and
    tied toy models and k = 1, 2, 4: after 3 steps every rank holds the same weights as one
    process stepping on the whole batch (k x micro-batch x ranks) and as torch's DDP with
    ``no_sync``; recorded all-reduces per optimizer step: one per gradient tensor, after the
    last backward and before the step, not k times as many; the loss returned. With DDP the
    tests count DDP's own all-reduces (one per bucket per step) and name the usual mistakes:
    the loss not divided by k, ``zero_grad`` between micro-batches, averaging at every
    micro-batch (correct, but k times the traffic).

RUN IT
    .venv/bin/python -m katas.k11_grad_accumulation --world-size 2 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import MODELS, make_batch, make_model
from dojo.toy_models import loss as toy_loss

from .k04_allreduce import average_gradients

Batch = tuple[torch.Tensor, torch.Tensor]


def split_batch(batch: Batch, accumulation_steps: int) -> list[Batch]:
    """``(inputs, targets)`` cut into ``accumulation_steps`` equal micro-batches, in order."""
    # TODO: a list of accumulation_steps (inputs, targets) pairs of equal size, in order:
    # micro-batch i holds samples i*m to (i+1)*m - 1 of both tensors, m = len(inputs) // k.
    # accumulation_steps below 1, or one that does not divide the batch, is a ValueError whose
    # message names the wrong number (unequal micro-batches would weigh their samples unequally
    # once each loss is divided by k). The tests cut batches of 12 in 1 to 12 and refuse 10 in 4.
    raise KataTodo("k11", 1, "cut the batch into micro-batches")


def accumulation_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, accumulation_steps: int
) -> float:
    """One optimizer step on this rank's ``batch``, in ``accumulation_steps`` micro-batches;
    returns this rank's loss on the whole batch (before the step)."""
    # TODO: one optimizer step on this rank's batch, computed split_batch micro-batch by
    # micro-batch (one forward and backward each, toy_loss for the loss). What the tests hold it
    # to, on 2 ranks with k = 1, 2 and 4 over 3 steps:
    #   - at optimizer.step() every rank's gradients are those of one process on the whole
    #     global batch (k x micro-batch x ranks), and after 3 steps the weights equal that
    #     process's and torch's DDP's with no_sync, every rank exactly the same;
    #   - the ranks average once per optimizer step (your k04's average_gradients), after the
    #     last micro-batch and before the step: recorded all-reduces, one per gradient tensor,
    #     not k times as many;
    #   - one optimizer.step() per call; returns this rank's loss on its whole batch, before the
    #     step, as a float.
    raise KataTodo("k11", 2, "one optimizer step over k micro-batches")


def ddp_accumulation_step(
    ddp_model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, accumulation_steps: int
) -> float:
    """``accumulation_step`` with torch's DistributedDataParallel: it averages by itself, in the
    backward of the last micro-batch only."""
    # TODO: accumulation_step for a model wrapped in torch's DistributedDataParallel, which
    # all-reduces during backward by itself. The tests count DDP's own all-reduces: one
    # synchronisation per optimizer step, in the last micro-batch's backward; the weights after 3
    # steps equal one process on the whole batch on every rank; the loss returned as in step 2.
    raise KataTodo("k11", 3, "the same with torch's DDP and no_sync")


# --------------------------------------------------------------------------- the program


@contextlib.contextmanager
def _counted_all_reduces():
    """Count the all-reduces this process launches while the block runs."""
    original, count = dist.all_reduce, [0]

    def all_reduce(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield count
    finally:
        dist.all_reduce = original


def compare(
    rank: int, world_size: int, model_name: str, steps: int, batch: int, ks: list[int]
) -> dict:
    """Train ``steps`` steps on the same global batches (two, in turn) for each k, then with DDP
    and no_sync for the largest k; every model starts from the same seed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    per_rank = batch // world_size
    runs = {}
    for k in [*ks, "ddp"]:
        model = make_model(model_name, seed=0).to(device)
        if k == "ddp":
            model = DistributedDataParallel(model)
            model.register_comm_hook(None, default_hooks.allreduce_hook)  # so that it is counted
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, part = [], slice(rank * per_rank, (rank + 1) * per_rank)
        batches = [make_batch(model_name, batch, seed=seed) for seed in (0, 1)]  # in turn
        batches = [
            (inputs[part].to(device), targets[part].to(device)) for inputs, targets in batches
        ]
        first, _ = split_batch(batches[0], max(ks) if k == "ddp" else k)[0]
        with _counted_all_reduces() as count:
            for step in range(steps):
                mine = batches[step % 2]
                if k == "ddp":
                    losses.append(ddp_accumulation_step(model, optimizer, mine, max(ks)))
                else:
                    losses.append(accumulation_step(model, optimizer, mine, k))
        model = model.module if k == "ddp" else model
        runs[k] = {
            "per_backward": len(first),
            "losses": losses,
            "all_reduces": count[0] / steps,
            "state": {name: t.detach().cpu() for name, t in model.state_dict().items()},
        }
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="One optimizer step over k micro-batches equals one step on the whole batch."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="frozen")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="the global batch of every step")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4], help="micro-batches")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    per_rank = args.batch // args.world_size
    if args.batch % args.world_size or any(k < 1 or per_rank % k for k in args.k):
        parser.error(
            f"--batch {args.batch} must split into {args.world_size} ranks x k micro-batches "
            f"of equal size, for every k in {args.k}"
        )
    say(
        None,
        f"{MODELS[args.model].__name__}, {args.world_size} ranks, a global batch of "
        f"{args.batch} per step, {args.steps} steps",
    )
    results = launch_world(
        compare,
        args.world_size,
        args.model,
        args.steps,
        args.batch,
        args.k,
        backend=args.backend,
        device=args.device,
    )
    runs = results[0]
    first = runs[args.k[0]]["state"]
    for k in [*args.k, "ddp"]:
        run = runs[k]
        gap = max((run["state"][n] - t).abs().max().item() for n, t in first.items())
        what = f"DDP + no_sync, k={max(args.k)}" if k == "ddp" else f"k={k}"
        say(
            None,
            f"{what:>18}: {run['per_backward']:3d} samples per backward, all-reduces per step: "
            f"{run['all_reduces']:g}{' (one per bucket)' if k == 'ddp' else ''}, loss "
            f"{run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, weights {gap:.1e} from "
            f"k={args.k[0]}'s",
        )
    same = all(
        torch.equal(result[k]["state"][n], runs[k]["state"][n])
        for result in results[1:]
        for k in runs
        for n in first
    )
    say(None, f"every rank holds the same weights for each k: {same}")
    return 0


if __name__ == "__main__":
    run_program(main)
