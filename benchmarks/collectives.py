"""Benchmark: time, algorithm and bus bandwidth of the collectives over a sweep of sizes.

    dojo bench collectives                          # or: python -m benchmarks.collectives
    python -m benchmarks.collectives --world-sizes 2,4,8 --max-bytes 256M
    python -m benchmarks.collectives --min-bytes 1M --max-bytes 1M --iters 20 --plot bw.png

The conventions of NVIDIA's nccl-tests (their doc/PERFORMANCE.md), for all_reduce, all_gather,
reduce_scatter, broadcast and all_to_all on float32 tensors, from ``--min-bytes`` to
``--max-bytes`` in steps of ``--factor`` (1 KB to 64 MB, x4, by default), on each world size of
``--world-sizes``. The size S of a row is nccl-tests' S, the bytes of the whole array:

    all_reduce, broadcast   the buffer every rank holds
    all_gather              the output (each rank gives S/n of it)
    reduce_scatter          the input (each rank keeps the reduced S/n)
    all_to_all              each rank's send buffer (n pieces of S/n; it receives as much)

(rounded down to a multiple of 4 n bytes, so that it splits into n float32 pieces). ``time`` is
the median over the timed runs (at least ``--iters``, more for small sizes; after the checked
first call and ``--warmup`` untimed ones) of the slowest rank's time for one call, between a synchronisation of all ranks and
the call's end (on CUDA: after ``torch.cuda.synchronize``); nccl-tests report a mean instead, but
on a shared machine the median is the steadier number. ``algbw = S / time``; ``busbw = algbw x
factor``, the factor being what makes the number comparable with the hardware's link speed
whatever the number of ranks n: 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter
and all_to_all, 1 for broadcast (see ``bus_factor``). Bandwidths are in GB/s of 10^9 bytes, as
nccl-tests print them. Every operation's result is checked against what it must be once per size
(small integers: exact in float32); a wrong result is marked WRONG and the run fails.

The same run measures this machine's memory-copy bandwidth: one large tensor copied into another
(``dst.copy_(src)``, ``--copy-bytes``, median of 5), counting the bytes copied (S / time; STREAM's
"Copy" would count them twice, read and written), by one CPU thread, or on the GPU itself for a
CUDA world. A rank cannot send bytes faster than it can copy them, so each operation's best bus
bandwidth is also printed as a fraction of that copy: the physical ceiling on one host.

The backend and device are chosen per world size as the katas' programs choose them (NCCL on CUDA
when every rank has a GPU, else gloo on the CPU); ``--backend`` and ``--device`` force them. A
table per world size is printed as each size is measured, and ``--plot`` saves a PNG of bus
bandwidth against size, one line per operation, the memory copy as a dashed line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._timing import synchronize
from benchmarks.allreduce import human, parse_size
from dojo.console import run_program, say
from dojo.devices import BACKENDS, DEVICES, choose_for_this_machine, rank_device
from dojo.launch import launch_world

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
GB = 1e9  # nccl-tests' GB/s
COPY_REPEAT = 5
DEFAULT_PLOT = "collectives.png"


def bus_factor(operation: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw for ``operation`` on ``world_size`` ranks.

    The bytes each rank must move over its link, per byte of S: an all-reduce is a
    reduce-scatter then an all-gather, each moving (n-1)/n of the array through every rank;
    a broadcast must get all of S out of the root.
    """
    if world_size < 1:
        raise ValueError(f"a world has at least one rank, got world_size={world_size}")
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
        "all_to_all": (n - 1) / n,
    }
    if operation not in factors:
        raise ValueError(f"unknown operation {operation!r}: use one of {', '.join(OPERATIONS)}")
    return factors[operation]


def sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min_bytes``, ``min_bytes * factor``, ... up to ``max_bytes`` (nccl-tests' -b, -e, -f)."""
    if min_bytes < 4 or max_bytes < min_bytes or factor < 2:
        raise ValueError(
            f"sizes from {min_bytes} to {max_bytes} bytes by x{factor}: need 4 <= min <= max "
            "and a factor of at least 2"
        )
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def elements(nbytes: int, world_size: int) -> int:
    """float32 elements of a size: rounded down to a multiple of the world size (at least n)."""
    return max(world_size, nbytes // 4 // world_size * world_size)


def repetitions(nbytes: int, at_least: int) -> int:
    """Many timed runs for small sizes (cheap, noisy), ``at_least`` for big ones."""
    return max(at_least, min(20, (1 << 20) // nbytes))


# --------------------------------------------------------------------------- data and checks


PERIOD = 61  # every rank's input repeats with this period, so every right result does too


def values(ranks, start: int, count: int, device) -> torch.Tensor:
    """The sum over ``ranks`` of their inputs at positions ``start .. start + count``.

    Rank r holds ``(7 i + 13 r) mod 61`` at position i: small integers, so that any sum of a
    few thousand ranks' values is exact in float32, in any order. Built from one period and
    repeated: a check of 64 MB costs a copy, not a computation per element.
    """
    index = torch.arange(PERIOD, dtype=torch.int64)
    period = sum(((index * 7 + r * 13) % PERIOD).to(torch.float32) for r in ranks)
    period = period.roll(-(start % PERIOD)).to(device)
    return period.repeat(-(-count // PERIOD))[:count]


def inputs(operation: str, rank: int, count: int, world_size: int, device) -> torch.Tensor:
    """What ``rank`` gives ``operation`` for an array of ``count`` elements (nccl-tests' S)."""
    if operation == "all_gather":
        piece = count // world_size
        return values([rank], rank * piece, piece, device)
    return values([rank], 0, count, device)


def check(
    operation: str, output: torch.Tensor, rank: int, world_size: int, count: int
) -> str | None:
    """``None`` when ``output`` is what ``operation`` must give ``rank``, else what is wrong."""
    n, piece, device = world_size, count // world_size, output.device
    if operation == "all_reduce":
        expected = values(range(n), 0, count, device)
        pieces = [(output, expected)]
    elif operation == "reduce_scatter":
        expected = values(range(n), rank * piece, piece, device)
        pieces = [(output, expected)]
    elif operation == "broadcast":
        pieces = [(output, values([0], 0, count, device))]
    elif operation == "all_gather":
        parts = output.split(piece)
        pieces = [(parts[r], values([r], r * piece, piece, device)) for r in range(n)]
    elif operation == "all_to_all":
        parts = output.split(piece)
        pieces = [(parts[r], values([r], rank * piece, piece, device)) for r in range(n)]
    else:
        raise ValueError(f"unknown operation {operation!r}: use one of {', '.join(OPERATIONS)}")
    for got, want in pieces:
        if got.shape != want.shape or not torch.equal(got, want):
            where = torch.nonzero(got.flatten() != want.flatten())
            first = int(where[0]) if len(where) and got.shape == want.shape else 0
            start = (got.data_ptr() - output.data_ptr()) // output.element_size() + first
            shown = (
                f"element {start} is {got.flatten()[first].item():g}, expected "
                f"{want.flatten()[first].item():g}"
                if got.shape == want.shape
                else f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            )
            return f"rank {rank}'s {operation} result is wrong: {shown}"
    return None


# --------------------------------------------------------------------------- the ranks


class _Call:
    """One operation on one size: its buffers, and a call that leaves its result in ``output``."""

    def __init__(self, operation: str, rank: int, world_size: int, count: int, device):
        self.operation, self.rank = operation, rank
        self.source = inputs(operation, rank, count, world_size, device)
        kept = count // world_size if operation == "reduce_scatter" else count
        self.output = torch.empty(kept, device=device)  # all_reduce, broadcast: in place, on it

    def prepare(self) -> None:
        """Before each call, outside the timing."""
        if self.operation == "all_reduce" or (self.operation == "broadcast" and self.rank == 0):
            self.output.copy_(self.source)  # a repeated in-place sum would grow without end
        elif self.operation == "broadcast":
            self.output.fill_(-1.0)  # a broadcast that delivers nothing must not look right

    def __call__(self) -> None:
        operation, output, source = self.operation, self.output, self.source
        if operation == "all_reduce":
            dist.all_reduce(output)
        elif operation == "broadcast":
            dist.broadcast(output, src=0)
        elif operation == "all_gather":  # torch 2.14 renamed all_gather_into_tensor
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
                output, source
            )
        elif operation == "reduce_scatter":
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
                output, source
            )
        else:
            dist.all_to_all_single(output, source)


def _together(token: torch.Tensor) -> None:
    """Every rank here, every earlier GPU kernel done: the start of a timing."""
    synchronize(token.device)
    dist.all_reduce(token)
    synchronize(token.device)


def _agree(flags: list[bool], device) -> list[bool]:
    """Whether any rank raised each flag."""
    tensor = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def _bench_rank(rank: int, world_size: int, sizes: list[int], at_least: int, warmup: int) -> dict:
    device = rank_device()
    token = torch.zeros(1, device=device)
    rows, problems, skipped = [], [], {}
    for nbytes in sizes:
        count = elements(nbytes, world_size)
        calls = {
            op: _Call(op, rank, world_size, count, device) for op in OPERATIONS if op not in skipped
        }
        raised, wrong = {}, {}
        for op, call in calls.items():  # the first call: checked, not timed
            call.prepare()
            try:
                call()
            except (RuntimeError, NotImplementedError) as error:  # not on this backend/device
                raised[op] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                continue
            synchronize(device)
            wrong[op] = check(op, call.output, rank, world_size, count)
        not_run = dict(zip(calls, _agree([op in raised for op in calls], device)))
        for op in [op for op, flag in not_run.items() if flag]:
            skipped[op] = raised.get(op, "another rank could not run it")
            del calls[op]
        if not calls:
            break
        failed = dict(zip(calls, _agree([wrong.get(op) is not None for op in calls], device)))
        problems += [
            f"{message} (at {human(count * 4)}, {world_size} ranks)"
            for op, message in wrong.items()
            if message and op in calls
        ]
        for _ in range(warmup):
            for call in calls.values():
                call.prepare()
                _together(token)
                call()
        reps = repetitions(count * 4, at_least)
        seconds = [[] for _ in calls]
        for _ in range(reps):
            for mine, call in zip(seconds, calls.values()):  # take turns: noise hits all alike
                call.prepare()
                _together(token)
                start = time.perf_counter()
                call()
                synchronize(device)
                mine.append(time.perf_counter() - start)
        times = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's time, run by run
        medians = {op: statistics.median(times[i].tolist()) for i, op in enumerate(calls)}
        row = {"bytes": count * 4, "time": medians, "wrong": failed}
        if rank == 0:  # the row now, while the next size runs
            say(None, format_row(row, world_size))
        rows.append(row)
    return {"rows": rows, "problems": problems, "skipped": skipped}


# --------------------------------------------------------------------------- memory copy


def copy_bandwidth(nbytes: int, device: str) -> tuple[float, float]:
    """(bytes copied per second, seconds) of one ``dst.copy_(src)`` of ``nbytes``: the median
    of a few, by one CPU thread (or on the first GPU)."""
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(nbytes // 4, device=where)
        target = torch.empty_like(source)
        target.copy_(source)  # warm-up: the pages are touched once before any timing
        times = []
        for _ in range(COPY_REPEAT):
            synchronize(where)
            start = time.perf_counter()
            target.copy_(source)
            synchronize(where)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    seconds = statistics.median(times)
    del source, target
    if where.type == "cuda":
        torch.cuda.empty_cache()  # the ranks need the GPU's memory more than this process does
    return nbytes // 4 * 4 / seconds, seconds


# --------------------------------------------------------------------------- output

_CELL = 21


def header(world_size: int, backend: str, device: str) -> list[str]:
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    title = f"{ranks}, {backend} on {device}: time in us, algbw and busbw in GB/s"
    names = f"{'size':>8} |" + "|".join(f"{op:^{_CELL + 2}}" for op in OPERATIONS)
    units = f"{'':>8} |" + "|".join(f" {'time':>7} {'algbw':>6} {'busbw':>6} " for _ in OPERATIONS)
    return [title, names.rstrip(), units.rstrip()]


def _rate(gb_per_s: float) -> str:
    """A bandwidth in at most 5 characters: 3 significant digits from 1 GB/s, else 3 decimals."""
    for digits, above in ((0, 100), (1, 10), (2, 1)):
        if gb_per_s >= above:
            return f"{gb_per_s:.{digits}f}"
    return f"{gb_per_s:.3f}"


def format_row(row: dict, world_size: int) -> str:
    cells = []
    for op in OPERATIONS:
        if op not in row["time"]:
            cells.append(f" {'not run':>{_CELL}} ")
            continue
        seconds = row["time"][op]
        algbw = row["bytes"] / seconds / GB
        busbw = algbw * bus_factor(op, world_size)
        cell = f"{seconds * 1e6:7.0f} {_rate(algbw):>6} {_rate(busbw):>6}"
        cells.append(f" {cell + ' WRONG' if row['wrong'][op] else cell:<{_CELL}} ")
    return f"{human(row['bytes']):>8} |" + "|".join(cells).rstrip()


def best_fractions(rows: list[dict], world_size: int, copy: float) -> str:
    """Each operation's best bus bandwidth, as a fraction of the memory copy's bandwidth."""
    if world_size == 1:
        return "one rank: no byte crosses a link, so bus bandwidth says nothing here"
    parts = []
    for op in OPERATIONS:
        timed = [r for r in rows if op in r["time"] and not r["wrong"][op]]
        if not timed:
            continue
        best = max(timed, key=lambda r: r["bytes"] / r["time"][op])
        busbw = best["bytes"] / best["time"][op] * bus_factor(op, world_size)
        parts.append(f"{op} {busbw / copy:.2g} (at {human(best['bytes'])})")
    return "best busbw / memory copy: " + ", ".join(parts)


def plot(path: Path, worlds: list[dict], copy: float, copy_where: str) -> None:
    """Bus bandwidth against size, one panel per world size, one line per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    columns = len(worlds)
    figure, axes = plt.subplots(
        1, columns, figsize=(1.5 + 5.5 * columns, 5), sharey=True, squeeze=False
    )
    markers = ("o", "s", "^", "D", "v")
    for ax, world in zip(axes[0], worlds):
        n, sizes = world["world_size"], [r["bytes"] for r in world["rows"]]
        for index, (op, marker) in enumerate(zip(OPERATIONS, markers)):
            points = [
                (r["bytes"], r["bytes"] / r["time"][op] * bus_factor(op, n) / GB)
                for r in world["rows"]
                if op in r["time"] and not r["wrong"][op]
            ]
            points = [(x, y) for x, y in points if y > 0 and n > 1]  # one rank: no link
            if points:
                ax.plot(*zip(*points), f"{marker}-C{index}", markersize=4, linewidth=1.5, label=op)
        if n == 1:
            ax.text(
                0.5, 0.5, "one rank: no byte crosses a link", ha="center", transform=ax.transAxes
            )
        ax.axhline(copy / GB, color="black", linestyle="--", linewidth=1, label="memory copy")
        ax.annotate(
            f"memory copy, {copy_where}: {copy / GB:.3g} GB/s",
            (0.01, copy / GB),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(x).replace(" ", "")))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ranks = f"{n} rank{'s' if n > 1 else ''}"
        ax.set_title(f"{ranks}, {world['backend']} on {world['device']}")
        ax.set_xlabel("size S (bytes of the whole array, as nccl-tests count it)")
        ax.grid(True, which="major", alpha=0.3)
        ax.grid(True, which="minor", axis="y", alpha=0.1)
    axes[0][0].set_ylabel("bus bandwidth (GB/s, log scale)")
    bottom, top = axes[0][0].get_ylim()
    axes[0][0].set_ylim(bottom, max(top, copy / GB * 3))  # room for the copy's label
    legend = {}  # every panel's lines, once each, in OPERATIONS' order
    for ax in axes[0]:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    labels = [op for op in (*OPERATIONS, "memory copy") if op in legend]
    handles = [legend[label] for label in labels]
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    figure.suptitle(
        "Bus bandwidth of the collectives: algbw x nccl-tests' factor, from the median time"
    )
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="default: nccl with a GPU per rank, else gloo",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="default: cuda with a GPU per rank, else cpu",
    )
    parser.add_argument(
        "--world-sizes",
        default="2,4",
        help="comma-separated world sizes, one table each (default 2,4)",
    )
    parser.add_argument("--min-bytes", default="1K", help="the smallest size (default 1K)")
    parser.add_argument("--max-bytes", default="64M", help="the largest size (default 64M)")
    parser.add_argument(
        "--factor", type=int, default=4, help="from one size to the next (default 4)"
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed runs at least, per size and operation (default 5)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed runs after the checked one (default 1)"
    )
    parser.add_argument(
        "--copy-bytes", default="256M", help="the memory copy's size (default 256M)"
    )
    parser.add_argument(
        "--plot", default=DEFAULT_PLOT, help=f"the PNG to write (default {DEFAULT_PLOT})"
    )
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(n) for n in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--world-sizes: {args.world_sizes!r} is not a list like 2,4")
    if any(n < 1 for n in world_sizes):
        parser.error("--world-sizes: every world needs at least one rank")
    sizes_given = {}
    for name, text in (
        ("--min-bytes", args.min_bytes),
        ("--max-bytes", args.max_bytes),
        ("--copy-bytes", args.copy_bytes),
    ):
        try:
            sizes_given[name] = parse_size(text)
        except argparse.ArgumentTypeError as error:
            parser.error(f"{name}: {error}")
    if sizes_given["--max-bytes"] < sizes_given["--min-bytes"]:
        parser.error("--max-bytes must be at least --min-bytes")
    for name, value, least in (
        ("--factor", args.factor, 2),
        ("--iters", args.iters, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < least:
            parser.error(f"{name} must be at least {least}")
    if not args.plot.lower().endswith(".png"):
        parser.error(f"--plot: {args.plot!r} should name a .png file")
    sizes = sweep(sizes_given["--min-bytes"], sizes_given["--max-bytes"], args.factor)
    choices = {}
    for n in world_sizes:
        choices[n] = choose_for_this_machine(n, args.backend, args.device)
    on_cuda = any(device == "cuda" for _, device in choices.values())
    copy_where = "one GPU" if on_cuda else "one CPU thread"
    copy, copy_seconds = copy_bandwidth(sizes_given["--copy-bytes"], "cuda" if on_cuda else "cpu")
    say(
        None,
        f"memory copy ({copy_where}): {human(sizes_given['--copy-bytes'])} in "
        f"{copy_seconds * 1e3:.3g} ms = {copy / GB:.2f} GB/s (bytes copied / time): the ceiling on one host",
    )
    say(
        None,
        f"{', '.join(OPERATIONS)} on float32, {human(sizes[0])} to {human(sizes[-1])}; "
        f"size: nccl-tests' S; time: median of at least {args.iters} run(s) (slowest rank); "
        "busbw = algbw x (2(n-1)/n, (n-1)/n, (n-1)/n, 1, (n-1)/n)",
    )
    worlds, problems = [], []
    for n in world_sizes:
        backend, device = choices[n]
        say(None, "")
        for line in header(n, backend, device):
            say(None, line)
        results = launch_world(
            _bench_rank, n, sizes, args.iters, args.warmup, backend=backend, device=device
        )
        rows = results[0]["rows"]
        for op, why in results[0]["skipped"].items():
            say(None, f"{op}: not run on {backend}/{device} here ({why})")
        say(None, best_fractions(rows, n, copy))
        worlds.append({"world_size": n, "backend": backend, "device": device, "rows": rows})
        problems += [problem for result in results for problem in result["problems"]]
    path = Path(args.plot).resolve()
    plot(path, worlds, copy, copy_where)
    say(None, "")
    say(None, f"plot: {os.path.relpath(path) if path.is_relative_to(Path.cwd()) else path}")
    if problems:
        say(None, "WRONG results, a broken backend or device, not a slow one:")
        for problem in problems:
            say(None, f"  {problem}")
        return 1
    return 0


if __name__ == "__main__":
    run_program(main)
