"""The runner ``dojo``, driven as a learner drives it, in a temporary copy of the repository.

The copy holds only k01 (the one kata whose stub and solution these tests may rely on) and, where
a second kata is needed, a tiny stand-in kata made here. Every command runs as a subprocess
(``python -m dojo ...``) with a deadline, with stdin not a terminal, so no question can block.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dojo import curriculum
from dojo.curriculum import stubs

REPO = curriculum.ROOT
KATA = "k01_spawn"


# ------------------------------------------------------------------------------- the helpers


def learner_copy(tmp_path: Path) -> Path:
    """A checkout as a learner has it, with k01 only (other katas are still being written)."""
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copytree(REPO / "dojo", root / "dojo", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("conftest.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    for folder, name in (
        ("katas", f"{KATA}.py"),
        ("solutions", f"{KATA}.py"),
        ("tests", f"test_{KATA}.py"),
    ):
        (root / folder).mkdir(exist_ok=True)
        shutil.copy(REPO / folder / "__init__.py", root / folder / "__init__.py")
        shutil.copy(REPO / folder / name, root / folder / name)
    return root


def add_stand_in_kata(root: Path, value: int = 0) -> tuple[str, str]:
    """The curriculum's second kata as a one-line stand-in: ``VALUE = 0``, solved by ``VALUE = 1``;
    ``VALUE = 2`` makes its test hang, as a learner's deadlock would (for the runner's clean-up).
    Its reference is a marked stand-in too (``dojo reset`` makes a stub from it)."""
    second = curriculum.katas()[1]
    set_value(root, second.module, value)
    (root / "tests" / f"test_{second.module}.py").write_text(
        "import time\n\n\n"
        "def test_value():\n"
        f"    from katas.{second.module} import VALUE\n"
        "    if VALUE == 2:\n"
        "        open('stand-in-hangs', 'w').close()  # tells the runner's tests it hangs now\n"
        "        time.sleep(300)\n"
        "    assert VALUE == 1, f'VALUE is {VALUE}, expected 1'\n"
    )
    (root / "solutions" / f"{second.module}.py").write_text(STAND_IN_REFERENCE)
    return second.id, second.module


STAND_IN_REFERENCE = '''"""A stand-in kata's reference."""

from dojo.console import say

VALUE = 1


def value() -> int:
    # BEGIN STEP 1: the value
    # TODO: the value
    return VALUE
    # END STEP 1
