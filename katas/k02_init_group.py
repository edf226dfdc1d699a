"""k02 · Joining a process group: init_process_group over env://, a barrier, and destroy.

THE IDEA
    Processes that know their rank still cannot talk. ``dist.init_process_group`` makes them a
    *process group*: every rank connects to a rendezvous point, learns where its peers are, and
    from then on collectives (all_reduce, barrier, ...) work between them.

    With ``env://`` (the default init method, the tutorial's) the rendezvous point is read from
    the environment: rank 0 opens a small key-value store (a TCPStore) on MASTER_ADDR:MASTER_PORT,
    and every other rank connects to it.

           rank 0 ── opens the store on MASTER_ADDR:MASTER_PORT
           rank 1 ──┐
           rank 2 ──┼── connect to it, exchange addresses, then talk directly (gloo)
           rank 3 ──┘

    Pass a ``timeout``: gloo's default is 30 minutes, so a peer that never comes would freeze
    the others for half an hour. Before leaving, a ``dist.barrier()`` makes every rank wait
    until all of them have finished their work, and ``dist.destroy_process_group()`` releases
    the group's sockets and threads (forgetting it leaks them, and can abort the process when
    it exits).

    What a group opens, for as long as it lives: rank 0's store listens on MASTER_PORT on every
    interface of its machine, whatever MASTER_ADDR says (MASTER_ADDR only tells the others
    where to dial), and gloo listens on the address the host name resolves to. On a shared
    network (a cafe's, a conference's) anyone there can connect meanwhile, and what arrives is
    trusted: the store answers anyone, and ``all_gather_object`` unpickles what it receives,
    which can run code. On one machine keep the world on loopback: MASTER_ADDR=127.0.0.1, and
    GLOO_SOCKET_IFNAME=lo (lo0 on macOS) for gloo; the store's port stays open to the network
    unless a firewall drops incoming connections, or the store is handed a socket bound to
    127.0.0.1 (``TCPStore(..., master_listen_fd=...)``, as the tests' worlds do).

STEPS
    1. ``set_master``: put MASTER_ADDR and MASTER_PORT in ``os.environ`` (strings); refuse a
       port that is not an int from 1 to 65535 (the string "29500" too) with a ValueError that
       says so.
    2. ``init_process``, first half: ``dist.init_process_group(backend, rank=..., world_size=...,
       timeout=timedelta(seconds=timeout_s))``, called as ``dist.init_process_group``.
    3. ``init_process``, second half: run ``fn(rank, world_size)``, then ``dist.barrier()``, and
       destroy the group in a ``finally`` (also when ``fn`` raised); return fn's result.

WHAT THE TESTS CHECK
    The environment ``set_master`` writes; 4 ranks that each see their own rank and a world size
    of 4 on a gloo group made with your timeout; that no rank leaves before the slowest one has
    finished (the barrier); that the group is gone afterwards, even when fn raised; two worlds
    side by side on two ports that do not mix; and the program below.

RUN IT
    .venv/bin/python -m katas.k02_init_group --world-size 4      (the tutorial's multiprocess_comm.py;
    it starts its ranks with your k01 launch)
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dojo.console import run_program, say
from dojo.todo import KataTodo

from .k01_spawn import launch


def set_master(addr: str, port: int) -> None:
    """Point env:// rendezvous at ``addr:port``, where rank 0 will open the store."""
    # TODO: make env:// rendezvous find rank 0 at addr:port: after set_master('127.0.0.1', 29511)
    # the environment must hold MASTER_ADDR='127.0.0.1' and MASTER_PORT='29511'. A port that is
    # not an int from 1 to 65535 (0, 70000, -1, the str '29500') must raise a ValueError whose
    # message names that port, and leave the environment unchanged.
    raise KataTodo("k02", 1, "set MASTER_ADDR/MASTER_PORT")


def init_process(
    rank: int,
    world_size: int,
    fn: Callable[[int, int], Any],
    backend: str = "gloo",
    timeout_s: float = 30.0,
) -> Any:
    """Join the group as ``rank`` of ``world_size``, run ``fn(rank, world_size)``, wait, leave."""
    # TODO (step 2): join the default process group through env:// as rank `rank` of
    # `world_size`, on `backend`, giving up after timeout_s seconds (never gloo's 30 minutes). The
    # tests record your one call of dist.init_process_group (call it by that name) and check its
    # rank, world_size and timeout, and that two worlds on two ports do not mix.
    raise KataTodo("k02", 2, "init_process_group with a timeout")
    # TODO (step 3): return fn(rank, world_size)'s result, with the group gone afterwards. The
    # tests hold it to this: no rank leaves before the slowest rank's fn has finished; the group
    # is destroyed on every path, also when fn raises (and fn's error reaches the caller); and
    # when init_process_group itself fails, its own error is the one the caller sees.
    raise KataTodo("k02", 3, "run fn, barrier, destroy the group")


def print_identity(rank: int, world_size: int) -> str:
    """What each rank of the tutorial's program prints, from the group's point of view."""
    line = f"world size:{dist.get_world_size()}. I'm rank {dist.get_rank()}."
    say(rank, line)
    return line


def _rank_entry(rank: int, world_size: int, port: int) -> str:
    set_master("127.0.0.1", port)
    return init_process(rank, world_size, print_identity)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The tutorial's multiprocess_comm.py.")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--master-port", type=int, default=29500)
    args = parser.parse_args(argv)
    lines = launch(args.world_size, functools.partial(_rank_entry, port=args.master_port))
    say(None, f"{len(lines)} ranks joined a gloo group on port {args.master_port} and left it")
    return 0


if __name__ == "__main__":
    run_program(main)
