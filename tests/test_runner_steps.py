"""How the runner reads a test run: which step a failure is about, and the digest a learner sees.
In-process and read-only, on k01's shipped files."""

from __future__ import annotations

from dojo import curriculum
from dojo.runs import RunResult
from dojo.steps import step_functions, steps_of_failure

K01 = curriculum.find("k01")
TEST = "tests/test_k01_spawn.py"


def record(test: str, outcome: str = "failed", text: str = "", when: str = "call") -> dict:
    return {"test": f"{TEST}::{test}", "when": when, "outcome": outcome, "text": text}


def test_each_stub_function_belongs_to_the_step_whose_todo_it_raises():
    steps = step_functions(K01)
    assert steps["global_rank"] == 1 and steps["world_size_of"] == 1, steps
    assert steps["greet"] == 2 and steps["run_rank"] == 3 and steps["launch"] == 4, steps
    assert "print_greeting" not in steps and "main" not in steps, "written code belongs to no step"


def test_a_failure_is_tied_to_its_todo_or_to_the_functions_its_test_exercises():
    steps = step_functions(K01)
    todo = record("test_greet", text="not implemented yet: k01 step 2 (the greeting)")
    assert steps_of_failure(K01, todo, steps) == {2}
    wrong = record("test_global_rank[1-0-3-3]", text="E   AssertionError: returned 1, expected 3")
    assert steps_of_failure(K01, wrong, steps) == {1}, "the test calls kata.global_rank: step 1"
    # the launch test reaches kata.launch through a helper it hands to the harness
    launch = record("test_launch_names_the_rank_that_failed", text="E   AssertionError: expected RankProcessFailed")
    assert 4 in steps_of_failure(K01, launch, steps)


def test_the_digest_shows_the_first_real_failure_in_full_and_counts_the_todos():
    result = RunResult(K01, 1, [
        record("test_global_rank[0-0-3-0]", "passed"),
        record("test_global_rank[1-0-3-3]", text="tests/test_k01_spawn.py:27: in test_global_rank\nE   AssertionError: returned 1, expected 3"),
        record("test_global_rank[1-2-3-5]", text="E   AssertionError: returned 3, expected 5"),
        record("test_greet", text="not implemented yet: k01 step 2 (the greeting)"),
        record("test_launch_spawns_and_collects_in_rank_order", text="not implemented yet: k01 step 4 (spawn, collect, join)"),
        record("test_launch_names_the_rank_that_failed", text="not implemented yet: k01 step 4 (spawn, collect, join)"),
        record("test_cuda", "skipped"),
    ])
    digest = result.digest()
    assert "FAILED test_global_rank[1-0-3-3]\n  tests/test_k01_spawn.py:27: in test_global_rank" in digest, digest
    assert "FAILED test_global_rank[1-2-3-5]: AssertionError: returned 3, expected 5" in digest, digest
    assert "step 2 · the greeting: 1 test" in digest and "step 4 · spawn, collect, join: 2 tests" in digest, digest
    assert result.first_failing_step() == 1
    assert result.describe().startswith("k01: 1 of 6 tests pass (1 skipped). First failing step: step 1"), result.describe()


def test_a_kata_file_that_does_not_import_is_said_plainly():
    error = "E     File \"katas/k01_spawn.py\", line 116\nE   SyntaxError: invalid syntax"
    result = RunResult(K01, 1, [record(f"test_global_rank[{i}]", "failed", error, when="setup") for i in range(3)])
    assert "FAILED test_global_rank[1] and 1 more: the same error" in result.digest(), result.digest()
    assert "3 could not start" in result.describe() and "does katas/k01_spawn.py import?" in result.describe()
