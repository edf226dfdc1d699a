"""Which step of a kata a test is about: its ``@pytest.mark.step(N)``, recorded by ``testlog``.

A "not implemented yet: kNN step S" names its step itself (a test of step 3 may stop at an
unwritten step 2); any other failure belongs to the step its test is marked with.
"""

from __future__ import annotations

from dojo import curriculum
from dojo.todo import TODO_PATTERN  # "not implemented yet: k02 step 1 (...)"


def steps_of_failure(kata: curriculum.Kata, record: dict) -> set[int]:
    todo = TODO_PATTERN.search(record.get("text", ""))
    if todo and todo.group(1) == kata.id:
        return {int(todo.group(2))}
    return set(record.get("steps", ()))
