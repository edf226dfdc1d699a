"""The maintainer gate: ``python -m dojo dev check`` (what ``make test`` and CI run).

1. consistency: the curriculum, the files on disk and the README agree (``consistency``); every
   kata test says which step it checks and every step has a test (``steps``); kata files import
   only the kata API, only the runner imports the runner, no import circles (``imports``); ruff's
   lint and format checks pass.
2. solutions: every test passes against ``solutions/`` (the tooling's own tests in ``dojo/tests/``
   too) under ``-n 2``.
3. mistakes: every mistakes catalogue (``dojo/dev/mistakes/``) holds: each mistake fails the learner's
   spec with a message that names it, each right answer written another way passes.
4. stubs: every kata test fails against the shipped stubs with "not implemented yet"
   (``--expect-todo``), each within a time limit: a stub that passes, crashes or hangs is caught.

The stubs checked (rules, lint, ``--expect-todo``) are the ones made from ``solutions/``
(``dojo.curriculum.stubs``), written into ``dojo/dev/shipped/`` for the passes, not ``katas/``:
in a learner's checkout that holds their work, which is theirs. Where ``katas/`` differs from
them, the gate says so; under CI (``CI=true``, a clean checkout) that fails, since a maintainer
who changed a reference must make its stub again (``python -m dojo dev stubs``) before it ships.

``--repeat N`` runs 2-4 N times (the flake hunt). ``--kata kNN`` (repeatable) restricts every
part to those katas (the README table and unlisted files are checked only in a full run);
``--only PART`` runs some parts only; ``-k EXPR`` passes pytest's test selection on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from dojo import curriculum, lang
from dojo.curriculum import stubs
from dojo.dev import classroom, consistency, imports, reach, swaps
from dojo.dev.mistakes import plugin
from dojo.harness import impl
from dojo.spec.testing import hears_ctrl_c

PARTS = ("consistency", "solutions", "mistakes", "stubs")
# pytest-timeout and the harness's deadlines fire long before this; it only ends a pytest that
# hangs past them. Not a time budget: the catalogues' pass took 9 minutes on a slow 2-core
# machine (4 December 2026), and a busier machine may take several times that.
PYTEST_BACKSTOP_S = 3 * 3600
STUB_TEST_TIMEOUT_S = 60  # a shipped stub fails at once; one that takes this long hangs
SHIPPED_DIR = curriculum.ROOT.joinpath(*impl.SHIPPED.split("."))  # dojo/dev/shipped/


def consistency_problems(katas: list[curriculum.Kata] | None = None) -> list[str]:
    """Every consistency problem: files and curriculum, steps, imports, lint; under CI, files in
    katas/ that are not the shipped stubs too (elsewhere ``unshipped_note`` tells of them)."""
    chosen = list(curriculum.katas()) if katas is None else katas
    found = consistency.problems(katas) + step_problems(chosen)
    if katas is None:
        found += imports.problems() + classroom.problems() + lint_problems()
    if in_ci() and (files := consistency.unshipped(katas)):
        found.append(consistency.unshipped_text(files))
    return found


def unshipped_note(katas: list[curriculum.Kata] | None = None) -> str | None:
    """Outside CI: what the gate says of files in katas/ that are not the shipped stubs."""
    files = [] if in_ci() else consistency.unshipped(katas)
    return consistency.unshipped_text(files) if files else None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def step_problems(katas: list[curriculum.Kata]) -> list[str]:
    """Collect the katas' specs (no test runs) and check every test's step marker."""
    specs = [k for k in katas if k.test_file.exists()]
    if not specs:
        return []
    with tempfile.NamedTemporaryFile(prefix="dojo-collect-", suffix=".jsonl", delete=False) as log:
        path = log.name
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "dojo.runner.testlog",
                *(k.relative(k.test_file) for k in specs),
            ],
            cwd=curriculum.ROOT,
            env={**_clean_env(), "DOJO_TEST_LOG": path},
            capture_output=True,
            text=True,
            timeout=300,
        )
        with open(path, encoding="utf-8") as lines:
            records = [json.loads(line) for line in lines if line.strip()]
    finally:
        os.unlink(path)
    if done.returncode != 0:
        return [
            f"collecting the specs failed (pytest exit {done.returncode}):\n{done.stdout[-3000:]}"
        ]
    found = []
    for kata in specs:
        mine = [
            r
            for r in records
            if r["outcome"] == "collected"
            and r["test"].startswith(kata.relative(kata.test_file) + "::")
        ]
        found += consistency.coverage_problems(kata, mine)
    return found


def ship() -> list[str]:
    """Write the stubs made from ``solutions/`` into ``dojo/dev/shipped/`` (the implementation
    the stubs pass imports, ``impl.SHIPPED``), and nothing else there; the problems of the
    references that make no stub."""
    problems, made = [], set()
    for kata in curriculum.katas():
        if kata.solution_file.exists():
            try:
                stubs.write([kata], SHIPPED_DIR)
                made.add(f"{kata.module}.py")
            except stubs.StubError as error:
                problems.append(f"{error} (the stub is made from it)")
    for stale in SHIPPED_DIR.glob("k[0-9][0-9]_*.py"):
        if stale.name not in made:
            stale.unlink()
    return problems


def lint_problems() -> list[str]:
    """ruff's lint and format checks (configured in pyproject.toml), of the stubs made from
    solutions/ (in dojo/dev/shipped/) rather than katas/ (maybe a learner's code, not the gate's
    business)."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        return [
            "ruff is not installed in this environment: `pip install -e '.[dev]'` (make test does)"
        ]
    ship()
    found = []
    # git-ignored, so only named files are checked; katas/ is left out
    made = [p.relative_to(curriculum.ROOT).as_posix() for p in sorted(SHIPPED_DIR.glob("k*.py"))]
    where = [".", *made, "--extend-exclude", "katas"]
    for args, what in (
        (["check", "--quiet", *where], "lint"),
        (["format", "--check", "--quiet", *where], "format"),
    ):
        done = subprocess.run([ruff, *args], cwd=curriculum.ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            hint = "`ruff check --fix FILE`" if what == "lint" else "`ruff format FILE`"
            found.append(
                f"ruff {what} found problems ({hint} fixes most):\n{(done.stdout + done.stderr).rstrip()}"
            )
    return found


# Not passed on to the gate's pytest: which implementation (each pass says), a catalogue's swap,
# and a machine's wish for no bytecode caches (every rank would compile the specs, the katas and
# the catalogues from source again: a third of a pass's time on a 2-core machine).
_NOT_PASSED_ON = (impl.ENV_VAR, impl.INSTRUMENTS_VAR, swaps.ENV_VAR, "PYTHONDONTWRITEBYTECODE")


def _clean_env() -> dict[str, str]:
    """The maintainer's environment without the instruments, in English (what the catalogues
    and the tooling's tests read), whatever the maintainer's locale."""
    kept = {k: v for k, v in os.environ.items() if k not in _NOT_PASSED_ON}
    return {**kept, lang.ENV_VAR: "en"}


def _pytest(
    title: str, *args: str, implementation: str | None = None, env: dict | None = None
) -> bool:
    shown = f"{impl.ENV_VAR}={implementation} " if implementation else ""
    print(f"\n=== {title}\n$ {shown}pytest {' '.join(args)}", flush=True)
    env = {**_clean_env(), **(env or {})}
    if implementation:
        env[impl.ENV_VAR] = implementation
    start = time.monotonic()
    try:
        code = subprocess.call(
            [sys.executable, "-m", "pytest", *args],
            cwd=curriculum.ROOT,
            env=env,
            timeout=PYTEST_BACKSTOP_S,
            # Ctrl-C as a terminal delivers it, though the gate may run as a script's background
            # job, SIGINT ignored: the tests press Ctrl-C on what they start
            preexec_fn=None if os.name == "nt" else hears_ctrl_c,
        )
    except subprocess.TimeoutExpired:
        code = "timed out"
    verdict = "ok" if code == 0 else f"FAILED (pytest exit {code})"
    print(f"=== {title}: {verdict} in {time.monotonic() - start:.0f} s", flush=True)
    return code == 0


def resolve(names: list[str] | None) -> list[curriculum.Kata] | None:
    """The katas named (``k01``, ``1``, ``k01_spawn``), or None for all; KeyError names a bad one."""
    return [curriculum.find(name) for name in names] if names else None


def check(
    repeat: int = 1,
    workers: str = "2",
    katas: list[curriculum.Kata] | None = None,
    only: list[str] | None = None,
    select: str | None = None,
) -> int:
    start = time.monotonic()
    parts = only or list(PARTS)
    chosen = list(curriculum.katas()) if katas is None else katas
    scope = "" if katas is None else f" (only {', '.join(k.id for k in katas)})"
    if select:
        scope += f" (tests matching -k {select!r})"
    pytest_select = ("-k", select) if select else ()
    ok = True
    if "consistency" in parts:
        problems = consistency_problems(katas)
        print(
            f"=== curriculum, files, steps, imports and lint agree{scope}: "
            + ("ok" if not problems else "FAILED")
        )
        for problem in problems:
            print(f"  - {problem}")
        ok = not problems
        note = unshipped_note(katas)
        if note:
            print(f"  note: {note}")
    specs = [k.relative(k.test_file) for k in chosen if k.test_file.exists()]
    # Last kata first: the pass hands whole files to its workers, and the later parts' worlds are
    # the larger (k37's replicas, k39's 8 ranks: 40-50 s each), so one handed out last would keep
    # one worker busy alone while the other has finished.
    catalogued = [
        k.relative(k.test_file)
        for k in reversed(chosen)
        if k.test_file.exists() and k.catalogue_file.exists()
    ]
    # A full run tests the tooling too (dojo/tests/); a restricted one only its katas' specs.
    # The tooling's first: its slowest tests (a class graded, a learner's whole k01) then start
    # early rather than keep one worker busy after the other has finished.
    solution_tests = ["dojo/tests", "tests"] if katas is None else specs
    # The solutions pass notes what each test reaches of the reference (dojo.dev.reach), so that the
    # catalogue pass does not run again a test the swapped function never reaches.
    reached = tempfile.mkdtemp(prefix="dojo-reach-")
    try:
        for round_ in range(1, repeat + 1):
            suffix = f" (round {round_} of {repeat})" if repeat > 1 else ""
            passes = (solution_tests, catalogued, specs)
            ok &= _round(parts, workers, scope + suffix, pytest_select, *passes, reached)
    finally:
        shutil.rmtree(reached, ignore_errors=True)
    print(f"\n{'PASSED' if ok else 'FAILED'}: dev check{scope} in {time.monotonic() - start:.0f} s")
    return 0 if ok else 1


def _round(
    parts, workers, scope, pytest_select, solution_tests, catalogued, specs, reached
) -> bool:
    """One round of the pytest passes; ``scope`` says what it checks (and which round)."""
    ok = True
    if "solutions" in parts and solution_tests:
        for leftover in os.listdir(reached):  # each round records afresh
            os.remove(os.path.join(reached, leftover))
        ok &= _pytest(
            f"every solution passes{scope}",
            "--solutions",
            "-p",
            "dojo.dev.reach",
            "-n",
            workers,
            "-q",
            *pytest_select,
            *solution_tests,
            env=reach.environment_for(reached),
        )
    if "mistakes" in parts and catalogued:
        recorded = "solutions" in parts and os.listdir(reached)
        ok &= _pytest(
            f"every catalogued mistake fails its spec, naming it; every right answer passes{scope}",
            "-p",
            "dojo.dev.mistakes.plugin",
            "-n",
            workers,
            "--dist",
            "loadfile",
            "-q",
            *pytest_select,
            *catalogued,
            env={plugin.FROM_VAR: reached} if recorded else None,
        )
        if recorded:
            print(
                "    (skipped: the runs of a test whose reference run never reached the swapped "
                "function, which would run the reference's code again)",
                flush=True,
            )
    if "stubs" in parts and specs:
        for problem in ship():
            print(f"  - {problem}")
            ok = False
        ok &= _pytest(
            f"every shipped stub fails with 'not implemented yet'{scope}",
            "--expect-todo",
            "-n",
            workers,
            "-q",
            f"--timeout={STUB_TEST_TIMEOUT_S}",
            *pytest_select,
            *specs,
            implementation=impl.SHIPPED,  # made from solutions/, whatever katas/ holds
        )
    return ok
