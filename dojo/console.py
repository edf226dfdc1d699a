"""Output for the katas' programs: whole rank-prefixed lines, and a clean exit on every path.

Several processes writing to one terminal interleave mid-line when they print in pieces. ``say``
writes each line with a single ``os.write`` of the whole line, which the OS never splits for
lines shorter than PIPE_BUF (4 KiB), so lines from different ranks stay whole.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from dojo.impl import apply_substitutions
from dojo.todo import find_todo

EXIT_TODO = 3  # the program ran into a step the learner has not written yet
EXIT_INTERRUPTED = 130


def say(rank: int | None, *parts: object) -> None:
    """Print one line, prefixed with ``[rank N]`` (``[main]`` for the launching process)."""
    prefix = "[main]" if rank is None else f"[rank {rank}]"
    text = " ".join(str(p) for p in parts)
    data = "".join(f"{prefix} {line}\n" for line in text.splitlines() or [""])
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), data.encode())


def run_program(
    main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None
) -> None:
    """Run a kata's ``main`` as a program and exit with its status.

    A step that is not written yet ends the program with one line that says which, not a
    traceback; Ctrl-C ends it quietly (the launcher has already stopped its processes).
    """
    apply_substitutions(sys.modules.get(main.__module__))  # maintainers' mistakes catalogues only
    try:
        code = main(argv)
    except Exception as error:  # a todo may come back from a rank inside another error
        todo = find_todo(error)
        if todo is None:
            raise
        print(f"{todo}: write that step in the kata's file, then run this again.", file=sys.stderr)
        code = EXIT_TODO
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    sys.exit(code or 0)
