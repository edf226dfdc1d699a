"""``dojo dev check`` catches what it exists to catch, on a copy of the repository with a doctored
reference: a stub made from it that passes a test (a region left unmarked), a solution that fails
one; and it leaves a learner's work alone: it checks the stubs made from ``solutions/`` whatever
``katas/`` holds. Restricted to k01, to a few quick tests and to one pytest process (``--kata
k01 -k ... -n 0``: xdist is not what is tested here), so each pytest run costs a second or two.
"""

from __future__ import annotations

import subprocess
import sys

from dojo import curriculum
from dojo.curriculum import stubs
from dojo.tests.test_runner import KATA, dojo, learner_copy, learner_env

RIGHT = 'return f"world size:{world_size}. I\'m rank {rank}."'
GREET_REGION = (
    "    # BEGIN STEP 2: the greeting\n",
    "    # END STEP 2\n",
)
WORLD_SIZE = "    return nnodes * nproc_per_node\n"


def shipped_copy(tmp_path):
    """``learner_copy`` with k01's stub, made from its reference, in katas/, whatever this
    checkout's katas/ holds (a learner running ``make test`` may have solved it)."""
    root = learner_copy(tmp_path)
    (root / "katas" / f"{KATA}.py").write_text(stubs.stub(curriculum.find("k01")))
    return root


def test_a_clean_copy_is_consistent(tmp_path):
    root = shipped_copy(tmp_path)
    done = dojo(root, "dev", "check", "--kata", "k01", "--only", "consistency")
    assert done.returncode == 0, done.stdout
    assert "agree (only k01): ok" in done.stdout, done.stdout
    assert "note:" not in done.stdout, f"a clean copy has nothing to note:\n{done.stdout}"


def test_dev_check_catches_a_stub_that_passes_and_a_solution_that_fails(tmp_path):
    root = shipped_copy(tmp_path)
    solution = root / "solutions" / f"{KATA}.py"
    text = solution.read_text()
    assert all(line in text for line in (*GREET_REGION, WORLD_SIZE)) and RIGHT in text, (
        "k01 changed: update this test's doctoring"
    )
    # step 2's region unmarked (its TODO left as a plain comment): the stub made from it keeps
    # the greeting, so it passes test_greet
    text = "".join(line for line in text.splitlines(keepends=True) if line not in GREET_REGION)
    solution.write_text(text.replace(WORLD_SIZE, WORLD_SIZE.replace("*", "+")))  # a wrong size

    select = "greet or world_size_of"
    done = dojo(root, "dev", "check", "--kata", "k01", "-k", select, "-n", "0", timeout=300)
    out = done.stdout
    assert done.returncode == 1, f"dev check passed a doctored repository:\n{out}"
    assert "solutions/k01_spawn.py has no region for step 2 (" in out, out
    assert (
        f"=== every shipped stub fails with 'not implemented yet' (only k01) (tests matching -k '{select}'): FAILED"
        in out
    ), out
    assert "the shipped stub PASSED this test" in out and "test_greet" in out, (
        f"the passing stub went unnoticed:\n{out}"
    )
    assert f"=== every solution passes (only k01) (tests matching -k '{select}'): FAILED" in out, (
        out
    )
    assert "FAILED tests/test_k01_spawn.py::test_world_size_of" in out, (
        f"the failing solution went unnoticed:\n{out}"
    )


def test_dev_stubs_makes_a_changed_references_stub_and_a_missing_one(tmp_path):
    root = shipped_copy(tmp_path)
    stub, solution = root / "katas" / f"{KATA}.py", root / "solutions" / f"{KATA}.py"
    said = "    # TODO: return how many processes the whole job runs"
    assert said in solution.read_text(), "k01 changed: update this test's doctoring"
    solution.write_text(solution.read_text().replace(said, f"{said} (said anew)"))
    remade = dojo(root, "dev", "stubs", "k01")
    assert remade.returncode == 0 and "wrote katas/k01_spawn.py" in remade.stdout, remade.stdout
    assert f"{said} (said anew)" in stub.read_text(), "the stub of the changed reference is stale"
    assert dojo(root, "dev", "check", "--kata", "k01", "--only", "consistency").returncode == 0
    stub.unlink()
    again = dojo(root, "dev", "stubs", "k01")
    assert again.returncode == 0 and stub.read_text() == stubs.stub_source(
        solution.read_text(), "k01", "solutions/k01_spawn.py"
    ), again.stdout
    same = dojo(root, "dev", "stubs", "k01")
    assert "katas/ already holds the stubs made from solutions/" in same.stdout, same.stdout


def test_a_learners_solved_kata_is_theirs_not_the_gates(tmp_path):
    root = shipped_copy(tmp_path)
    mine = root / "katas" / f"{KATA}.py"
    solved = (root / "solutions" / f"{KATA}.py").read_text() + "import os\nx=1\n"  # and unlinted
    mine.write_text(solved)

    args = ("dev", "check", "--kata", "k01", "--only", "consistency", "--only", "stubs")
    done = dojo(root, *args, "-k", "greet", "-n", "0", timeout=300)
    out = done.stdout
    assert done.returncode == 0, f"the gate failed on the learner's own file:\n{out}"
    assert "note: katas/k01_spawn.py is not the stub made from solutions/" in out, out
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
    assert in_ci.returncode == 1 and "katas/k01_spawn.py is not the stub" in in_ci.stdout, (
        f"CI checks a clean checkout: a stub not made again from its reference must fail there:\n{in_ci.stdout}"
    )

    refreshed = dojo(root, "dev", "stubs", "k01")
    assert refreshed.returncode == 1, refreshed.stdout
    assert "k01: katas/k01_spawn.py is not a stub (" in refreshed.stdout, refreshed.stdout
    assert "reset k01` replaces it, keeping a backup" in refreshed.stdout, refreshed.stdout
    assert mine.read_text() == solved, "`dojo dev stubs` overwrote a learner's solved kata"
