"""The pytest plugin: which implementation is tested, fixtures, and reports a learner can read.

* ``pytest`` tests the learner's ``katas/``; ``pytest --solutions`` tests ``solutions/`` (it sets
  ``DOJO_IMPL=solutions``, which rank processes inherit).
* ``pytest --dojo-trace DIR`` traces every world the tests start (``dojo.harness.timeline``): a JSON
  trace and a PNG timeline per world, named by test.
* ``pytest --expect-todo`` is the maintainer's check that the shipped stubs fail: a test passes
  only when it fails with "not implemented yet", and fails if the stub passes or crashes.
* A ``KataTodo`` anywhere (in the test, in a rank, in a process the learner started) is
  reported as one line: ``not implemented yet: k02 step 1 (...)``.
"""

from __future__ import annotations

import os
import re

import pytest

from dojo import curriculum
from dojo.commands import dojo
from dojo.curriculum.steps import find_todo
from dojo.harness import impl
from dojo.harness.world import run_world
from dojo.lang import t
from dojo.spec.report import compact
from dojo.spec.report import wanted as report_for_learners


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dojo", "torch-dist-katas")
    group.addoption(
        "--solutions",
        action="store_true",
        help="test the reference solutions/ instead of your katas/ (same as DOJO_IMPL=solutions)",
    )
    group.addoption(
        "--expect-todo",
        action="store_true",
        help="maintainers: pass only the tests that fail with 'not implemented yet' (proves the stubs fail)",
    )
    group.addoption(
        "--dojo-trace",
        metavar="DIR",
        help="record every rank's torch.distributed calls of every world: DIR/TEST.json "
        "(https://ui.perfetto.dev, chrome://tracing) and DIR/TEST.png (a timeline)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("solutions"):
        os.environ[impl.ENV_VAR] = "solutions"
    impl.current()  # a bad DOJO_IMPL stops the run here, with a message that says how to fix it
    if config.getoption("dojo_trace"):  # run_world reads it (xdist workers configure too)
        os.makedirs(config.getoption("dojo_trace"), exist_ok=True)
        os.environ["DOJO_TRACE_DIR"] = os.path.abspath(config.getoption("dojo_trace"))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    folder = config.getoption("dojo_trace")
    if not folder or hasattr(config, "workerinput"):  # the xdist controller writes them all
        return
    from dojo.harness import timeline

    written = timeline.write_pending(os.path.abspath(folder))
    terminalreporter.write_line("dojo: " + timeline.summary(written, folder))


def pytest_report_header(config: pytest.Config) -> str:
    return f"dojo: testing {impl.current()}/ (DOJO_IMPL={impl.current()})"


_KATA_FILE = re.compile(r"test_(k\d\d_\w+)\.py$")


@pytest.fixture
def kata(request: pytest.FixtureRequest):
    """The module under test for this test file: katas.kNN_x, or solutions.kNN_x with --solutions."""
    match = _KATA_FILE.search(os.path.basename(str(request.node.path)))
    if not match:
        raise RuntimeError(
            f"the kata fixture works in tests/test_kNN_topic.py files, not in {request.node.path}"
        )
    return impl.load_kata(match.group(1))


class World:
    """The ``world`` fixture: ``world.run(fn, 4)`` runs ``fn(rank, 4)`` on a fresh 4-rank world."""

    def run(self, fn, world_size: int, *args, **options):
        return run_world(fn, world_size, *args, **options)


@pytest.fixture
def world() -> World:
    return World()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where this plugin writes a kata test's failure report itself (a learner's run, the stubs'
    check), pytest's own is thrown away: skip making it (it parses the test file's source for
    every frame, a tenth of a catalogue's time)."""
    if report_for_learners(config) or config.getoption("expect_todo"):
        for item in items:
            if _kata_of(item) is not None:
                item.repr_failure = _replaced_below


def _replaced_below(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.exconly()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    # A todo is a kata spec's business; the tooling's own tests may quote one in their output.
    todo = find_todo(call.excinfo.value) if call.excinfo is not None and _kata_of(item) else None
    if item.config.getoption("expect_todo"):
        _expect_todo(report, call, todo)
    elif todo is not None:
        report.longrepr = _todo_report(todo)
    elif report.failed and call.excinfo is not None and report_for_learners(item.config):
        kata = _kata_of(item)
        if kata is not None:
            report.longrepr = compact(item, call.excinfo, kata)


def _kata_of(item: pytest.Item) -> curriculum.Kata | None:
    match = _KATA_FILE.search(os.path.basename(str(item.path)))
    if not match or os.path.basename(os.path.dirname(str(item.path))) != "tests":
        return None
    try:
        return curriculum.find(match.group(1))
    except KeyError:
        return None


def _todo_report(todo) -> str:
    """One line for the todo, where to write it, and the step's first (gentlest) hint, in the
    learner's language (the runner renders its own from the test log's record of the todo)."""
    try:
        kata = curriculum.find(todo.kata)
        step = kata.step(todo.step)
    except KeyError:
        return f"{todo}\n  -> write {todo.kata} step {todo.step} in katas/"
    lines = [
        # TRANSLATORS: {todo} is the todo's English ("not implemented yet: k01 step 2 (what)"),
        # which a translation says with {kata}, {step} and {title} (the step's title in it)
        t("{todo}", todo=todo, kata=todo.kata, step=todo.step, title=step.title),
        t(
            "  -> write step {step} in {file} (its lesson explains it)",
            step=todo.step,
            file=f"katas/{kata.module}.py",
        ),
    ]
    if step.hints:
        lines.append(
            t(
                "  hint: {hint}  (more: {more})",
                hint=step.hints[0],
                more=f"{dojo()} hint {todo.kata}",
            )
        )
    return "\n".join(lines)


def _expect_todo(report, call: pytest.CallInfo, todo) -> None:
    if report.skipped:
        return
    if todo is not None:
        report.outcome = "passed"
        report.longrepr = None
    elif call.excinfo is None:
        report.outcome = "failed"
        report.longrepr = (
            "the shipped stub PASSED this test: a test that passes before the learner has written "
            "anything proves nothing (make the stub raise KataTodo, or the test stricter)"
        )
    else:
        report.outcome = "failed"
        report.longrepr = (
            "the shipped stub failed this test, but not with 'not implemented yet':\n"
            f"{call.excinfo.exconly()}"
        )
