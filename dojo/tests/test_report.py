"""What a learner's plain ``pytest`` shows of a failure: the step, the message and where in their
own file, not the checking code's source (which floods the screen and gives the answer away)."""

from __future__ import annotations

import subprocess
import sys

from dojo.curriculum import ROOT
from dojo.dev import swaps
from dojo.tests.test_runner import KATA, learner_copy, learner_env


def _pytest(cwd, *args, **env):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env={**learner_env(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_failure_shows_its_step_message_and_the_learners_line(tmp_path):
    root = learner_copy(tmp_path)
    solved = (root / "solutions" / f"{KATA}.py").read_text()
    wrong = solved.replace(
        '    return f"world size:{world_size}. I\'m rank {rank}."',
        "    ranks_per_world = rank / (world_size - world_size)  # a slip\n"
        '    return f"world size:{world_size}. I\'m rank {rank}."',
    )
    assert wrong != solved
    (root / "katas" / f"{KATA}.py").write_text(wrong)
    done = _pytest(root, f"tests/test_{KATA}.py", "-k", "greet")
    out = done.stdout
    assert done.returncode == 1, out
    assert "step 2 · the greeting (tests/test_k01_spawn.py:" in out, out
    assert "ZeroDivisionError: division by zero" in out, out
    assert f"in your code (most recent call last):\n  katas/{KATA}.py:" in out, out
    assert "ranks_per_world = rank / (world_size - world_size)" in out, out
    assert "def test_greet" not in out, f"the test's own source must not be shown:\n{out}"


def test_a_wrong_answer_in_a_rank_is_a_few_lines_and_long_tracebacks_come_on_request():
    env = {
        "DOJO_IMPL": "solutions",
        **swaps.environment_for(
            {
                "k04_allreduce": {
                    "average_gradients": "dojo.dev.mistakes.k04_allreduce:summed_not_divided"
                }
            }
        ),
    }
    spec = "tests/test_k04_allreduce.py"
    test = "test_average_gradients_in_a_world_of_one or test_average_gradients_gives_every_rank_the_mean"
    short = _pytest(ROOT, spec, "-k", test, **env)
    assert short.returncode == 1, short.stdout
    assert "divide by the world size" in short.stdout, short.stdout
    assert "problems.append" not in short.stdout, (
        f"the checker's source must not be shown:\n{short.stdout}"
    )
    failure = short.stdout.split("= FAILURES =", 1)[1].split("short test summary", 1)[0]
    assert len(failure.splitlines()) < 15, f"one failure should take a few lines:\n{failure}"
    full = _pytest(ROOT, spec, "-k", test, "--tb=long", **env)
    assert "problems.append" in full.stdout, "--tb=long must bring pytest's full report back"