'''


def wait_for_hang(root: Path, seconds: float = 60) -> None:
    """Wait until the stand-in's test has started hanging (it leaves a mark), and clear the mark."""
    mark, end = root / "stand-in-hangs", time.monotonic() + seconds
    while not mark.exists():
        assert time.monotonic() < end, "the stand-in's test never started"
        time.sleep(0.05)
    mark.unlink()


def set_value(root: Path, module: str, value: int) -> None:
    (root / "katas" / f"{module}.py").write_text(f'"""A stand-in kata."""\nVALUE = {value}\n')


def learner_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # a learner's shell: no CI (under CI the gate is stricter about katas/), no test's settings
        if k not in ("CI", "DOJO_IMPL", "NO_COLOR", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")
    }
    env["DOJO_LANG"] = "en"  # whatever this machine's locale: these tests read English
    env["COLUMNS"] = "100"  # the width the runner wraps its lines to (xdist's workers say 80)
    env.update(extra)
    return env


def dojo(
    root: Path, *args: str, timeout: float = 120, env: dict | None = None, answer: str | None = None
) -> subprocess.CompletedProcess:
    """``python -m dojo ARGS`` in ``root``; stdin is not a terminal, so questions answer no, or
    ``answer`` (piped in, as `yes | dojo ...` does)."""
    return subprocess.run(
        [sys.executable, "-m", "dojo", *args],
        cwd=root,
        env=env or learner_env(),
        input=answer,
        stdin=subprocess.DEVNULL if answer is None else None,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def listing(root: Path) -> dict[str, dict]:
    done = dojo(root, "list", "--json")
    assert done.returncode == 0, done.stderr
    return {k["id"]: k for k in json.loads(done.stdout)}


def processes_in(root: Path) -> list[str]:
    """Processes still running in ``root`` (by working directory or command line): none may be left."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(str(root)) or str(root) in command:
            found.append(f"{entry.name}: {command.strip()[:200]}")
    return found


def wait_until_gone(root: Path, seconds: float = 15) -> list[str]:
    end = time.monotonic() + seconds
    while (left := processes_in(root)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def kill_leftovers(root: Path) -> None:
    """Clean-up after a failed test only: the assertions have already named the leftovers."""
    for line in processes_in(root):
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def hints_of(step: int) -> list[str]:
    return list(curriculum.find("k01").step(step).hints)


# ------------------------------------------------------------------------------------ the tests


@pytest.mark.timeout(600)
def test_a_learner_solves_k01_sees_it_done_resets_it_and_sees_it_pending(tmp_path):
    root = learner_copy(tmp_path)
    stub = (root / "katas" / f"{KATA}.py").read_bytes()

    katas = listing(root)
    assert katas["k01"]["status"] == "current" and not katas["k01"]["done"], katas["k01"]
    assert all(k["status"] == "later" for id_, k in katas.items() if id_ != "k01"), (
        "katas whose files are missing must show as not written yet"
    )

    verify = dojo(root, "verify")
    assert verify.returncode == 1, f"verify must fail while k01 is a stub:\n{verify.stdout}"
    assert (
        "k01 · Spawning rank processes does not pass yet: it is the first pending kata"
        in verify.stdout
    )

    # Hints: the first failing step, from the last run (no new run); climbing is the learner's
    # choice (--more), never a side effect of asking twice.
    tiers = hints_of(1)
    hint = dojo(root, "hint")
    assert hint.returncode == 0, hint.stderr
    assert "Running k01's tests" not in hint.stdout, (
        "the last run is fresh: hint must not run the tests again"
    )
    assert "k01 step 1" in hint.stdout and f"hint 1 of {len(tiers)}" in hint.stdout, hint.stdout
    assert tiers[0][:40] in hint.stdout and tiers[1][:40] not in hint.stdout, hint.stdout
    again = dojo(root, "hint")
    assert f"hint 1 of {len(tiers)}" in again.stdout and tiers[1][:40] not in again.stdout, (
        f"asking again must not give more of the answer away:\n{again.stdout}"
    )
    assert "hint k01 --step 1 --more` shows hint 2" in again.stdout, again.stdout
    more = dojo(root, "hint", "--more")
    assert f"hint 2 of {len(tiers)}" in more.stdout and tiers[1][:40] in more.stdout, more.stdout
    assert all(t[:40] not in more.stdout for t in tiers[2:]), "--more climbs one tier, no further"
    kept = dojo(root, "hint")
    assert f"hint 2 of {len(tiers)}" in kept.stdout, f"a tier seen stays shown:\n{kept.stdout}"
    last = len(hints_of(4))
    step4 = dojo(root, "hint", "k01", "--step", "4", "--level", str(last))
    assert step4.returncode == 0 and all(h[:40] in step4.stdout for h in hints_of(4)), step4.stdout
    bad = dojo(root, "hint", "--level", "9")
    assert bad.returncode == 2 and f"hint levels 1 to {len(tiers)}" in bad.stderr, bad.stderr

    # The reference is not shown before the kata passes unless the learner insists.
    solution = dojo(root, "solution", "k01")
    assert solution.returncode == 1 and "add --yes" in solution.stdout, solution.stdout
    assert "def launch" not in solution.stdout

    # Solve it by copying the solution in: check marks it done; it stays current until `next`.
    k01 = next(k for k in curriculum.katas() if k.module == KATA)
    (root / "katas" / f"{KATA}.py").write_text(stubs.solved(k01))  # the reference, unmarked
    check = dojo(root, "check", "k01", timeout=500)
    assert check.returncode == 0, (
        f"the solution copied in must pass:\n{check.stdout[-3000:]}\n{check.stderr[-2000:]}"
    )
    assert "k01 passes" in check.stdout, check.stdout[-2000:]
    katas = listing(root)
    assert katas["k01"]["done"] and katas["k01"]["status"] == "current", (
        f"a kata that passes is done and stays current until `dojo next`: {katas['k01']}"
    )
    verify = dojo(root, "verify")
    assert verify.returncode == 0, verify.stdout
    assert "unchanged since it passed" in verify.stdout, (
        "verify re-ran a kata whose files did not change"
    )
    view = dojo(root)
    assert (
        view.returncode == 0
        and "1 of" in view.stdout
        and "passes (nothing changed since it did)" in view.stdout
    ), view.stdout
    same = dojo(root, "solution", "k01", "--diff")
    assert same.returncode == 0 and "is the same as the reference" in same.stdout, same.stdout

    # Reset: asks (no terminal, so no), then with --yes restores the stub and keeps a backup.
    refused = dojo(root, "reset", "k01")
    assert refused.returncode == 1 and "Nothing was changed" in refused.stdout, refused.stdout
    assert (root / "katas" / f"{KATA}.py").read_bytes() != stub
    reset = dojo(root, "reset", "k01", "--yes")
    assert reset.returncode == 0, reset.stdout + reset.stderr
    assert (root / "katas" / f"{KATA}.py").read_bytes() == stub, (
        "reset must restore the shipped stub byte for byte"
    )
    backups = list((root / ".dojo" / "backups").glob(f"{KATA}-*.py"))
    assert len(backups) == 1 and backups[0].read_text() == stubs.solved(k01)
    katas = listing(root)
    assert katas["k01"]["status"] == "current" and not katas["k01"]["done"], (
        f"after reset k01 is pending: {katas['k01']}"
    )
    assert "reset k01 --undo` brings it back" in reset.stdout, reset.stdout

    # Undo brings the backed-up version back (and backs up the stub it replaces).
    undone = dojo(root, "reset", "k01", "--undo")
    assert undone.returncode == 0, undone.stdout + undone.stderr
    solved = stubs.solved(k01).encode()
    assert (root / "katas" / f"{KATA}.py").read_bytes() == solved, (
        f"--undo must bring back the file the reset replaced:\n{undone.stdout}"
    )

    # A piped answer works as it does for other tools: `yes | dojo reset k01`.
    piped = dojo(root, "reset", "k01", answer="y\n")
    assert piped.returncode == 0 and (root / "katas" / f"{KATA}.py").read_bytes() == stub, (
        f"a piped 'y' must answer the question:\n{piped.stdout}"
    )
    assert not wait_until_gone(root), "a command left processes running"


def test_reset_makes_the_stub_from_the_reference_in_a_copy_without_git(tmp_path):
    """A learner's checkout may be a zip: no git, no stub kept anywhere but made afresh."""
    root = learner_copy(tmp_path)
    assert not any((folder / ".git").exists() for folder in (root, *root.parents)), (
        "this test needs a copy outside any git repository"
    )
    mine = root / "katas" / f"{KATA}.py"
    shipped = stubs.stub(curriculum.find("k01"))
    todo = 'raise KataTodo("k01", 2, "the greeting")'
    assert todo in shipped, "k01 changed: update this test's doctoring"
    mine.write_text(shipped.replace(todo, 'return "hello"'))

    done = dojo(root, "reset", "k01", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert mine.read_text() == shipped, "reset must make k01's stub from solutions/k01_spawn.py"
    assert "k01: katas/k01_spawn.py is the shipped stub again" in done.stdout, done.stdout

    (root / "solutions" / f"{KATA}.py").unlink()  # an instructor took the references out
    mine.write_text("# my work\n")
    refused = dojo(root, "reset", "k01", "--yes")
    assert refused.returncode == 1, refused.stdout
    assert "k01: solutions/k01_spawn.py, which its stub is made from, is not in this checkout" in (
        refused.stdout
    ), refused.stdout
    assert mine.read_text() == "# my work\n", "a reset that cannot make the stub changes nothing"


def test_dojo_shows_the_current_kata_and_next_moves_on_only_once_it_passes(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    went = dojo(root, "goto", second)
    assert went.returncode == 0 and listing(root)[second]["status"] == "current", went.stdout

    # `dojo`: the progress view, a run of the current kata's tests (pytest's own output), what next.
    view = dojo(root)
    assert view.returncode == 0, view.stdout + view.stderr
    assert "0 of" in view.stdout and f"current  {second}" in view.stdout, view.stdout
    assert "VALUE is 0, expected 1" in view.stdout, "pytest's own output must reach the learner"
    assert (
        f"{second}: 0 of 1 tests pass" in view.stdout
        and f"Next: open katas/{module}.py" in view.stdout
    ), view.stdout

    stay = dojo(root, "next")
    assert stay.returncode == 1 and "does not pass yet, so you stay on it" in stay.stdout, (
        stay.stdout
    )
    assert listing(root)[second]["status"] == "current"

    set_value(root, module, 1)
    moved = dojo(root, "next")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    katas = listing(root)
    assert katas[second]["done"] and katas["k01"]["status"] == "current", (
        f"next must mark {second} done and move to the kata still pending (k01): {katas}"
    )

    unknown = dojo(root, "goto", "k99")
    assert unknown.returncode == 2 and "no kata called 'k99'" in unknown.stderr, unknown.stderr
    later = next(k for k in curriculum.katas() if k.id not in ("k01", second))
    missing = dojo(root, "check", later.id)
    assert missing.returncode == 2 and "not written yet" in missing.stderr, missing.stderr


def test_a_kata_saved_again_within_the_second_runs_as_saved(tmp_path):
    """Python reuses its cached compile of a file whose size and second of change are the same:
    a quick second save (``VALUE = 0`` to ``VALUE = 1``, as ``dojo watch`` invites) must not run
    the code as it was."""
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    assert dojo(root, "goto", second).returncode == 0
    env = learner_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a learner's Python caches what it compiles
    kata = root / "katas" / f"{module}.py"
    saved = kata.stat()
    failing = dojo(root, "check", second, env=env)
    assert failing.returncode != 0 and "VALUE is 0, expected 1" in failing.stdout, failing.stdout
    set_value(root, module, 1)
    os.utime(kata, ns=(saved.st_atime_ns, saved.st_mtime_ns))  # saved within the same second
    passing = dojo(root, "check", second, env=env)
    assert passing.returncode == 0 and f"{second} passes" in passing.stdout, (
        f"the run used the compile Python had cached of the kata before it was saved:\n"
        f"{passing.stdout}"
    )


DEADLOCKING_TEST = """
from dojo.harness.world import WorldDeadlock


def test_first():
    from katas.{module} import VALUE

    if VALUE == 0:  # as the harness reports a learner's deadlock
        raise WorldDeadlock("deadlock: rank(s) 0, 1 made no progress for 3 s", [0, 1])


def test_second():
    open("second-ran", "w").close()
"""


def test_check_stops_at_a_deadlock_and_dojo_shows_an_unchanged_kata_without_running_it(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    (root / "tests" / f"test_{module}.py").write_text(DEADLOCKING_TEST.format(module=module))
    assert dojo(root, "goto", second).returncode == 0

    first = dojo(root)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "deadlock: rank(s) 0, 1 made no progress" in first.stdout, first.stdout
    assert "Stopped at that deadlock: the 1 test(s) after it did not run" in first.stdout, (
        first.stdout
    )
    assert not (root / "second-ran").exists(), "a test after the deadlock ran"
    assert f"{second}: 0 of 2 tests pass" in first.stdout, first.stdout

    # Nothing changed: plain `dojo`, in either language, shows that run again without running.
    for args, unchanged in (((), "nothing has changed since"), (("--lang", "zh"), "此后没有改动")):
        again = dojo(root, *args)
        assert again.returncode == 0 and unchanged in again.stdout, again.stdout
        assert "deadlock: rank(s) 0, 1 made no progress" in again.stdout, again.stdout
        assert "testing katas/" not in again.stdout, "the tests ran again though nothing changed"

    set_value(root, module, 1)  # a change: the tests run again
    solved = dojo(root)
    assert "nothing has changed since" not in solved.stdout, solved.stdout
    assert f"{second} passes" in solved.stdout and (root / "second-ran").exists(), solved.stdout


WORLD_KATA = '''"""A stand-in kata whose functions run in the ranks of a world."""
import torch.distributed as dist

