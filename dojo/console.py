"""Output for the katas' programs: whole rank-prefixed lines, a verdict on the result, and a
clean exit on every path.

Several processes writing to one terminal interleave mid-line when they print in pieces. ``say``
writes each line with a single ``os.write`` of the whole line, which the OS never splits for
lines shorter than PIPE_BUF (4 KiB), so lines from different ranks stay whole.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from dojo.commands import dojo
from dojo.curriculum import steps
from dojo.harness import impl
from dojo.todo import KataTodo

EXIT_TODO = 3  # the program ran into a step the learner has not written yet
EXIT_INTERRUPTED = 130


def say(rank: int | None, *parts: object) -> None:
    """Print one line, prefixed with ``[rank N]`` (``[main]`` for the launching process)."""
    prefix = "[main]" if rank is None else f"[rank {rank}]"
    text = " ".join(str(p) for p in parts)
    data = "".join(f"{prefix} {line}\n" for line in text.splitlines() or [""])
    try:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), data.encode())
    except BrokenPipeError:  # `python -m katas.k04_allreduce | head`: the reader has gone
        pass


def verdict(gap: float, agree: str, differ: str, tolerance: float = 1e-4) -> int:
    """A program's last line on its largest gap to the expected result, and its exit status:
    ``agree`` and the gap when it is below ``tolerance`` (0), else ``differ`` by how much (1)."""
    agrees = gap < tolerance  # a NaN gap never agrees
    say(None, f"{agree} (largest gap {gap:.1e})" if agrees else f"{differ} by up to {gap:.1e}")
    return 0 if agrees else 1


def run_program(
    main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None
) -> None:
    """Run a kata's ``main`` as a program and exit with its status.

    A step that is not written yet ends the program with one line that says which (and which
    step to write first, when earlier ones are missing too), not a traceback; a failed rank ends
    it with the launcher's report; Ctrl-C ends it quietly (the launcher has already said where
    each rank was, and stopped them).
    """
    module = sys.modules.get(main.__module__)
    impl.on_kata(module)  # the maintainers' instruments, when a run names them
    try:
        code = main(argv)
    except Exception as error:  # a todo may come back from a rank inside another error
        todo = steps.find_todo(error)
        if todo is not None:
            print(_todo_message(todo, getattr(module, "__file__", None)), file=sys.stderr)
            code = EXIT_TODO
        elif type(error).__name__ == "LaunchFailed":  # dojo.launch's: its message is the report
            print(str(error), file=sys.stderr)
            code = 1
        else:
            raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    sys.exit(code or 0)


def _todo_message(todo: KataTodo, path: str | None) -> str:
    """The todo the program ran into, and the first step still unwritten in the kata's file."""
    message = f"{todo}: write that step in the kata's file, then run this again."
    first = _first_unwritten(path, todo.kata)
    if first is not None and first.step < todo.step:
        shown = os.path.relpath(path) if path else "the kata's file"
        what = f" ({first.what})" if first.what else ""
        message += (
            f"\nThe program reached step {todo.step} first, but {shown} still has step {first.step}{what} "
            f"to write: start there (`{dojo()} hint {todo.kata}` helps)."
        )
    return message


def _first_unwritten(path: str | None, kata: str) -> steps.Raised | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as source:
            return steps.first_unwritten(source.read(), kata)
    except (OSError, SyntaxError):
        return None
