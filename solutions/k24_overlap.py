"""k24 · Overlap, measured: how much gradient communication hides behind backward.

THE IDEA
    k12's and k13's wrappers launch each all-reduce from a gradient hook, while backward still
    computes the layers below; k04 averages after backward. The first two are said to hide
    communication behind computation. How much do they hide? Record when things happen on
    one rank, then measure:

        backward    |======================|                     loss.backward(): call, return
        k04                                 [ar][ar][ar]          launched after it: 0% hidden
        k12              [ar]  [ar][ar]  [ar------]               launched from the hooks
        hidden           ^^^^  ^^^^^^^^  ^^^^^
        exposed                               ^^^^^               still running after backward

        overlap fraction = time during which communication runs while backward still computes
                           / total communication time

    Three details make the number honest.

    - Communication intervals overlap one another: k12 launches the next all-reduce before the
      last has finished, and gloo queues them. A moment with two all-reduces in flight is still
      one moment: merge the intervals into their union before measuring, or it counts twice.
    - An asynchronous all-reduce returns at once: its return says nothing about when the work
      ended. The work's own completion does: ``work.get_future()`` is a future the backend
      completes when the collective has finished, and a callback given to it
      (``add_done_callback``) runs at that moment, on the backend's thread. Not ``wait()``: it
      returns when it is called, perhaps long after the work was done, and would make hidden
      communication look exposed. A blocking all-reduce (k04's) runs from its call to its
      return. (torch.profiler sees the same on gloo, a ``gloo:all_reduce`` event on gloo's own
      thread, at a higher cost. On NCCL the future completes at launch, its value ready later on
      a CUDA stream: there, time with CUDA events or the profiler.)
    - Every time comes from one clock, ``time.perf_counter()`` (seconds; on Linux one clock for
      every process of the machine, so ranks' times compare too).

    Interval from launch to completion is "in flight": queued behind another all-reduce counts,
    since the gradient is not averaged until it is done. On gloo and a CPU, backward and gloo's
    threads share the cores: hidden communication still slows backward a little, and on a busy
    machine the numbers move from run to run. The program takes the median of several steps;
    the tests check only what holds by construction (k04 hides nothing; k12's and k13's first
    all-reduce is launched inside backward, so some communication is hidden).

STEPS
    1. ``merge_intervals(intervals)``: the union of (start, end) pairs as sorted, disjoint
       pairs (touching ones merged); an end before its start is a ValueError.
    2. ``overlap_fraction(backward, communication)``: the time in both unions (the backward's
       and the communication's) over the communication's time; no communication time at all
       is a ValueError (there is nothing to hide), no backward gives 0.0.
    3. ``watch_all_reduces()``: a context manager that yields a list and appends a ``Comm`` for
       every ``dist.all_reduce`` called inside it: launched at the call, completed when the work
       has finished (blocking: at the return; async: the future's callback), the call's result
       untouched; ``dist.all_reduce`` is itself again after the block, even after an error.
    4. ``record_step(model, batch, synchronize)``: one step of data-parallel training (forward,
       loss, backward, then ``synchronize()``, which averages the gradients), recorded as a
       ``StepRecord``: when it began, the backward's call and return, every all-reduce, when
       ``synchronize()`` returned.

WHAT THE TESTS CHECK
    ``merge_intervals`` and ``overlap_fraction`` exactly on hand-made intervals (none, full,
    partial, unsorted, nested, touching, several overlapping all-reduces, several backward
    pieces) and against counting on a grid; bad intervals raise ValueError. ``watch_all_reduces``
    on 2 ranks: a blocking all-reduce's call and return, its result and op untouched; an async
    one whose peer comes 0.3 s late returns at once (the watch must not wait for it) and
    completes after the peer arrived; one that finished before
    ``wait()`` was called completed before ``is_completed()`` said so; ``dist.all_reduce`` comes
    back after the block, also after an error. ``record_step`` on 2 ranks with the TinyTransformer:
    k04's average after backward hides exactly nothing; your k12 and k13 record one all-reduce
    per trainable parameter and per bucket (as many as were called), the first launched before
    backward returned, so their fraction is above 0; every all-reduce lies inside the step;
    the backward interval starts after the forward and holds every gradient hook; the step
    leaves averaged gradients; and the program's table.

    (This kata uses your k04, k12 and k13: ``average_gradients``, ``OverlappingDDP`` and
    ``BucketedDDP`` come from katas/k04_allreduce.py, k12_ddp_overlap.py and k13_buckets.py.)

RUN IT
    .venv/bin/python -m katas.k24_overlap --world-size 2 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import TinyTransformer, make_tokens, transformer_loss

from .k04_allreduce import average_gradients
from .k12_ddp_overlap import OverlappingDDP
from .k13_buckets import BucketedDDP

Interval = tuple[float, float]  # (start, end), seconds of time.perf_counter()


def merge_intervals(intervals: Iterable[Sequence[float]]) -> list[Interval]:
    """The union of ``intervals`` ((start, end) pairs, in any order) as sorted, disjoint pairs.

    Overlapping and touching intervals become one; ``(0, 2), (1, 3), (3, 4)`` is ``[(0, 4)]``.
    A point (start == end) is kept, unless it lies inside another interval. An interval whose
    end comes before its start is a ValueError.
    """
    # BEGIN STEP 1: merge_intervals: the union of intervals
    # TODO: the union of the intervals as a sorted list of disjoint (start, end) tuples: every
    # moment inside some interval is inside exactly one of them, and intervals that overlap, nest
    # or touch (one ends where the next starts) become one. Any order in, sorted out; the input is
    # left as it was; an empty input gives []. An interval whose end is before its start is a
    # ValueError naming it. The tests check unsorted, nested, touching and disjoint intervals,
    # points (start == end), and random intervals against counting on a grid.
    pairs = []
    for interval in intervals:
        start, end = interval
        if end < start:
            raise ValueError(
                f"the interval {tuple(interval)} ends before it starts: each interval is "
                "(start, end) with start <= end"
            )
        pairs.append((start, end))
    merged: list[Interval] = []
    for start, end in sorted(pairs):
        if merged and start <= merged[-1][1]:  # overlaps or touches the last one: extend it
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
    # END STEP 1


def overlap_fraction(
    backward: Iterable[Sequence[float]], communication: Iterable[Sequence[float]]
) -> float:
    """The share of the communication's time during which backward also ran (0.0 to 1.0).

    Both arguments are (start, end) intervals, in any order, possibly overlapping one another:
    each moment counts once. No communication time at all is a ValueError; no backward, 0.0.
    """
    # BEGIN STEP 2: overlap_fraction: the hidden share of communication
    # TODO: the time during which communication runs while backward also runs, over the total
    # communication time: a number from 0.0 (nothing hidden) to 1.0 (all of it hidden). Several
    # all-reduces in flight at once, or backward given in several overlapping pieces, count each
    # moment once. No communication intervals (or only empty ones) is a ValueError saying there is
    # nothing to measure; no backward intervals gives 0.0; an interval that ends before it starts
    # is a ValueError. The tests check none, full, partial, before, after and several overlapping
    # intervals exactly, and random ones against counting on a grid.
    busy = merge_intervals(communication)
    total = sum(end - start for start, end in busy)
    if not total > 0:
        raise ValueError(
            f"no communication time to measure ({len(busy)} interval(s) of total length 0): the "
            "overlap fraction is the hidden share of communication, so there must be some"
        )
    computing = merge_intervals(backward)
    hidden = 0.0
    for start, end in busy:
        for begin, finish in computing:
            hidden += max(0.0, min(end, finish) - max(start, begin))
    return hidden / total
    # END STEP 2


@dataclass(eq=False)
class Comm:
    """One all-reduce as this rank saw it (times from ``time.perf_counter()``, in seconds)."""

    launched: float  # when dist.all_reduce was called
    nbytes: int  # the size of the tensor it reduced
    is_async: bool  # called with async_op=True: it returned a work handle at once
    completed: float | None = None  # when the work had finished (None: not yet)


@contextlib.contextmanager
def watch_all_reduces() -> Iterator[list[Comm]]:
    """Record every ``dist.all_reduce`` called inside the block, from launch to completion.

    Yields the list it fills. An async all-reduce's ``completed`` is set when its work has
    finished (its future's callback), maybe after the block; the call's result is untouched.
    """
    # BEGIN STEP 3: watch_all_reduces: launch and completion of each all-reduce
    # TODO: while the block runs, every dist.all_reduce(...) call (any arguments) still does what it
    # did and returns what it returned, and also appends a Comm to the yielded list: launched when
    # it was called, nbytes of its tensor, is_async, and completed when the collective had really
    # finished: for a blocking call when it returned; for an async one when its work finished,
    # which may be long after the call returned and before anyone calls wait(). All times from
    # time.perf_counter(). After the block (also when it raised) dist.all_reduce is the original
    # again. The tests check a blocking call with its op, an async one whose peer arrives 0.3 s
    # late (completed after the peer arrived), one that finished before wait() was called
    # (completed no later than is_completed() said True), and the restore.
    comms: list[Comm] = []
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is None:  # blocking: it has finished when the call returns
            comm.completed = time.perf_counter()
        else:  # async: the backend completes the future when the collective has finished
            comm.is_async = True
            work.get_future().add_done_callback(
                lambda _: setattr(comm, "completed", time.perf_counter())
            )
        return work

    dist.all_reduce = all_reduce
    try:
        yield comms
    finally:
        dist.all_reduce = original
    # END STEP 3


@dataclass(eq=False)
class StepRecord:
    """One recorded step on one rank (times from ``time.perf_counter()``, in seconds)."""

    began: float  # the forward's start
    backward: Interval  # loss.backward() called, returned
    communication: list[Comm]  # every all-reduce of the step, in launch order
    ended: float  # synchronize() returned: every gradient averaged

    @property
    def seconds(self) -> float:
        return self.ended - self.began

    def intervals(self) -> list[Interval]:
        return [(c.launched, c.completed) for c in self.communication]

    def overlap(self) -> float:
        return overlap_fraction([self.backward], self.intervals())


def record_step(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], synchronize: Callable[[], None]
) -> StepRecord:
    """Forward ``batch`` = (tokens, targets), backward, ``synchronize()``: recorded.

    ``model`` is a wrapper (k12's, k13's) or a bare model; ``synchronize`` averages the
    gradients (``ddp.finish_gradient_synchronization``, or k04's ``average_gradients``).
    """
    # BEGIN STEP 4: record_step: one recorded step
    # TODO: run one step on this rank: the forward of batch's tokens through model, the loss
    # (transformer_loss against the targets), its backward, then synchronize(); and return a
    # StepRecord of it: began (before the forward), backward (loss.backward() called, returned:
    # nothing else inside), communication (every all-reduce of the step, launch and completion,
    # those the hooks launch during backward too) and ended (synchronize() returned). Times from
    # time.perf_counter(). A synchronize that is not callable, or a batch that is not a pair, is a
    # ValueError. The tests check k04 (0.0 hidden, exactly), your k12 and k13 (as many all-reduces
    # as were called, the first launched before backward returned), that every all-reduce lies
    # inside the step, the backward interval against the forward and the gradient hooks, and that
    # the gradients come out averaged.
    if not callable(synchronize):
        raise ValueError(
            f"synchronize must be a function to call after backward, got "
            f"{type(synchronize).__name__}: pass ddp.finish_gradient_synchronization or "
            "lambda: average_gradients(model)"
        )
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(
            f"batch must be a pair (tokens, targets), got {type(batch).__name__}: "
            "make_tokens(size, seed) returns one"
        )
    tokens, targets = batch
    began = time.perf_counter()
    loss = transformer_loss(model(tokens), targets)
    with watch_all_reduces() as comms:
        backward_began = time.perf_counter()
        loss.backward()
        backward_ended = time.perf_counter()
        synchronize()
        ended = time.perf_counter()
    return StepRecord(began, (backward_began, backward_ended), comms, ended)
    # END STEP 4


# --------------------------------------------------------------------------- the program

WAYS = ("no overlap (k04)", "per-parameter (k12)", "bucketed (k13)")


def make_model(blocks: int, dim: int, seed: int = 0) -> TinyTransformer:
    """The same TinyTransformer on every rank and for every way (one seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer(blocks, dim)


def _ways(blocks: int, dim: int, cap_mb: float) -> dict:
    """Each way: (the module to run, the function that averages after backward)."""
    device = rank_device()
    plain = make_model(blocks, dim).to(device)
    per_parameter = OverlappingDDP(make_model(blocks, dim).to(device))
    bucketed = BucketedDDP(make_model(blocks, dim).to(device), bucket_cap_mb=cap_mb)
    return {
        WAYS[0]: (plain, lambda: average_gradients(plain)),
        WAYS[1]: (per_parameter, per_parameter.finish_gradient_synchronization),
        WAYS[2]: (bucketed, bucketed.finish_gradient_synchronization),
    }


def _lanes(record: StepRecord, width: int = 60) -> list[str]:
    """Two text lanes of one step, from its start (left) to its end (right)."""
    span = max(record.seconds, 1e-9)

    def lane(intervals, mark: str) -> str:
        cells = [" "] * width
        for start, end in intervals:
            first = min(width - 1, int((start - record.began) / span * width))
            last = min(width - 1, int((end - record.began) / span * width))
            for cell in range(first, last + 1):
                cells[cell] = mark
        return "".join(cells)

    return [
        f"  backward    |{lane([record.backward], '=')}|",
        f"  all-reduces |{lane(merge_intervals(record.intervals()), '#')}|",
    ]


def measure(
    rank: int, world_size: int, blocks: int, dim: int, batch: int, cap_mb: float, steps: int
) -> dict:
    """Train the three ways side by side, step by step; rank 0 shows one step of each."""
    device = rank_device()
    ways = _ways(blocks, dim, cap_mb)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, (m, _) in ways.items()}
    records: dict[str, list[StepRecord]] = {name: [] for name in ways}
    for step in range(steps + 1):  # step 0 warms up: not measured
        tokens, targets = make_tokens(batch, seed=1000 * step + rank)
        for name, (module, synchronize) in ways.items():  # take turns: noise hits every way
            optimizers[name].zero_grad(set_to_none=True)
            dist.barrier()
            record = record_step(module, (tokens.to(device), targets.to(device)), synchronize)
            optimizers[name].step()
            if step:
                records[name].append(record)
    if rank == 0:
        say(rank, "the last step of each way (left: the forward starts; right: all averaged):")
        for name in ways:
            say(rank, f"{name}: {len(records[name][-1].communication)} all-reduce(s)")
            for line in _lanes(records[name][-1]):
                say(rank, line)
    table = {}
    for name, recorded in records.items():
        table[name] = {
            "all-reduces": len(recorded[-1].communication),
            "step": statistics.median(r.seconds for r in recorded),
            "backward": statistics.median(r.backward[1] - r.backward[0] for r in recorded),
            "communication": statistics.median(
                sum(e - s for s, e in merge_intervals(r.intervals())) for r in recorded
            ),
            "hidden": statistics.median(r.overlap() for r in recorded),
        }
    states = [
        {
            k: v.detach().cpu()
            for k, v in (m.module if hasattr(m, "module") else m).state_dict().items()
        }
        for m, _ in ways.values()
    ]
    same = all(torch.equal(s[k], states[0][k]) for s in states[1:] for k in states[0])
    return {"table": table, "same": same}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="How much gradient communication hides behind backward: k04, k12, k13."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank (default 16)")
    parser.add_argument(
        "--cap-mb", type=float, default=0.1, help="k13's bucket cap in MiB (default 0.1)"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.blocks < 1 or args.batch < 1 or args.dim < 4 or args.dim % 4:
        parser.error("--blocks and --batch must be at least 1, --dim a multiple of 4 (4 heads)")
    if not args.cap_mb > 0:
        parser.error("--cap-mb must be positive")
    backward, comms = [(0, 8)], [(2, 4), (3, 6), (7, 10)]
    say(None, f"made-up intervals (ms): backward {backward}, all-reduces {comms}")
    say(
        None,
        f"  the all-reduces' union {merge_intervals(comms)}: "
        f"{overlap_fraction(backward, comms):.0%} of their time hidden behind backward",
    )
    model = make_model(args.blocks, args.dim)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    say(
        None,
        f"TinyTransformer ({args.blocks} blocks, width {args.dim}: {nbytes / 2**20:.2f} MiB in "
        f"{len(params)} tensors) on {args.world_size} ranks, {args.steps} measured steps",
    )
    results = launch_world(
        measure,
        args.world_size,
        args.blocks,
        args.dim,
        args.batch,
        args.cap_mb,
        args.steps,
        backend=args.backend,
        device=args.device,
    )
    say(None, "rank 0, the median of the measured steps (ms; hidden: the overlap fraction):")
    say(
        None,
        f"  {'way':<22}{'all-reduces':>12}{'step':>9}{'backward':>10}{'comm':>9}{'hidden':>8}",
    )
    for name, row in results[0]["table"].items():
        say(
            None,
            f"  {name:<22}{row['all-reduces']:>12}{1000 * row['step']:>9.2f}"
            f"{1000 * row['backward']:>10.2f}{1000 * row['communication']:>9.2f}"
            f"{100 * row['hidden']:>7.1f}%",
        )
    say(None, f"the three ways end with the same weights: {results[0]['same']}")
    return 0


if __name__ == "__main__":
    run_program(main)
