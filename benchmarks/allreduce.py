"""Benchmark: your ring all-reduce (k09) against gloo's own ``dist.all_reduce``, on one world.

    python -m benchmarks.allreduce                  # the ring in katas/ (yours), 4 ranks
    python -m benchmarks.allreduce --impl solutions # the reference ring
    python -m benchmarks.allreduce --sizes 16M --repeat 21

For each size (float32 tensors, 4 KB to 64 MB by default) both all-reduces run on the same world
(gloo on CPU unless --backend/--device say otherwise), alternating, so a busy machine slows both
alike. Each timing is the slowest rank's time between two barriers; the table shows the median
over the repetitions (the "runs" column says how many), the algorithm bandwidth (size / time, as
nccl-tests report it), ``library time / ring time`` (above 1: the ring is faster) and the CPU time
of one all-reduce, every rank's process together (gloo's threads included): where the ranks
outnumber the cores, that, not the wire, sets the time. The ring's sum is checked against the
library's at every size; a wrong sum fails the run.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._timing import timed
from dojo.console import run_program, say
from dojo.devices import choose_for_this_machine, rank_device
from dojo.harness import impl
from dojo.launch import add_launch_arguments, launch_world

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"16M"`` -> 16777216 bytes; plain numbers are bytes. Must be a multiple of 4 (float32)."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    try:
        number = int(text[: len(text) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4K, 16M or 4096") from None
    if number < 4 or number % 4:
        raise argparse.ArgumentTypeError(
            f"{text!r}: sizes are float32 tensors, a positive multiple of 4 bytes"
        )
    return number


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return (
                f"{nbytes:.0f} {unit}" if unit == "B" or nbytes >= 100 else f"{nbytes:.3g} {unit}"
            )
        nbytes /= 1024
    raise AssertionError("unreachable")


def repetitions(nbytes: int, at_least: int) -> int:
    """Many repetitions for small tensors (noisy, cheap), ``at_least`` for big ones."""
    return max(at_least, min(100, (8 << 20) // nbytes))


def _timed(op, buffer: torch.Tensor, original: torch.Tensor) -> tuple[float, float]:
    """(seconds on the slowest rank, CPU seconds of every rank's process together, gloo's own
    threads included): where a ring spends its time when the cores, not the wire, are short."""
    buffer.copy_(original)  # a fresh input each time: repeated sums would overflow
    cpu = time.process_time()
    seconds = timed(op, buffer)
    used = torch.tensor([time.process_time() - cpu], dtype=torch.float64, device=rank_device())
    dist.all_reduce(used)
    return seconds, float(used.item())


def _bench_rank(
    rank: int, world_size: int, impl_name: str, sizes: list[int], at_least: int
) -> list[dict]:
    ring = importlib.import_module(f"{impl_name}.k09_ring_allreduce").ring_allreduce
    rows = []
    for nbytes in sizes:
        original = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)).to(
            rank_device()
        )
        buffer = torch.empty_like(original)
        ops = {"ring": ring, "library": dist.all_reduce}
        results = {}
        for name, op in ops.items():  # warm-up, and the correctness check
            _timed(op, buffer, original)
            results[name] = buffer.clone()
        correct = torch.allclose(results["ring"], results["library"], rtol=1e-4, atol=1e-4)
        times = {name: [] for name in ops}
        cpu = {name: [] for name in ops}
        for _ in range(repetitions(nbytes, at_least)):
            for name, op in ops.items():  # alternate, so noise hits both alike
                seconds, used = _timed(op, buffer, original)
                times[name].append(seconds)
                cpu[name].append(used)
        row = {
            "bytes": nbytes,
            "correct": correct,
            "runs": len(times["ring"]),
            **{n: statistics.median(t) for n, t in times.items()},
            **{f"{n} cpu": statistics.median(t) for n, t in cpu.items()},
        }
        if rank == 0:
            say(None, _format_row(row))
        rows.append(row)
    return rows


def _header(library: str) -> str:
    return (
        f"{'size':>8} | {'ring time':>10} {'ring algbw':>12} | {library + ' time':>10} "
        f"{library + ' algbw':>12} | {library + '/ring':>9} | {'runs':>4} | "
        f"{'CPU, all ranks: ring':>22} {library:>9}"
    )


def _format_row(row: dict) -> str:
    size, ring, library = row["bytes"], row["ring"], row["library"]
    text = (
        f"{human(size):>8} | {ring * 1e3:>7.2f} ms {human(size / ring) + '/s':>12} | "
        f"{library * 1e3:>7.2f} ms {human(size / library) + '/s':>12} | {library / ring:>8.2f}x"
        f" | {row['runs']:>4} | {row['ring cpu'] * 1e3:>19.1f} ms {row['library cpu'] * 1e3:>6.1f} ms"
    )
    return text if row["correct"] else text + "  WRONG SUM"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_launch_arguments(parser)
    parser.add_argument(
        "--impl",
        choices=impl.PACKAGES,
        default=impl.current(),
        help="whose ring: katas (yours) or solutions (default: $DOJO_IMPL, else katas)",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated tensor sizes in bytes, K or M (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=7,
        help="repetitions at least, per size and all-reduce; the median is shown (default 7)",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError as error:
        parser.error(f"--sizes: {error}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.backend is None and args.device is None:
        backend, device = "gloo", "cpu"  # the comparison the kata is about, GPUs or not
    else:
        backend, device = choose_for_this_machine(args.world_size, args.backend, args.device)
    say(
        None,
        f"{args.impl}.k09_ring_allreduce.ring_allreduce against dist.all_reduce, {args.world_size} ranks, "
        f"{backend} on {device}, float32; each time is the median of `runs` runs (at least "
        f"{args.repeat}, more for small sizes)",
    )
    say(None, _header(backend))
    rows = launch_world(
        _bench_rank, args.world_size, args.impl, sizes, args.repeat, backend=backend, device=device
    )[0]
    wrong = [human(r["bytes"]) for r in rows if not r["correct"]]
    if wrong:
        say(
            None,
            f"the ring's sum differs from dist.all_reduce's at {', '.join(wrong)}: see k09's tests",
        )
        return 1
    return 0


if __name__ == "__main__":
    run_program(main)
