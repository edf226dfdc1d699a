"""A pytest plugin for the runner (``pytest -p dojo.testlog``): each test's outcome, one JSON line
per report, in the file named by ``DOJO_TEST_LOG``. The runner reads the outcomes from there
instead of parsing pytest's output, which the learner sees unchanged.
"""

from __future__ import annotations

import json
import os

import pytest

ENV_VAR = "DOJO_TEST_LOG"
_TEXT_LIMIT = 4000  # enough to find the step a failure is about


def _write(record: dict) -> None:
    path = os.environ.get(ENV_VAR)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The call phase decides a test; setup and teardown matter only when they go wrong.
    if report.when == "call" or not report.passed:
        _write({
            "test": report.nodeid, "when": report.when, "outcome": report.outcome,
            "text": report.longreprtext[-_TEXT_LIMIT:] if report.failed else "",
        })


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:  # the test file itself did not import
        _write({"test": report.nodeid, "when": "collect", "outcome": "failed", "text": report.longreprtext[-_TEXT_LIMIT:]})
