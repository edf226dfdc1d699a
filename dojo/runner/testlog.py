"""A pytest plugin for the runner (``pytest -p dojo.runner.testlog``): each test's outcome, one JSON line
per report, in the file named by ``DOJO_TEST_LOG``. The runner reads the outcomes from there
instead of parsing pytest's output, and renders them for the learner (``dojo.runner.runs``).

A record keeps what a failure is, not only how it reads:

    {"test": "tests/test_k04_allreduce.py::test_x[4]", "when": "call", "outcome": "failed",
     "steps": [3],                  # the steps the test checks (its step marker)
     "message": "...",              # the exception, whole
     "text": "...",                 # the failure as the learner's report shows it (its end)
     "todo": {"kata": "k04", "step": 3, "what": "..."},      # a step not written yet
     "rank": 2,                     # the rank that raised, where the harness knows it
     "deadlock": true,              # the harness's deadlock report, raised or quoted
     "where": [{"file": "katas/k04_allreduce.py", "line": 92, "function": "average_gradients"}]}

``where`` holds the learner's own lines, most recent call last (``dojo.spec.report.places``).
``text`` is the dojo plugin's own report where it wrote one (a learner's runs: ``--tb=no``),
else pytest's short traceback, whatever ``--tb`` says. With ``--collect-only`` the log lists
every collected test and its steps (``dojo dev check`` proves with it that every test has a step
and every step a test). Ctrl-C ends the log with an "interrupted" record: the test that was
running, and where its ranks waited.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from dojo.curriculum import steps
from dojo.harness.world import deadlock_report
from dojo.spec import report as learners_report
from dojo.todo import KataTodo

ENV_VAR = "DOJO_TEST_LOG"
# Set by the runner: the session stops after the first deadlock (the tests after it would most
# likely wait for the same one); the log then ends with a "session" record saying how many did
# not run.
STOP_VAR = "DOJO_STOP_AT_DEADLOCK"
_TEXT_LIMIT = 6000  # a failure's tail: the message, and where it failed

_running = ""  # the test that runs now: what Ctrl-C interrupted
_ctrl_c = False  # the session ended at Ctrl-C, not at a stop of its own (the first deadlock)


def todo_of(record: dict) -> KataTodo | None:
    """The todo a failure's record holds (a step not written yet), or None."""
    todo = record.get("todo")
    return KataTodo(todo["kata"], todo["step"], todo.get("what", "")) if todo else None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and hasattr(reporter, "_report_keyboardinterrupt"):
        reporter._report_keyboardinterrupt = lambda: _quiet_after_interrupt(reporter)


def _quiet_after_interrupt(reporter) -> None:
    """Ctrl-C: the runner says it was interrupted, where the ranks waited, and shows the failures
    found so far. pytest's banner and the traceback of where the interrupt landed would bury them,
    and its count ("11 passed", in green) would read as if the kata passed."""
    if _ctrl_c:
        reporter.summary_stats = lambda: None


def _write(record: dict) -> None:
    path = os.environ.get(ENV_VAR)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        for item in session.items:
            _write(
                {
                    "test": item.nodeid,
                    "when": "collect",
                    "outcome": "collected",
                    "steps": steps.of_test(item),
                }
            )


def pytest_runtest_logstart(nodeid: str) -> None:
    global _running
    _running = nodeid


# Outermost: the dojo plugin has written its own report of the failure by the time this reads it.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    report.dojo_steps = steps.of_test(item)
    if call.excinfo is None or not report.failed:
        return
    report.dojo_failure = _failure(call.excinfo)
    report.dojo_failure["text"] = _text(item, call, report)
    if (
        call.when == "call"
        and report.dojo_failure.get("deadlock")
        and os.environ.get(STOP_VAR) == "1"
    ):
        items = item.session.items
        left = len(items) - items.index(item) - 1 if item in items else 0
        if left:
            item.session.shouldstop = "dojo: stopped after the first deadlock"
            _write({"test": "", "when": "session", "outcome": "stopped", "left": left})


def _failure(excinfo: pytest.ExceptionInfo) -> dict:
    """What a failure is: a todo (kata, step, what), or the message, the failing rank, whether
    it is a deadlock, and the learner's own lines."""
    found: dict = {"message": excinfo.exconly().strip()[:_TEXT_LIMIT]}
    todo = steps.find_todo(excinfo.value)
    if todo is not None:
        found["todo"] = {"kata": todo.kata, "step": todo.step, "what": todo.what}
        return found
    for error in _chain(excinfo.value):
        if type(error).__name__ == "RankFailed" and isinstance(getattr(error, "rank", None), int):
            found.setdefault("rank", error.rank)
        # the harness's report: raised as it is, quoted by a spec's own message (which says what
        # hung), or that of a program under test that hung (dojo.spec.testing's)
        if type(error).__name__ == "WorldDeadlock" or deadlock_report(str(error)) is not None:
            found["deadlock"] = True
    places = learners_report.places(excinfo)
    if places:
        found["where"] = [asdict(place) for place in places]
    return found


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """An exception and its causes (ten at most: not for ever)."""
    for _ in range(10):
        if error is None:
            return
        yield error
        error = error.__cause__ or error.__context__


def _text(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> str:
    """The failure as the learner's report shows it: the dojo plugin's own (a todo, the learner's
    short form) or pytest's with ``--tb=short``; else pytest's short traceback, made here."""
    if isinstance(report.longrepr, str) or item.config.option.tbstyle == "short":
        text = report.longreprtext
    else:
        try:  # as --tb=short shows it, pytest's own frames cut away (a private but old API)
            text = str(item._repr_failure_py(call.excinfo, style="short"))
        except Exception:
            text = call.excinfo.exconly()
    return text[-_TEXT_LIMIT:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The call phase decides a test; setup and teardown matter only when they go wrong.
    if report.when == "call" or not report.passed:
        record = {
            "test": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "steps": getattr(report, "dojo_steps", []),
        }
        if report.failed:
            record.update(getattr(report, "dojo_failure", {"text": report.longreprtext}))
        _write(record)


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo) -> None:
    """Ctrl-C: the test it stopped, and where that test's ranks waited (the harness's report,
    as a program says it: ``dojo.harness.world.run_world`` puts it in the interrupt)."""
    global _ctrl_c
    if isinstance(excinfo.value, pytest.Session.Interrupted):
        return  # the session stopped itself (after the first deadlock): not Ctrl-C
    _ctrl_c = True
    record = {"test": _running, "when": "session", "outcome": "interrupted"}
    record["text"] = str(excinfo.value)[-_TEXT_LIMIT:]
    places = learners_report.places(excinfo)
    if places:
        record["where"] = [asdict(place) for place in places]
    _write(record)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:  # the test file itself did not import
        _write(
            {
                "test": report.nodeid,
                "when": "collect",
                "outcome": "failed",
                "text": report.longreprtext[-_TEXT_LIMIT:],
            }
        )
