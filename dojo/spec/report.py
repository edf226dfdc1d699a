"""What a learner sees of a failed kata test: the step, the message, and where in their own file.

pytest's own report shows the checking code's source, which floods the screen and gives every
diagnosis away. The plugin replaces it, for the learner's runs, with:

    step 3 · average every gradient over the ranks (tests/test_k04_allreduce.py:311)
    AssertionError: with 4 ranks: every rank holds the sum of the 4 ranks' gradients ...
    in your code:
      katas/k04_allreduce.py:92, in average_gradients
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

``pytest --tb=long`` (or ``--tb=short``, ``--solutions``) brings pytest's full report back.

``places`` finds the learner's own lines behind a failure for the runner's test log, wherever
the harness quoted them: a rank's traceback, the stacks of ranks stuck in a deadlock.
"""

from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass

import pytest

from dojo import curriculum
from dojo.curriculum import steps
from dojo.harness import culprit, known_errors
from dojo.harness.world import RankFailed, WorldFailure
from dojo.lang import t

_EXPLANATION_LINES = 12  # pytest's "assert a == b" diff: useful, but not at any length


def wanted(config: pytest.Config) -> bool:
    """The learner's runs: not the reference, and no traceback style asked for explicitly."""
    return not config.getoption("solutions") and config.option.tbstyle in ("auto", "no")


def compact(item: pytest.Item, excinfo: pytest.ExceptionInfo, kata: curriculum.Kata | None) -> str:
    lines = [_heading(item, kata)]
    message = said(excinfo).rstrip().splitlines()
    if len(message) > _EXPLANATION_LINES and not _is_world_report(excinfo):
        message = [*message[:_EXPLANATION_LINES], t("  ... (`pytest --tb=long` shows the rest)")]
    lines += message
    frames = _learner_frames(excinfo)
    if frames:
        lines.append(t("in your code (most recent call last):"))
        for path, line, function in frames[-3:]:
            source = linecache.getline(path, line).strip()
            lines.append("  " + str(Place(os.path.relpath(path, curriculum.ROOT), line, function)))
            if source:
                lines.append(f"    {source}")
    return "\n".join(lines)


def said(excinfo: pytest.ExceptionInfo) -> str:
    """The failure in the kata's words first: a check's own message; the harness's report; or
    an exception, said with whose code raised it (called how, where) and what it means."""
    error = excinfo.value
    if isinstance(error, WorldFailure):
        return str(error)  # "rank 2: ...", a deadlock's report: the harness's own words
    if isinstance(error, AssertionError):
        return excinfo.exconly()
    found = culprit.find(excinfo.tb)
    return known_errors.said(type(error).__name__, str(error), found)


def raw_reason(excinfo: pytest.ExceptionInfo) -> str | None:
    """Why a learner would meet this failure in words that are not the kata's, or None: the
    spec's own code crashed, torch's or gloo's text that nothing explains, or a check that
    states no expectation of its own (pytest's bare ``assert a == b``)."""
    error = excinfo.value
    if isinstance(error, RankFailed):
        return "a rank's error that no words of the kata explain" if error.raw else None
    if isinstance(error, WorldFailure):
        return None
    if isinstance(error, AssertionError):
        bare = str(error).startswith("assert ") or not str(error).strip()
        return "a check without a message written for the learner" if bare else None
    found = culprit.find(excinfo.tb)
    if known_errors.is_raw(type(error).__name__, str(error), found):
        return "an exception that no words of the kata explain"
    return None


def _heading(item: pytest.Item, kata: curriculum.Kata | None) -> str:
    path, line, _ = item.location
    where = f"{path}:{(line or 0) + 1}"
    marked = steps.of_test(item)
    if kata is None or not marked:
        return t("checked by {where}", where=where)
    try:
        title = kata.step(marked[0]).title
    except KeyError:
        return t("step {number} ({where})", number=marked[0], where=where)
    return t("step {number} · {title} ({where})", number=marked[0], title=title, where=where)


def _is_world_report(excinfo: pytest.ExceptionInfo) -> bool:
    """The harness's reports (a rank's traceback, stuck ranks' stacks) are already cut to size."""
    return type(excinfo.value).__module__ == "dojo.harness.world"


def _in_learners_file(path: str) -> bool:
    path = os.path.join(str(curriculum.ROOT), path)  # a path the harness shows relative to it
    return os.path.abspath(path).startswith(os.path.join(str(curriculum.ROOT), "katas") + os.sep)


def _learner_frames(excinfo: pytest.ExceptionInfo) -> list[tuple[str, int, str]]:
    """The frames of the learner's own file in this process's traceback (a rank's traceback is
    quoted, trimmed, in the harness's own message)."""
    return [
        (str(entry.path), entry.lineno + 1, entry.name)
        for entry in excinfo.traceback
        if _in_learners_file(str(entry.path))
    ]


@dataclass(frozen=True)
class Place:
    """A line of the learner's own code: ``katas/k04_allreduce.py:92, in average_gradients``."""

    file: str  # relative to the checkout
    line: int
    function: str

    def __str__(self) -> str:
        return where(self.file, self.line, self.function)


def where(file: str, line: int, function: str) -> str:
    """``FILE:LINE, in FUNCTION``, as a report names a line of code."""
    return t("{file}:{line}, in {function}", file=file, line=line, function=function)


# A frame as Python's tracebacks and the harness's stacks of stuck ranks show it.
_QUOTED_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def places(excinfo: pytest.ExceptionInfo) -> list[Place]:
    """The learner's own lines behind a failure, most recent call last: those of the first
    traceback or stack quoted in its messages that holds any (a rank's traceback, the stack of a
    deadlock's first stuck rank: the harness shows the ranks stuck in the learner's code first),
    else those of this process's own traceback."""
    for stack in _quoted_stacks(excinfo.value):
        mine = [place for place in stack if _in_learners_file(place.file)]
        if mine:
            return mine
    return [
        Place(os.path.relpath(path, curriculum.ROOT), line, function)
        for path, line, function in _learner_frames(excinfo)
    ]


def _quoted_stacks(error: BaseException) -> list[list[Place]]:
    """Each run of frames quoted in the messages of ``error`` and its causes, in order."""
    stacks, seen = [], set()
    while error is not None and id(error) not in seen and len(seen) < 10:
        seen.add(id(error))
        stack: list[Place] = []
        for text in str(error).splitlines():
            frame = _QUOTED_FRAME.match(text)
            if frame:
                path = frame["file"]
                if os.path.isabs(path):
                    path = os.path.relpath(path, curriculum.ROOT)
                stack.append(Place(path, int(frame["line"]), frame["function"]))
            elif stack and not text.startswith("    "):  # a frame's source line goes on
                stacks.append(stack)
                stack = []
        if stack:
            stacks.append(stack)
        error = error.__cause__ or error.__context__
    return stacks
