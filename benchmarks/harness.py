"""What one multi-process test costs: the dojo harness (cold, fresh ranks forked from its warm
forkserver, ranks reused from the last world) beside mp.spawn per test.

    python benchmarks/harness.py [--world-size 4] [--repeat 5]

Each way runs the same work: a fresh 4-rank gloo world that all-reduces one tensor, then ends.
All ways run in this one process, one after another, so the ratio holds on a noisy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # benchmarks/__init__ said how to get in without it
import torch.distributed as dist
import torch.multiprocessing as mp

from dojo.harness.loopback import keep_gloo_on_loopback, loopback_store
from dojo.harness.world import FRESH_VAR, run_world


def _world(n: int):
    return lambda: run_world(_all_reduce, n)


def _spawned(n: int):
    def run():
        store = loopback_store(wait_for_workers=False)  # on loopback, as the harness's is
        mp.spawn(_spawned_rank, args=(n, store.port), nprocs=n)
        del store

    return run


def _all_reduce(rank: int, world_size: int) -> int:
    value = torch.tensor([rank])
    dist.all_reduce(value)
    return int(value)


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    """What a spawn-per-test harness runs in each rank: import torch (paid by spawn), join, work."""
    keep_gloo_on_loopback(os.environ)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _all_reduce(rank, world_size)
    dist.destroy_process_group()


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _timed(what: str, runs) -> float:
    """The median of ``runs`` (callables timed one by one), said as it starts and as it ends:
    the whole benchmark takes about a minute on 2 cores. Whole lines: a world's ranks may print
    meanwhile (torch 2.10's gloo does)."""
    print(f"  {what} ...", flush=True)
    seconds = statistics.median(_seconds(run) for run in runs)
    print(f"    {seconds:.3f} s", flush=True)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--repeat", type=int, default=5, help="warm worlds and spawns to time (median)"
    )
    args = parser.parse_args(argv)
    n = args.world_size
    print(
        f"timing one {n}-rank world per test {args.repeat} times each way "
        "(about a minute on 2 cores):",
        flush=True,
    )
    cold = _timed("the first world (it starts a forkserver that imports torch)", [_world(n)])
    warm = _timed(f"{args.repeat} warm worlds", [_world(n)] * args.repeat)
    os.environ[FRESH_VAR] = "1"  # every rank forked anew, as before ranks were reused
    try:
        fresh = _timed(f"{args.repeat} worlds of fresh ranks", [_world(n)] * args.repeat)
    finally:
        del os.environ[FRESH_VAR]
    spawn = _timed(
        f"{args.repeat} worlds by torch.multiprocessing.spawn (each rank imports torch)",
        [_spawned(n)] * args.repeat,
    )
    print()
    print(
        f"one {n}-rank world per test (gloo, all_reduce), median of {args.repeat}, {os.cpu_count()} CPU(s):"
    )
    print(f"  {'way':<34}{'seconds':>9}{'x warm harness':>16}")
    for name, seconds in (
        ("dojo harness, warm", warm),
        ("dojo harness, fresh ranks", fresh),
        ("dojo harness, cold (first world)", cold),
        ("torch.multiprocessing.spawn", spawn),
    ):
        print(f"  {name:<34}{seconds:>9.3f}{seconds / warm:>16.1f}")
    print(
        f"spawn per test costs {spawn / warm:.0f}x a warm harness world; forking the ranks "
        f"afresh {fresh / warm:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
