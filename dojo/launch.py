"""The launcher behind the katas' programs (``python -m solutions.k04_allreduce`` and on).

Katas 01-03 teach how to start ranks by hand; from kata 04 on a program hands its per-rank
function to ``launch_world``, which uses the same machinery as the test harness: ranks forked
from a warm forkserver, a rendezvous store the launcher owns (no port to collide), the store
and the ranks' gloo on loopback only (nothing outside the machine reaches them), every failure
named by rank, and every process stopped on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from dojo.devices import BACKENDS, DEVICES, choose_for_this_machine
from dojo.harness.world import WorldFailure, run_world

# A program whose ranks make no progress for this long says which ranks wait where, and keeps
# waiting. Tests of programs set DOJO_HANG_REPORT_S lower and DOJO_HANG_FAILS=1: a hung program
# then ends at once with that report, as the unit tests' deadlock reports do.
HANG_REPORT_S = 15.0


class LaunchFailed(RuntimeError):
    """A rank of a program's world failed; the message names it and shows why."""


def add_launch_arguments(parser: argparse.ArgumentParser, world_size: int = 4) -> None:
    parser.add_argument(
        "--world-size", type=int, default=world_size, help=f"how many ranks (default {world_size})"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="default: nccl when there is one GPU per rank, else gloo",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="default: cuda when there is one GPU per rank, else cpu",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        action=_TraceTo,
        help="record every rank's torch.distributed calls; write DIR/NAME.json (Perfetto, "
        "chrome://tracing) and DIR/NAME.png (a timeline) when the world ends",
    )


class _TraceTo(argparse.Action):
    """``--trace DIR``: every world this program launches is traced into DIR."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        os.makedirs(value, exist_ok=True)
        os.environ["DOJO_TRACE_DIR"] = os.path.abspath(value)
        setattr(namespace, self.dest, value)


def launch_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    device: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks in a fresh process group.

    Inside a rank, ``dojo.devices.rank_device()`` is the rank's device. Returns every rank's
    result in rank order; raises ``LaunchFailed`` naming the rank that failed.
    """
    if world_size < 1:
        raise LaunchFailed(f"--world-size must be at least 1, got {world_size}")
    backend, device = choose_for_this_machine(world_size, backend, device)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    traced = os.environ.get("DOJO_TRACE_DIR")
    try:
        return run_world(
            fn,
            world_size,
            *args,
            deadline=None,
            straggler=None,
            backend=backend,
            env={"DOJO_DEVICE": device},
            capture_output=False,
            threads=threads,
            hang_report=float(os.environ.get("DOJO_HANG_REPORT_S") or HANG_REPORT_S),
            hang_fails=os.environ.get("DOJO_HANG_FAILS") == "1",
            **kwargs,
        )
    except WorldFailure as failure:
        raise LaunchFailed(str(failure)) from None
    finally:
        if traced:
            _write_trace(traced)


def _write_trace(folder: str) -> None:
    """The world just ended: its timeline as JSON and PNG, and where they are (not for a step
    that is not written yet: the program says that, and a half-run world shows nothing)."""
    import sys

    from dojo.console import say
    from dojo.harness import timeline
    from dojo.todo import find_todo

    error = sys.exc_info()[1]
    if error is not None and (find_todo(error) is not None or isinstance(error, KeyboardInterrupt)):
        timeline.discard_pending(folder, mine=True)
        return
    written = timeline.write_pending(folder, mine=True)
    if written:
        say(None, timeline.how_to_open(written))
