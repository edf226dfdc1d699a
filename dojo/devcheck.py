"""The maintainer gate: ``python -m dojo dev check`` (what ``make test`` and CI run).

1. consistency: the curriculum, the files on disk and the README's kata table agree; every kata
   has a lesson (THE IDEA, STEPS, WHAT THE TESTS CHECK, RUN IT), steps with 2-3 hint tiers, tests,
   a stub that raises a KataTodo for exactly its steps, a solution without todos, and a pristine
   copy of its stub (``dojo reset`` restores from it) identical to ``katas/``.
2. solutions: every test passes against ``solutions/`` (the harness's own tests and the runner's
   too) under ``-n 2``.
3. stubs: every kata test fails against the shipped stubs with "not implemented yet"
   (``--expect-todo``), each within a time limit: a stub that passes, crashes or hangs is caught.

``--repeat N`` runs 2 and 3 N times (the flake hunt). ``--kata kNN`` (repeatable) restricts every
part to those katas (the README table and unlisted files are checked only in a full run);
``--only PART`` runs some parts only; ``-k EXPR`` passes pytest's test selection on.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time

from dojo import curriculum, reset, runs

PARTS = ("consistency", "solutions", "stubs")
PYTEST_BACKSTOP_S = 1800  # pytest-timeout and the harness's deadlines fire long before this
STUB_TEST_TIMEOUT_S = 60  # a shipped stub fails at once; one that takes this long hangs
LESSON_SECTIONS = ("THE IDEA", "STEPS", "WHAT THE TESTS CHECK", "RUN IT")


def consistency_problems(katas: list[curriculum.Kata] | None = None) -> list[str]:
    """Everything that disagrees between curriculum.toml, katas/, solutions/, tests/, dojo/pristine/
    and README. ``katas`` restricts the check to those (and skips the whole-repository checks)."""
    full = katas is None
    katas = list(curriculum.katas()) if full else katas
    problems = []
    if full:
        listed = {k.module for k in curriculum.katas()}
        for folder in ("katas", "solutions"):
            for path in sorted((curriculum.ROOT / folder).glob("k[0-9][0-9]_*.py")):
                if path.stem not in listed:
                    problems.append(f"{folder}/{path.name} is not in dojo/curriculum.toml")
    for kata in katas:
        missing = [p for p in (kata.kata_file, kata.solution_file, kata.test_file) if not p.exists()]
        problems += [f"{kata.id}: {p.relative_to(curriculum.ROOT)} is missing" for p in missing]
        if not kata.steps:
            problems.append(f"{kata.id}: the curriculum lists no steps")
        for step in kata.steps:
            if not 2 <= len(step.hints) <= 3:
                problems.append(f"{kata.id} step {step.number}: needs 2 or 3 hint tiers (a nudge first, nearly the answer last), has {len(step.hints)}")
        if kata.world_size < 1:
            problems.append(f"{kata.id}: world_size must be at least 1")
        if kata.kata_file.exists():
            problems += _stub_problems(kata)
        if kata.solution_file.exists() and _raises_todo(kata.solution_file):
            problems.append(f"solutions/{kata.module}.py raises a KataTodo: a solution must be complete")
        if kata.test_file.exists() and not re.search(r"^\s*def test_", kata.test_file.read_text(encoding="utf-8"), re.M):
            problems.append(f"tests/test_{kata.module}.py has no test functions")
    problems += reset.pristine_problems(katas)
    if full:
        readme = curriculum.ROOT / "README.md"
        text = readme.read_text(encoding="utf-8") if readme.exists() else ""
        if curriculum.TABLE_START not in text or curriculum.TABLE_END not in text:
            problems.append("README.md has no kata table markers")
        elif _readme_table(text) != curriculum.kata_table():
            problems.append("README.md's kata table is stale: run `python -m dojo dev readme`")
    return problems


def _stub_problems(kata: curriculum.Kata) -> list[str]:
    """The stub teaches (a lesson with every section) and raises a todo for exactly its steps."""
    try:
        tree = ast.parse(kata.kata_file.read_text(encoding="utf-8"))
    except SyntaxError as error:
        return [f"katas/{kata.module}.py does not parse: {error}"]
    problems = []
    doc = ast.get_docstring(tree) or ""
    if not doc:
        problems.append(f"katas/{kata.module}.py has no lesson (module docstring)")
    else:
        lacking = [s for s in LESSON_SECTIONS if s not in doc]
        if lacking:
            problems.append(f"katas/{kata.module}.py: the lesson (module docstring) lacks {', '.join(lacking)}")
    raised = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "KataTodo":
            args = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
            if len(args) == 2:
                if args[0] != kata.id:
                    problems.append(f"katas/{kata.module}.py raises a todo for {args[0]}, not {kata.id}")
                raised.add(args[1])
    steps = {s.number for s in kata.steps}
    for number in sorted(steps - raised):
        problems.append(f"katas/{kata.module}.py has no KataTodo for step {number}")
    for number in sorted(raised - steps):
        problems.append(f"katas/{kata.module}.py raises a todo for step {number}, which the curriculum lacks")
    return problems


def _raises_todo(path) -> bool:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError:
        return False  # the solutions' pytest run reports it
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "KataTodo" for n in ast.walk(tree))


def _readme_table(text: str) -> str:
    return text.split(curriculum.TABLE_START, 1)[1].split(curriculum.TABLE_END, 1)[0].strip()


def write_readme_table() -> None:
    readme = curriculum.ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(curriculum.TABLE_START, 1)
    _, tail = rest.split(curriculum.TABLE_END, 1)
    readme.write_text(
        f"{head}{curriculum.TABLE_START}\n{curriculum.kata_table()}\n{curriculum.TABLE_END}{tail}",
        encoding="utf-8",
    )


def _pytest(title: str, *args: str) -> bool:
    print(f"\n=== {title}\n$ pytest {' '.join(args)}", flush=True)
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "DOJO_IMPL"}
    try:
        code = subprocess.call(
            [sys.executable, "-m", "pytest", *args], cwd=curriculum.ROOT, env=env, timeout=PYTEST_BACKSTOP_S
        )
    except subprocess.TimeoutExpired:
        code = "timed out"
    print(f"=== {title}: {'ok' if code == 0 else f'FAILED (pytest exit {code})'} in {time.monotonic() - start:.0f} s", flush=True)
    return code == 0


def resolve(names: list[str] | None) -> list[curriculum.Kata] | None:
    """The katas named (``k01``, ``1``, ``k01_spawn``), or None for all; KeyError names a bad one."""
    return [curriculum.find(name) for name in names] if names else None


def check(
    repeat: int = 1, workers: str = "2", katas: list[curriculum.Kata] | None = None, only: list[str] | None = None,
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
        print(f"=== curriculum, files and README agree{scope}: " + ("ok" if not problems else "FAILED"))
        for problem in problems:
            print(f"  - {problem}")
        ok = not problems
    kata_tests = [path for k in chosen for path in runs.kata_test_files(k)]
    # A full run tests everything under tests/ (harness, contract, runner); a restricted one its katas.
    solution_tests = [] if katas is None else kata_tests
    for round_ in range(1, repeat + 1):
        suffix = f" (round {round_} of {repeat})" if repeat > 1 else ""
        if "solutions" in parts and (katas is None or kata_tests):
            ok &= _pytest(f"every solution passes{scope}{suffix}", "--solutions", "-n", workers, "-q", *pytest_select, *solution_tests)
        if "stubs" in parts and kata_tests:
            ok &= _pytest(
                f"every stub fails with 'not implemented yet'{scope}{suffix}", "--expect-todo", "-n", workers, "-q",
                f"--timeout={STUB_TEST_TIMEOUT_S}", *pytest_select, *kata_tests,
            )
    print(f"\n{'PASSED' if ok else 'FAILED'}: dev check{scope} in {time.monotonic() - start:.0f} s")
    return 0 if ok else 1
