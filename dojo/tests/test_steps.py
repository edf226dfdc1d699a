"""``dojo.curriculum.steps``, the one module that says what a step is and where one is found: in a
failure, in a kata's source, on a test, for a failure. In-process, on sources and tests made here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dojo.curriculum import ROOT, steps
from dojo.todo import KataTodo


def test_a_todo_is_found_itself_in_a_cause_chain_or_in_another_processs_text():
    todo = KataTodo("k04", 3, "average every gradient over the ranks")
    assert steps.find_todo(todo) is todo
    try:
        try:
            raise todo
        except KataTodo as error:
            raise AssertionError("the spec's own words") from error
    except AssertionError as wrapped:
        assert steps.find_todo(wrapped) is todo, "a todo behind the spec's own error"
    stderr = f"Traceback (most recent call last):\n  ...\ndojo.todo.KataTodo: {todo}\n"
    found = steps.find_todo(RuntimeError(stderr))
    assert (found.kata, found.step, found.what) == ("k04", 3, todo.what), (
        "a todo another process printed comes back whole, what it says included"
    )
    bare = steps.find_todo(RuntimeError(str(KataTodo("k02", 1))))
    assert (bare.kata, bare.step, bare.what) == ("k02", 1, ""), "a todo that says nothing more"
    assert steps.find_todo(ValueError("step 3 failed")) is None


STUB = """
from dojo.todo import KataTodo


def first():
    raise KataTodo("k05", 1, "give every replica rank 0's weights")


class Replica:
    def step(self):
        def inner():
            raise KataTodo("k05", 3, what="one data-parallel training step")

        return inner()


def later(kata="k05"):
    raise KataTodo(kata, 2, "not a literal kata: not counted")
    raise KataTodo("k04", 2, "another kata's")
"""


def test_a_sources_todos_are_read_with_the_functions_around_them():
    found = steps.raised(STUB)
    assert [(t.kata, t.step, t.what) for t in found] == [
        ("k05", 1, "give every replica rank 0's weights"),
        ("k05", 3, "one data-parallel training step"),
        ("k04", 2, "another kata's"),
    ], found
    assert found[1].within == ("Replica", "step", "inner") and found[1].function == "Replica.step"
    assert found[0].function == "first" and found[0].line == 6
    first = steps.first_unwritten(STUB, "k05")
    assert (first.step, first.what) == (1, "give every replica rank 0's weights")
    assert steps.first_unwritten(STUB, "k09") is None
    with pytest.raises(SyntaxError):
        steps.raised("def broken(:\n")


def test_every_shipped_stub_raises_a_todo_for_exactly_its_steps():
    from dojo import curriculum
    from dojo.curriculum import stubs

    for kata in curriculum.katas():
        raised = steps.raised(stubs.stub(kata))
        assert {t.step for t in raised} == {s.number for s in kata.steps}, kata.id
        assert {t.kata for t in raised} == {kata.id}, kata.id


SPEC = """
import pytest


@pytest.mark.step(2)
def test_marked():
    pass


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.step(3))])
@pytest.mark.step(1)
def test_cases(n):
    pass


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.step(4))])
def test_only_in_a_param(n):
    pass
"""

PLUGIN = """
from dojo.curriculum import steps


def pytest_generate_tests(metafunc):
    print("ANY", metafunc.function.__name__, steps.of_any_case(metafunc.definition))


def pytest_collection_modifyitems(items):
    for item in items:
        print("TEST", item.name, steps.of_test(item))
"""


def test_a_tests_steps_come_from_its_marker_and_its_parameters_marks(tmp_path):
    (tmp_path / "test_spec.py").write_text(textwrap.dedent(SPEC))
    (tmp_path / "steps_probe.py").write_text(textwrap.dedent(PLUGIN))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-s", "-p", "steps_probe",
         "-p", "no:cacheprovider", "-c", "/dev/null", str(tmp_path / "test_spec.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    said = {line for line in done.stdout.splitlines() if line.startswith(("ANY", "TEST"))}
    assert said >= {
        "ANY test_marked [2]",
        "ANY test_cases [1, 3]",
        "ANY test_only_in_a_param [4]",
        "TEST test_marked [2]",
        "TEST test_cases[1] [1]",
        "TEST test_cases[2] [1, 3]",
        "TEST test_only_in_a_param[1] [4]",
    }, done.stdout + done.stderr


def test_a_failure_belongs_to_its_own_katas_todo_or_else_to_its_tests_marker():
    assert steps.of_failure("k01", KataTodo("k01", 2, "the greeting"), [4]) == {2}, (
        "an unwritten step names itself, whichever test ran into it"
    )
    assert steps.of_failure("k01", None, [4]) == {4}, "a real failure: the test's marker"
    assert steps.of_failure("k02", KataTodo("k01", 4), [3]) == {3}, (
        "another kata's todo says nothing about this kata's steps"
    )
