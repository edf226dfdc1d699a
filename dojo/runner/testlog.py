"""A pytest plugin for the runner (``pytest -p dojo.runner.testlog``): each test's outcome, one JSON line
per report, in the file named by ``DOJO_TEST_LOG``. The runner reads the outcomes from there
instead of parsing pytest's output, and shows the learner a digest of them.

A failure's text is its short traceback (where it failed, and the message), whatever ``--tb``
says, so the runner can keep pytest's own output to a line of progress. Every record carries the
steps the test checks (its ``step`` marker); with ``--collect-only`` the log lists every collected
test and its steps (``dojo dev check`` proves with it that every test has a step and every step a
test).
"""

from __future__ import annotations

import json
import os

import pytest

from dojo.curriculum import steps

ENV_VAR = "DOJO_TEST_LOG"
# Set by the runner: the session stops after the first deadlock (the tests after it would most
# likely wait for the same one); the log then ends with a "session" record saying how many did
# not run.
STOP_VAR = "DOJO_STOP_AT_DEADLOCK"
_TEXT_LIMIT = 6000  # a failure's tail: the message, and enough to find the step it is about


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    # Ctrl-C: the runner says it was interrupted and shows the failures found so far; pytest's
    # banner and the traceback of where the interrupt landed would only bury them.
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and hasattr(reporter, "_report_keyboardinterrupt"):
        reporter._report_keyboardinterrupt = lambda: None


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    report.dojo_steps = steps.of_test(item)
    if call.excinfo is not None and report.failed and call.when == "call":
        if os.environ.get(STOP_VAR) == "1" and _is_deadlock(call.excinfo.value):
            items = item.session.items
            left = len(items) - items.index(item) - 1 if item in items else 0
            if left:
                item.session.shouldstop = "dojo: stopped after the first deadlock"
                _write({"test": "", "when": "session", "outcome": "stopped", "left": left})
    if call.excinfo is not None and report.failed:
        report.dojo_message = (call.excinfo.exconly().strip().splitlines() or [""])[0]
        try:  # as --tb=short shows it, pytest's own frames cut away (a private but old API)
            report.dojo_text = str(item._repr_failure_py(call.excinfo, style="short"))
        except Exception:
            report.dojo_text = call.excinfo.exconly()


def _is_deadlock(error: BaseException) -> bool:
    """The harness's deadlock report: raised as it is, quoted by a spec's own message (which
    says what hung), or a program under test that hung (dojo.spec.testing's)."""
    seen: BaseException | None = error
    for _ in range(10):  # an exception's chain of causes, not for ever
        if seen is None:
            break
        if type(seen).__name__ == "WorldDeadlock" or "deadlock: rank(s)" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The call phase decides a test; setup and teardown matter only when they go wrong.
    if report.when == "call" or not report.passed:
        text = ""
        if report.failed:
            # A string is the dojo plugin's own report (a todo): short already, and final.
            text = (
                report.longrepr
                if isinstance(report.longrepr, str)
                else getattr(report, "dojo_text", report.longreprtext)
            )
        _write(
            {
                "test": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "text": text[-_TEXT_LIMIT:],
                "steps": getattr(report, "dojo_steps", []),
                "message": getattr(report, "dojo_message", ""),
            }
        )


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
