"""``dojo dev check`` catches what it exists to catch, on a copy of the repository with a doctored
file: a shipped stub that passes a test, a solution that fails one; and it leaves a learner's
work alone: it checks the shipped stubs (``dojo/pristine/``) whatever ``katas/`` holds. Restricted
to k01, to its greeting test and to one pytest process (``--kata k01 -k greet -n 0``: xdist is
not what is tested here), so each pytest run costs a second or two.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from dojo.tests.test_runner import KATA, dojo, learner_copy, learner_env

RIGHT = 'return f"world size:{world_size}. I\'m rank {rank}."'


def shipped_copy(tmp_path):
    """``learner_copy`` with k01's shipped stub in katas/, whatever this checkout's katas/ holds
    (a learner running ``make test`` may have solved it)."""
    root = learner_copy(tmp_path)
    shutil.copy(root / "dojo" / "pristine" / f"{KATA}.py", root / "katas" / f"{KATA}.py")
    return root


def test_a_clean_copy_is_consistent(tmp_path):
    root = shipped_copy(tmp_path)
    done = dojo(root, "dev", "check", "--kata", "k01", "--only", "consistency")
    assert done.returncode == 0, done.stdout
    assert "agree (only k01): ok" in done.stdout, done.stdout
    assert "note:" not in done.stdout, f"a clean copy has nothing to note:\n{done.stdout}"


def test_dev_check_catches_a_stub_that_passes_and_a_solution_that_fails(tmp_path):
    root = shipped_copy(tmp_path)
    stub, solution = root / "katas" / f"{KATA}.py", root / "solutions" / f"{KATA}.py"
    todo = 'raise KataTodo("k01", 2, "the greeting")'
    assert todo in stub.read_text() and RIGHT in solution.read_text(), (
        "k01 changed: update this test's doctoring"
    )
    stub.write_text(stub.read_text().replace(todo, RIGHT))  # a stub that already does step 2,
    shutil.copy(stub, root / "dojo" / "pristine" / f"{KATA}.py")  # shipped by a maintainer
    solution.write_text(
        solution.read_text().replace(RIGHT, RIGHT.replace("size:", "size: "))
    )  # a wrong greeting

    done = dojo(root, "dev", "check", "--kata", "k01", "-k", "greet", "-n", "0", timeout=300)
    out = done.stdout
    assert done.returncode == 1, f"dev check passed a doctored repository:\n{out}"
    assert "dojo/pristine/k01_spawn.py has no KataTodo for step 2" in out, out
    assert (
        "=== every shipped stub fails with 'not implemented yet' (only k01) (tests matching -k 'greet'): FAILED"
        in out
    ), out
    assert "the shipped stub PASSED this test" in out and "test_greet" in out, (
        f"the passing stub went unnoticed:\n{out}"
    )
    assert "=== every solution passes (only k01) (tests matching -k 'greet'): FAILED" in out, out
    assert "FAILED tests/test_k01_spawn.py::test_greet" in out, (
        f"the failing solution went unnoticed:\n{out}"
    )


def test_a_learners_solved_kata_is_theirs_not_the_gates(tmp_path):
    root = shipped_copy(tmp_path)
    mine = root / "katas" / f"{KATA}.py"
    solved = (root / "solutions" / f"{KATA}.py").read_text() + "import os\nx=1\n"  # and unlinted
    mine.write_text(solved)
    shipped = (root / "dojo" / "pristine" / f"{KATA}.py").read_bytes()

    args = ("dev", "check", "--kata", "k01", "--only", "consistency", "--only", "stubs")
    done = dojo(root, *args, "-k", "greet", "-n", "0", timeout=300)
    out = done.stdout
    assert done.returncode == 0, f"the gate failed on the learner's own file:\n{out}"
    assert "note: katas/k01_spawn.py is not the shipped stub" in out, out
    assert "dojo dev pristine" not in out, f"it must not suggest overwriting the stubs:\n{out}"
    lint = subprocess.run(
        [sys.executable, "-c", "from dojo.dev import check; print(check.lint_problems())"],
        cwd=root,
        env=learner_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert lint.stdout.strip() == "[]", f"the gate linted the learner's file:\n{lint.stdout}"

    in_ci = dojo(root, *args, "-k", "greet", "-n", "0", env=learner_env(CI="true"), timeout=300)
    assert in_ci.returncode == 1 and "katas/k01_spawn.py is not the shipped stub" in in_ci.stdout, (
        f"CI checks a clean checkout: a stub not copied to dojo/pristine/ must fail there:\n{in_ci.stdout}"
    )

    refreshed = dojo(root, "dev", "pristine")
    assert "katas/k01_spawn.py is not a stub" in refreshed.stdout, refreshed.stdout
    assert (root / "dojo" / "pristine" / f"{KATA}.py").read_bytes() == shipped, (
        "`dojo dev pristine` made a learner's solved kata the shipped stub"
    )
    assert mine.read_text() == solved, "the learner's file must never change"
