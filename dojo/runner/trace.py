"""``dojo trace kNN [ARGS]`` (a kata's program, traced) and ``dojo check kNN --trace DIR`` (its
tests, traced). The lessons' pictures are the maintainers' ``dojo dev timelines``."""

from __future__ import annotations

import os
import sys

from dojo import curriculum
from dojo.harness import timeline
from dojo.runner.term import foreground

DEFAULT_DIR = "traces"  # under the checkout (ignored by git)


def _folder(out: str | None, kata: curriculum.Kata) -> str:
    folder = os.path.abspath(out or os.path.join(curriculum.ROOT, DEFAULT_DIR, kata.id))
    os.makedirs(folder, exist_ok=True)
    return folder


def trace_program(
    kata: curriculum.Kata, solutions: bool, args: list[str], out: str | None = None
) -> int:
    """The kata's program with every world traced; the files' paths and how to open them.

    The program writes the files itself when its world ends and says where they are
    (``dojo.launch``): said once, by the program, beside its own output."""
    folder = _folder(out, kata)
    before = {p: os.path.getmtime(os.path.join(folder, p)) for p in os.listdir(folder)}
    package = "solutions" if solutions else "katas"
    os.environ[timeline.ENV_VAR] = folder  # the program and its ranks inherit it
    code = foreground([sys.executable, "-m", f"{package}.{kata.module}", *args], curriculum.ROOT)
    made = sorted(
        name
        for name in os.listdir(folder)
        if name.endswith(".png")
        and before.get(name) != os.path.getmtime(os.path.join(folder, name))
    )
    if not made and code == 0:  # the program said where each world's files are, if any ran
        print(f"\nno world ran, so nothing was traced into {_shown(folder)}/")
    return code


def check_traced(kata: curriculum.Kata, solutions: bool, out: str) -> int:
    """``dojo check kNN --trace DIR``: the kata's tests, every world they start traced."""
    from dojo.runner import learn

    folder = _folder(out, kata)
    os.environ[timeline.ENV_VAR] = folder
    try:
        return learn.check_command(kata, solutions)
    finally:
        written = timeline.write_pending(folder)
        if written:
            print("\n" + timeline.summary(written, folder))


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path
