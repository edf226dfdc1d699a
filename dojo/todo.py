"""The error every kata stub raises until the learner has written that step."""

from __future__ import annotations

import re

# What a KataTodo says, wherever its text ends up (a rank's traceback, a program's stderr).
TODO_PATTERN = re.compile(r"not implemented yet: (k\d\d) step (\d+)(?: \(([^)\n]*)\))?")


class KataTodo(Exception):
    """A step of a kata that the learner has not written yet.

    ``raise KataTodo("k02", 1, "set MASTER_ADDR/MASTER_PORT")`` reads as
    ``not implemented yet: k02 step 1 (set MASTER_ADDR/MASTER_PORT)``; the pytest plugin
    reports it as that one line instead of a crash.
    """

    def __init__(self, kata: str, step: int, what: str = ""):
        self.kata, self.step, self.what = kata, int(step), what
        text = f"not implemented yet: {kata} step {step}"
        super().__init__(f"{text} ({what})" if what else text)

    def __reduce__(self):  # travels intact from a rank process to the parent
        return (KataTodo, (self.kata, self.step, self.what))


def find_todo(error: BaseException | None) -> KataTodo | None:
    """The KataTodo behind ``error``: itself, one in its cause chain, or one named in its text.

    The text fallback catches a todo raised in a process the learner started (k01-k03), which
    reaches the test only as another process's traceback.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, KataTodo):
            return error
        match = TODO_PATTERN.search(str(error))
        if match:
            return KataTodo(match.group(1), int(match.group(2)), match.group(3) or "")
        error = error.__cause__ or error.__context__
    return None
