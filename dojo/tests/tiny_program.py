"""A program for ``test_program_runs.py`` and ``test_loopback.py``: ``python -m
dojo.tests.tiny_program ranks|raise|exit|interface``."""

from __future__ import annotations

import os
import sys

from dojo.launch import launch_world


def report(rank: int, world_size: int) -> int:
    print(f"rank {rank} of {world_size} sees DOJO_TEST_MARK={os.environ.get('DOJO_TEST_MARK')}")
    return rank


def main() -> None:
    what = sys.argv[1]
    if what == "ranks":
        print("ranks returned", launch_world(report, 2, backend="gloo", device="cpu"))
        print("a last line without its newline", end="")
    elif what == "raise":
        raise RuntimeError("the program failed")
    elif what == "exit":
        sys.exit("it exits with a message")
    elif what == "interface":  # what gloo would use in a group the program made itself
        print(f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}")


if __name__ == "__main__":
    main()
