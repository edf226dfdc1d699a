"""``dojo solution``: the reference for a kata, or its diff against the learner's file.

Before the kata passes it asks first: reading the answer too early takes the learning away.
"""

from __future__ import annotations

import difflib

from dojo import curriculum
from dojo.commands import dojo
from dojo.curriculum import stubs
from dojo.runner import progress
from dojo.runner.term import ask, paint


def show(kata: curriculum.Kata, diff: bool = False, yes: bool = False) -> int:
    if not kata.solution_file.exists():
        print(f"dojo: solutions/{kata.module}.py is not in this checkout")
        return 2
    if not progress.load().is_done(kata) and not ask(
        f"{kata.id} does not pass yet: seeing the reference now gives the answer away. Show it anyway?",
        yes,
    ):
        print(f"Not shown. `{dojo()} hint {kata.id}` gives a nudge instead.")
        return 1
    reference = stubs.solved(kata)  # the code, without the markers the stubs are made from
    if not diff:
        print(paint(f"# solutions/{kata.module}.py", "bold"))
        print(reference, end="" if reference.endswith("\n") else "\n")
        return 0
    mine = kata.kata_file.read_text(encoding="utf-8") if kata.kata_file.exists() else ""
    lines = list(
        difflib.unified_diff(
            mine.splitlines(keepends=True),
            reference.splitlines(keepends=True),
            fromfile=f"katas/{kata.module}.py (yours)",
            tofile=f"solutions/{kata.module}.py (reference)",
        )
    )
    if not lines:
        print(f"katas/{kata.module}.py is the same as the reference.")
        return 0
    for line in lines:
        line = line if line.endswith("\n") else line + "\n"
        style = (
            ("green",)
            if line.startswith("+")
            else ("red",)
            if line.startswith("-")
            else ("cyan",)
            if line.startswith("@@")
            else ()
        )
        print(paint(line.rstrip("\n"), *style))
    return 0
