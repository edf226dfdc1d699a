"""k01 · Spawning rank processes: world, rank, local rank, node.

THE IDEA
    Data-parallel training runs one process per device, all running the same program. Each
    process needs to know who it is:

    - the *world* is every process of one job; the *world size* is how many there are;
    - a process's *rank* is its number in the world, 0 .. world_size-1 (rank 0 usually leads);
    - a *node* is one machine; each node runs ``nproc_per_node`` processes;
    - a process's *local rank* is its number on its own node; it picks the node's GPU.

    The tutorial's two hosts with three processes each (world size 6):

        node 0 (host A)                      node 1 (host B)
        local rank  0     1     2            local rank  0     1     2
        rank        0     1     2            rank        3     4     5

    A launcher starts the processes, tells each one its rank and the world size, waits for
    them, and notices when one fails. Use the *spawn* start method: each process starts a
    fresh interpreter. CUDA cannot be used in a forked child, so PyTorch programs spawn; the
    price is that the module is imported again in every child, so a program's top level must
    sit under ``if __name__ == "__main__":`` (or every child would launch children of its own).

STEPS
    1. ``global_rank`` and ``world_size_of``: the arithmetic of the picture above.
    2. ``greet``: what the tutorial's processes print, ``world size:4. I'm rank 2.``
    3. ``run_rank``: the body of one process: call ``fn(rank, world_size)`` and put
       ``(rank, "ok", answer)`` on the queue, or ``(rank, "error", traceback_text)`` if it raised.
    4. ``launch``: start ``world_size`` processes with ``mp.get_context("spawn")`` (never
       ``mp.set_start_method``, which may run once per program), collect one message per rank,
       join every process, and return the answers in rank order, or raise ``RankProcessFailed``
       naming the ranks that failed.

WHAT THE TESTS CHECK
    The rank arithmetic for the tutorial's layout and others; the greeting; that ``launch``
    really spawns (a child does not share the launcher's memory), returns every answer in rank
    order, leaves no process behind, and names the rank that raised.

RUN IT
    .venv/bin/python -m katas.k01_spawn --world-size 4
"""

from __future__ import annotations

import argparse
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from dojo.console import run_program, say
from dojo.todo import KataTodo


class RankProcessFailed(RuntimeError):
    """One or more ranks raised; the message names each one and shows its traceback."""


def global_rank(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    """The rank, in the whole world, of process ``local_rank`` on node ``node_rank``."""
    # TODO: return this process's number in the whole world, counting from 0: all the ranks of
    # the nodes before this one come first, then this node's processes in local-rank order. The
    # tests check the tutorial's 2 nodes x 3 processes (ranks 0..5, each once) and other layouts.
    raise KataTodo("k01", 1, "global rank from node rank and local rank")


def world_size_of(nnodes: int, nproc_per_node: int) -> int:
    """How many processes a job of ``nnodes`` nodes with ``nproc_per_node`` each has."""
    # TODO: return how many processes the whole job runs (the tutorial's 2 x 3 runs 6).
    raise KataTodo("k01", 1, "world size from nodes and processes per node")


def greet(rank: int, world_size: int) -> str:
    """The tutorial's line for this process, for example ``world size:4. I'm rank 2.``"""
    # TODO: return (not print) the tutorial's line for this rank, character for character: the
    # tests compare greet(2, 4) with "world size:4. I'm rank 2." and greet(0, 1) likewise.
    raise KataTodo("k01", 2, "the greeting")


def run_rank(fn: Callable[[int, int], Any], rank: int, world_size: int, answers) -> None:
    """Run ``fn(rank, world_size)`` in this process and report the outcome on ``answers``."""
    # TODO: this runs in a child process, which cannot return a value to its parent: report the
    # outcome on `answers` instead, exactly one message per call. The tests expect
    # (rank, "ok", fn's answer) when fn returns, and (rank, "error", the full traceback text)
    # when fn raises; then run_rank returns normally (an error that escapes, or a message never
    # sent, leaves the launcher waiting for an answer that cannot come).
    raise KataTodo("k01", 3, "run one rank and report its answer")


def launch(world_size: int, fn: Callable[[int, int], Any] = greet, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world_size)`` on ``world_size`` spawned processes; answers in rank order."""
    # TODO: run run_rank for every rank in world_size processes that run side by side, and wait
    # for them. The tests hold launch to this:
    #   - each rank runs in a fresh process of its own made with the *spawn* start method, and the
    #     program's own start method is left as it was (set_start_method may run once per program);
    #   - it returns the answers in rank order, whatever order they arrive in;
    #   - it still works when answers are big (more than the 64 KiB a pipe holds);
    #   - when it returns or raises, every process it started has ended and been joined;
    #   - when ranks failed, it raises RankProcessFailed naming each failed rank (and no other)
    #     with its traceback; no answer waits longer than `timeout` seconds.
    raise KataTodo("k01", 4, "spawn, collect, join")


def print_greeting(rank: int, world_size: int) -> str:
    """What each process of the tutorial's program does: print its line (and return it)."""
    line = greet(rank, world_size)
    say(rank, line)
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The tutorial's run_multiprocess.py.")
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args(argv)
    lines = launch(args.world_size, print_greeting)
    say(None, f"{len(lines)} ranks answered and were joined; rank 0 said: {lines[0]!r}")
    return 0


if __name__ == "__main__":
    run_program(main)
