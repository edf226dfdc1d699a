"""Which step of a kata a failing test is about.

A "not implemented yet: kNN step S" says so itself. Any other failure is tied to the kata
functions it exercises: a step's functions are those whose stub body raises that step's
``KataTodo`` (read from the pristine stub, since the learner's copy has lost its todos), found in
the test's source (and its helpers') and in the failure's text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dojo import curriculum
from dojo.reset import pristine_file
from dojo.todo import TODO_PATTERN  # "not implemented yet: k02 step 1 (...)"


def step_functions(kata: curriculum.Kata) -> dict[str, int]:
    """Function name -> the step its stub body belongs to (the lowest, if it raises several)."""
    source = pristine_file(kata) if pristine_file(kata).exists() else kata.kata_file
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    steps: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "KataTodo":
                    values = [a.value for a in inner.args[:2] if isinstance(a, ast.Constant)]
                    if len(values) == 2 and isinstance(values[1], int):
                        steps[node.name] = min(values[1], steps.get(node.name, values[1]))
    return steps


def steps_of_failure(kata: curriculum.Kata, record: dict, steps_of: dict[str, int]) -> set[int]:
    todo = TODO_PATTERN.search(record["text"])
    if todo and todo.group(1) == kata.id:
        return {int(todo.group(2))}
    text = record["text"] + "\n" + _test_source(curriculum.ROOT / record["test"].split("::")[0], record["test"])
    return {step for name, step in steps_of.items() if re.search(rf"\.{name}\b|\b{name}\(", text)}


def _test_source(test_file: Path, nodeid: str) -> str:
    """The test function's source, and that of the module's helpers it names (one level)."""
    name = re.sub(r"\[.*\]$", "", nodeid.split("::")[-1])
    try:
        text = test_file.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return ""
    functions = {
        n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    if name not in functions:
        return ""
    own = ast.get_source_segment(text, functions[name]) or ""
    named = {n.id for n in ast.walk(functions[name]) if isinstance(n, ast.Name)}
    helpers = [ast.get_source_segment(text, functions[h]) or "" for h in sorted(named) if h in functions and h != name]
    return "\n".join([own, *helpers])
