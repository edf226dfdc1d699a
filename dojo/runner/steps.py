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


def coverage_problems(kata: curriculum.Kata, collected: list[dict]) -> list[str]:
    """From a ``--collect-only`` log of the kata's spec: tests without a step (or with one the
    kata lacks), and steps that no test checks."""
    known = {step.number for step in kata.steps}
    problems, checked = [], set()
    for record in collected:
        steps = set(record.get("steps", ()))
        name = record["test"].split("::", 1)[-1]
        if len(steps) != 1:
            problems.append(
                f"{kata.id}: {name} says which step it checks with exactly one @pytest.mark.step(N), "
                f"it has {sorted(steps) or 'none'}"
            )
        elif not steps <= known:
            problems.append(
                f"{kata.id}: {name} is marked step {min(steps)}, which the curriculum lacks"
            )
        checked |= steps
    for number in sorted(known - checked):
        problems.append(f"{kata.id}: no test checks step {number} ({kata.step(number).title})")
    return problems
