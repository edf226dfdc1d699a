"""``dojo.spec.testing.run_module`` forks a program from the harness's forkserver: a test sees what
``python -m`` in a new interpreter shows (``DOJO_FRESH_PROGRAMS=1`` runs it so): its output and
its ranks' output, its exit status, what it says as it fails, the environment its ranks see."""

from __future__ import annotations

import pytest

from dojo.spec.testing import FRESH_PROGRAM_VAR, run_module

PROGRAM = "dojo.tests.tiny_program"


def _both_ways(monkeypatch, *args: str):
    forked = run_module(PROGRAM, *args)
    with monkeypatch.context() as fresh_only:
        fresh_only.setenv(FRESH_PROGRAM_VAR, "1")
        fresh = run_module(PROGRAM, *args)
    return forked, fresh


def test_a_forked_program_and_its_ranks_print_what_a_new_interpreter_prints(monkeypatch):
    monkeypatch.setenv("DOJO_TEST_MARK", "set by the test")
    forked, fresh = _both_ways(monkeypatch, "ranks")
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    for rank in (0, 1):
        line = f"rank {rank} of 2 sees DOJO_TEST_MARK=set by the test"
        assert line in forked.stdout, f"rank {rank} printed elsewhere:\n{forked.stdout}"
    assert forked.stdout.endswith("ranks returned [0, 1]\na last line without its newline")
    assert sorted(forked.stdout.splitlines()) == sorted(fresh.stdout.splitlines())


@pytest.mark.parametrize(
    "what, code, last_line",
    [
        ("raise", 1, "RuntimeError: the program failed"),
        ("exit", 1, "it exits with a message"),
        ("unknown", 1, "IndexError: list index out of range"),
    ],
)
def test_a_forked_program_fails_as_a_new_interpreter_does(monkeypatch, what, code, last_line):
    args = () if what == "unknown" else (what,)
    forked, fresh = _both_ways(monkeypatch, *args)
    assert forked.returncode == fresh.returncode == code
    assert forked.stderr.strip().splitlines()[-1] == last_line, forked.stderr
    assert fresh.stderr.strip().splitlines()[-1] == last_line, fresh.stderr
    assert forked.stdout == fresh.stdout == ""
