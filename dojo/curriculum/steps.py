"""What a step of a kata is, and how one is found: every reader of a step number asks here.

A step is a number of a kata's curriculum (``kNN_topic.toml``); the stub raises
``KataTodo(kata, step, what)`` (``dojo.todo``) in each function of a step until the learner has
written it, and each spec test says which step it checks. A step is found:

* in a failure (``find_todo``): the ``KataTodo`` itself, one in its chain of causes, or one named
  in the text of another process (a process k01-k03 start, a program's stderr). That one is
  ``dojo.todo``'s own, beside the text it reads back: it is kata API (k16's program reads its
  workers' todos with it), and kata files import nothing else of dojo;
* in a kata's source (``raised``, ``first_unwritten``): the todos it still raises, read with
  ``ast``, each with the functions around it;
* on a test (``of_test``, ``of_any_case``): its ``@pytest.mark.step(N)``, on the function or on a
  ``pytest.param``;
* for a failure (``of_failure``): a todo names its own step (a test of step 3 may stop at an
  unwritten step 2); any other failure belongs to the steps its test is marked with.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

from dojo.todo import KataTodo
from dojo.todo import find_todo as find_todo  # this module's answer for a failure (see above)

# ------------------------------------------------------------------------------- in a source


@dataclass(frozen=True)
class Raised:
    """A ``KataTodo(kata, step, what)`` in a kata's source."""

    kata: str
    step: int
    what: str
    line: int
    within: tuple[str, ...]  # the classes and functions around it, outermost first
    function: str  # the outermost function around it, with its classes: "OverlappingDDP.forward"


def raised(source: str) -> list[Raised]:
    """Every todo a kata's source raises, in source order: those whose kata and step are written
    as they are in the stubs (``KataTodo("k04", 3, "...")``). SyntaxError where it does not parse."""
    found: list[Raised] = []

    def visit(node: ast.AST, within: tuple[str, ...], function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            within = (*within, node.name)
            if not function and not isinstance(node, ast.ClassDef):
                function = ".".join(within)
        elif is_todo_call(node):
            todo = _literal_todo(node)
            if todo is not None:
                found.append(Raised(*todo, node.lineno, within, function))
        for child in ast.iter_child_nodes(node):
            visit(child, within, function)

    visit(ast.parse(source), (), "")
    return found


def first_unwritten(source: str, kata: str) -> Raised | None:
    """The lowest step of ``kata`` whose todo the source still raises (SyntaxError as ``raised``)."""
    mine = [todo for todo in raised(source) if todo.kata == kata]
    return min(mine, key=lambda todo: (todo.step, todo.line)) if mine else None


def is_todo_call(node: ast.AST) -> bool:
    """Whether ``node`` is a call of ``KataTodo(...)`` (however its arguments are written)."""
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "KataTodo"


def _literal_todo(call: ast.Call) -> tuple[str, int, str] | None:
    values = dict(zip(("kata", "step", "what"), call.args))
    values.update({k.arg: k.value for k in call.keywords if k.arg in ("kata", "step", "what")})
    kata, step, what = (
        getattr(values.get(name), "value", None) for name in ("kata", "step", "what")
    )
    if not isinstance(kata, str) or not isinstance(step, int) or isinstance(step, bool):
        return None
    return kata, step, what if isinstance(what, str) else ""


# ------------------------------------------------------------------------------- on a test


def of_test(node) -> list[int]:
    """The steps a test checks: its ``@pytest.mark.step(N)``, on the function (its class, its
    module) or on the ``pytest.param`` of this case (pytest gives a case its parameter's marks)."""
    return sorted({int(mark.args[0]) for mark in node.iter_markers("step") if mark.args})


def of_any_case(definition) -> list[int]:
    """The steps that any case of a test function checks, before pytest makes its cases (what
    ``pytest_generate_tests`` sees): its own marker and those of its ``pytest.param`` values."""
    found = set(of_test(definition))
    for mark in definition.iter_markers("parametrize"):
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs.get("argvalues", ())
        for value in values:
            found |= {
                int(inner.args[0])
                for inner in getattr(value, "marks", ())
                if inner.name == "step" and inner.args
            }
    return sorted(found)


# ------------------------------------------------------------------------------- for a failure


def of_failure(kata: str, todo: KataTodo | None, marked: Iterable[int]) -> set[int]:
    """The steps a failure of one of ``kata``'s tests is about: the step its todo names, when it
    is the kata's own; else those its test is marked with (another kata's todo, a kata whose
    code this one reuses, says nothing about this kata's steps)."""
    if todo is not None and todo.kata == kata:
        return {todo.step}
    return set(marked)
