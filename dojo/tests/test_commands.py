"""Every command the runner tells a learner to type works as printed, in the shell where
`make learn` ran (no activated environment); outside the environment it says how to get in."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dojo import commands
from dojo.curriculum import ROOT
from dojo.tests.test_runner import dojo, learner_env
from dojo.tests.test_runner_devcheck import shipped_copy


def _shell_without_the_environment() -> dict[str, str]:
    """A learner's shell after `make learn`: the environment's bin is not on the PATH."""
    env = learner_env()
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != bin_dir)
    env.pop("VIRTUAL_ENV", None)
    return env


def test_the_commands_after_the_first_run_work_as_printed_in_that_shell(tmp_path):
    root = shipped_copy(tmp_path)
    env = _shell_without_the_environment()
    first = dojo(root, env=env, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    shown = re.findall(r"`([^`]*\bhint)` gives a nudge", first.stdout)
    assert shown, f"no hint command in:\n{first.stdout}"
    # The environment's dojo is an editable install of the real checkout; a learner's points to
    # their own checkout, as this copy's does once it comes first on the path (else the hint
    # would read the real checkout's progress, whatever its owner has seen there).
    copy_first = {**env, "PYTHONPATH": str(root)}
    hint = subprocess.run(
        shown[0], shell=True, cwd=root, env=copy_first, capture_output=True, text=True, timeout=300
    )
    assert hint.returncode == 0 and "hint 1 of" in hint.stdout, (
        f"`{shown[0]}`, typed as printed, did not work:\n{hint.stdout}\n{hint.stderr}"
    )
    assert "source " in first.stdout and "activate" in first.stdout, (
        f"the first run should say how to make plain `dojo` work:\n{first.stdout}"
    )


def _without_torch(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Another Python, as a learner's shell finds one: this interpreter without its site-packages
    (``-S``: no torch, no pytest plugins), with only pytest and what it imports put back."""
    kept = tmp_path / "only-pytest"
    kept.mkdir()
    for name in (
        "pytest",
        "_pytest",
        "py",
        "pluggy",
        "iniconfig",
        "packaging",
        "pygments",
        "exceptiongroup",
        "tomli",
    ):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            where = Path(spec.origin)
            where = where.parent if where.name == "__init__.py" else where
            (kept / where.name).symlink_to(where)
    env = {**_shell_without_the_environment(), "PYTHONPATH": str(kept)}
    return [sys.executable, "-S"], env


@pytest.mark.parametrize(
    "typed",
    [
        "python -m katas.k04_allreduce",
        "python -m solutions.k05_data_parallel --epochs 1",
        "python -m pytest tests/test_k01_spawn.py",
        "python -m benchmarks.harness",
    ],
)
def test_a_command_typed_with_another_python_says_how_to_get_in(tmp_path, typed):
    python, env = _without_torch(tmp_path)
    done = subprocess.run(
        [*python, *typed.split()[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "has no torch" in out, f"`{typed}` without torch:\n{out}"
    assert "Traceback" not in out and "Unknown config option" not in out, (
        f"`{typed}` should stop with one line saying how to get in, not a traceback:\n{out}"
    )
    if (ROOT / ".venv" / "bin" / "dojo").exists():
        inside = typed.replace("python", ".venv/bin/python", 1)
        assert f"Type `{inside}` instead" in out and f"then plain `{typed}`" in out, out


def test_a_pytest_script_is_named_as_typed(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "/usr/bin/pytest", "tests/x.py"])
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest", "tests/x.py"])
    inside, plain = commands._typed_command()
    assert plain == "pytest tests/x.py" and inside.endswith("python -m pytest tests/x.py")
    monkeypatch.setattr(
        sys, "orig_argv", ["python3", "-X", "dev", "-m", "katas.k04", "--op", "a b"]
    )
    assert commands._typed_command()[1] == "python -m katas.k04 --op 'a b'"


def test_in_the_activated_shell_a_lessons_command_works_as_printed():
    env = learner_env()
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env["VIRTUAL_ENV"] = sys.prefix
    env.pop("DOJO_IMPL", None)
    done = subprocess.run(
        "python -m katas.k04_allreduce", shell=True, cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout + done.stderr
    if "not implemented yet" not in out:  # a learner's checkout with k04 solved runs it
        assert done.returncode == 0, out
    else:
        assert done.returncode == 3 and "Traceback" not in out, out


def test_outside_the_environment_the_runner_says_exactly_how_to_get_in(monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/usr")  # another Python's
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    problem = commands.environment_problem(["check", "k02"])
    assert problem is not None and "has no torch" in problem, problem
    if (ROOT / ".venv" / "bin" / "dojo").exists():
        assert "dojo check k02`" in problem and "activate" in problem, problem
        assert "make learn" in problem, "it should say whose environment this is not"
    else:
        assert "`make learn`" in problem, problem


def test_the_dojo_command_is_plain_only_where_the_shell_finds_this_one(monkeypatch, tmp_path):
    script = Path(sys.prefix) / "bin" / "dojo"
    if not script.exists():
        pytest.skip("this environment has no dojo console script (pip install -e . makes it)")
    monkeypatch.setenv("PATH", str(script.parent))
    assert commands.dojo() == "dojo"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    assert commands.dojo() == str(script), "from elsewhere, the script's full path"
