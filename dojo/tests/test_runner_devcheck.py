"""``dojo dev check`` catches what it exists to catch, on a copy of the repository with a doctored
file: a stub that passes a test, a solution that fails one, a stale pristine copy (that it passes
a sound repository is what ``make test`` shows every time it runs). Restricted to
k01, to its greeting test and to one pytest process (``--kata k01 -k greet -n 0``: xdist is not
what is tested here), so each pytest run costs a second or two.
"""

from __future__ import annotations

from dojo.tests.test_runner import KATA, dojo, learner_copy

RIGHT = 'return f"world size:{world_size}. I\'m rank {rank}."'


def test_a_clean_copy_is_consistent(tmp_path):
    root = learner_copy(tmp_path)
    done = dojo(root, "dev", "check", "--kata", "k01", "--only", "consistency")
    assert done.returncode == 0, done.stdout
    assert "agree (only k01): ok" in done.stdout, done.stdout


def test_dev_check_catches_a_stub_that_passes_and_a_solution_that_fails(tmp_path):
    root = learner_copy(tmp_path)
    stub, solution = root / "katas" / f"{KATA}.py", root / "solutions" / f"{KATA}.py"
    todo = 'raise KataTodo("k01", 2, "the greeting")'
    assert todo in stub.read_text() and RIGHT in solution.read_text(), (
        "k01 changed: update this test's doctoring"
    )
    stub.write_text(stub.read_text().replace(todo, RIGHT))  # a stub that already does step 2
    solution.write_text(
        solution.read_text().replace(RIGHT, RIGHT.replace("size:", "size: "))
    )  # a wrong greeting

    done = dojo(root, "dev", "check", "--kata", "k01", "-k", "greet", "-n", "0", timeout=300)
    out = done.stdout
    assert done.returncode == 1, f"dev check passed a doctored repository:\n{out}"
    assert "dojo/pristine/k01_spawn.py differs from katas/k01_spawn.py" in out, out
    assert (
        "=== every stub fails with 'not implemented yet' (only k01) (tests matching -k 'greet'): FAILED"
        in out
    ), out
    assert "the shipped stub PASSED this test" in out and "test_greet" in out, (
        f"the passing stub went unnoticed:\n{out}"
    )
    assert "=== every solution passes (only k01) (tests matching -k 'greet'): FAILED" in out, out
    assert "FAILED tests/test_k01_spawn.py::test_greet" in out, (
        f"the failing solution went unnoticed:\n{out}"
    )