from dojo.todo import KataTodo


def greet(rank):
    raise KataTodo("{kata}", 2, "say hello")


def divide(rank):
    return 1 / (rank - rank)


def wait_for_peers(rank):
    if rank == 0:
        dist.barrier()  # rank 1 never comes
    return rank
'''

WORLD_SPEC = """
import pytest

from dojo.harness.world import run_world


def _greet(rank, world_size):
    from katas.{module} import greet

    return greet(rank)


def _divide(rank, world_size):
    from katas.{module} import divide

    return divide(rank)


def _wait(rank, world_size):
    from katas.{module} import wait_for_peers

    return wait_for_peers(rank)


@pytest.mark.step(2)
def test_todo_in_a_rank():
    run_world(_greet, 2)


@pytest.mark.step(1)
def test_error_in_a_rank():
    run_world(_divide, 2)


@pytest.mark.step(3)
def test_deadlock():
    run_world(_wait, 2)
"""


@pytest.mark.timeout(400)
def test_a_run_keeps_what_its_tests_said_and_every_failure_shows_the_learners_line(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    kata = WORLD_KATA.format(kata=second)
    (root / "katas" / f"{module}.py").write_text(kata)
    (root / "tests" / f"test_{module}.py").write_text(WORLD_SPEC.format(module=module))
    line_of = {text.strip(): number for number, text in enumerate(kata.splitlines(), start=1)}
    divide, barrier = (
        line_of["return 1 / (rank - rank)"],
        line_of["dist.barrier()  # rank 1 never comes"],
    )

    done = dojo(root, "check", second, timeout=360)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "ZeroDivisionError: division by zero" in out, out
    assert "FAILED test_deadlock: dojo.harness.world.WorldDeadlock: deadlock: rank(s) 0" in out, out
    assert f"your code: katas/{module}.py:{barrier}, in wait_for_peers" in out, (
        f"a deadlock shown on one line carries the learner's line:\n{out}"
    )
    step = curriculum.find(second).step(2)
    assert f"step 2 · {step.title} (also: say hello): 1 test" in out, out
    assert f"-> write step 2 in katas/{module}.py" in out and step.hints[0][:30] in out, (
        f"the first unwritten step's hint:\n{out}"
    )

    # The todo crossed the rank's pipe whole, and the log kept it so (the progress file keeps
    # what the learner was shown)
    kept = json.loads((root / ".dojo" / "progress.json").read_text())["runs"][second]["records"]
    by = {r["test"].split("::")[-1]: r for r in kept if r["when"] == "call"}
    assert by["test_todo_in_a_rank"]["todo"] == {"kata": second, "step": 2, "what": "say hello"}
    failed = by["test_error_in_a_rank"]
    assert failed["rank"] in (0, 1) and failed["steps"] == [1], failed
    assert failed["where"][-1] == {
        "file": f"katas/{module}.py",
        "line": divide,
        "function": "divide",
    }
    hung = by["test_deadlock"]
    assert hung["deadlock"] and hung["where"][-1]["line"] == barrier, hung
    assert "rank" not in hung, "a deadlock's ranks are named in its message, not one rank"


SAVED_DURING_THE_RUN = """
def test_value():
    from katas.{module} import VALUE

    assert VALUE == 1, f"VALUE is {{VALUE}}, expected 1"
    with open("katas/{module}.py", "w") as kata:  # the learner saves while the tests still run
        kata.write("VALUE = 0\\n")
"""


def test_a_save_during_a_run_is_not_recorded_as_the_code_that_passed(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root, value=1)
    (root / "tests" / f"test_{module}.py").write_text(SAVED_DURING_THE_RUN.format(module=module))
    assert dojo(root, "goto", second).returncode == 0
    passed = dojo(root, "check", second)
    assert passed.returncode == 0 and f"{second} passes" in passed.stdout, passed.stdout
    assert "VALUE = 0" in (root / "katas" / f"{module}.py").read_text()
    again = dojo(root)
    assert "nothing changed since it did" not in again.stdout, (
        f"the code saved during the run was recorded as the code that passed:\n{again.stdout}"
    )
    assert "VALUE is 0, expected 1" in again.stdout, again.stdout


def test_progress_file_that_is_damaged_is_kept_and_replaced(tmp_path):
    root = learner_copy(tmp_path)
    (root / ".dojo").mkdir()
    (root / ".dojo" / "progress.json").write_text("{not json")
    katas = listing(root)
    assert katas["k01"]["status"] == "current"
    assert (root / ".dojo" / "progress.broken.json").read_text() == "{not json"


def test_colour_only_on_a_terminal_and_never_with_no_color(tmp_path):
    root = learner_copy(tmp_path)
    import pty

    def on_terminal(env: dict) -> str:
        master, slave = pty.openpty()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "dojo", "list"],
                cwd=root,
                env=env,
                stdin=slave,
                stdout=slave,
                stderr=slave,
            )
            os.close(slave)
            chunks = []
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the terminal closed: the program ended
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            process.wait(timeout=30)
            return b"".join(chunks).decode(errors="replace")
        finally:
            os.close(master)

    assert "\033[" in on_terminal(learner_env(TERM="xterm")), "no colour on a terminal"
    assert "\033[" not in on_terminal(learner_env(TERM="xterm", NO_COLOR="1")), (
        "colour despite NO_COLOR"
    )
    assert "\033[" not in dojo(root, "list").stdout, "colour in a pipe (CI logs)"


def test_python_m_dojo_and_the_console_script_are_the_same_program():
    script = Path(sys.executable).with_name("dojo")
    if not script.exists():
        pytest.skip(
            "the dojo console script is not installed in this environment (pip install -e .)"
        )
    by_module = subprocess.run(
        [sys.executable, "-m", "dojo", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    by_script = subprocess.run(
        [str(script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert by_module.returncode == by_script.returncode == 0
    assert by_module.stdout == by_script.stdout


def test_bench_names_a_missing_benchmark(tmp_path):
    root = learner_copy(tmp_path)  # the copy has no benchmarks/
    done = dojo(root, "bench", "allreduce")
    assert done.returncode == 2, done.stdout
    assert "benchmarks/allreduce.py" in done.stderr and "is not in this checkout" in done.stderr, (
        done.stderr
    )


def test_doctor_reports_in_plain_words():
    done = dojo(REPO, "doctor", "--json", timeout=150)
    findings = json.loads(done.stdout)
    topics = {f["topic"] for f in findings}
    for topic in (
        "Python",
        "torch",
        "gloo",
        "NCCL",
        "GPUs",
        "shared memory",
        "loopback",
        "start methods",
        "gloo world (loopback)",
    ):
        assert topic in topics, f"doctor says nothing about {topic}: {sorted(topics)}"
    assert all(f["status"] in ("ok", "note", "FAIL") and f["text"] for f in findings)
    failed = [f for f in findings if f["status"] == "FAIL"]
    assert done.returncode == (1 if failed else 0), (done.returncode, failed)
    # This machine runs the whole suite, so everything the katas need must work on it.
    assert not failed, f"doctor reports failures on the machine that runs the tests: {failed}"
