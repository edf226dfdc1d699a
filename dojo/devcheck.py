"""The maintainer gate: ``python -m dojo dev check`` (what ``make test`` and CI run).

1. The curriculum, the files on disk and the README's kata table agree, and every kata has a
   lesson, steps and hints.
2. Every test passes against ``solutions/`` (the harness's own tests and the contract too).
3. Every kata test fails against the shipped stubs with "not implemented yet" (``--expect-todo``):
   a stub that passes, crashes or hangs is caught.
Both pytest runs use ``-n 2``; ``--repeat N`` runs them N times (the flake hunt).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

from dojo import curriculum

PYTEST_BACKSTOP_S = 1800  # pytest-timeout and the harness's deadlines fire long before this


def consistency_problems() -> list[str]:
    """Everything that disagrees between curriculum.toml, katas/, solutions/, tests/ and README."""
    problems = []
    listed = {k.module for k in curriculum.katas()}
    for folder in ("katas", "solutions"):
        for path in sorted((curriculum.ROOT / folder).glob("k[0-9][0-9]_*.py")):
            if path.stem not in listed:
                problems.append(f"{folder}/{path.name} is not in dojo/curriculum.toml")
    for kata in curriculum.katas():
        missing = [p for p in (kata.kata_file, kata.solution_file, kata.test_file) if not p.exists()]
        problems += [f"{kata.id}: {p.relative_to(curriculum.ROOT)} is missing" for p in missing]
        if not kata.steps:
            problems.append(f"{kata.id}: the curriculum lists no steps")
        for step in kata.steps:
            if len(step.hints) < 2:
                problems.append(f"{kata.id} step {step.number}: needs at least two hint tiers")
        if kata.kata_file.exists():
            problems += _stub_problems(kata)
    readme = curriculum.ROOT / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    if curriculum.TABLE_START not in text or curriculum.TABLE_END not in text:
        problems.append("README.md has no kata table markers")
    elif _readme_table(text) != curriculum.kata_table():
        problems.append("README.md's kata table is stale: run `python -m dojo dev readme`")
    return problems


def _stub_problems(kata: curriculum.Kata) -> list[str]:
    """The stub teaches (module docstring with STEPS) and raises a todo for exactly its steps."""
    tree = ast.parse(kata.kata_file.read_text(encoding="utf-8"))
    problems = []
    doc = ast.get_docstring(tree) or ""
    if "STEPS" not in doc:
        problems.append(f"katas/{kata.module}.py: the lesson (module docstring) has no STEPS section")
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
    code = subprocess.call(
        [sys.executable, "-m", "pytest", *args], cwd=curriculum.ROOT, env=env, timeout=PYTEST_BACKSTOP_S
    )
    print(f"=== {title}: {'ok' if code == 0 else f'FAILED (pytest exit {code})'} in {time.monotonic() - start:.0f} s")
    return code == 0


def check(repeat: int = 1, workers: str = "2") -> int:
    start = time.monotonic()
    problems = consistency_problems()
    print("=== curriculum, files and README agree: " + ("ok" if not problems else "FAILED"))
    for problem in problems:
        print(f"  - {problem}")
    ok = not problems
    kata_tests = [str(k.test_file.relative_to(curriculum.ROOT)) for k in curriculum.katas() if k.test_file.exists()]
    for round_ in range(1, repeat + 1):
        suffix = f" (round {round_} of {repeat})" if repeat > 1 else ""
        ok &= _pytest(f"every solution passes{suffix}", "--solutions", "-n", workers, "-q")
        ok &= _pytest(f"every stub fails with 'not implemented yet'{suffix}", "--expect-todo", "-n", workers, "-q", *kata_tests)
    print(f"\n{'PASSED' if ok else 'FAILED'}: dev check in {time.monotonic() - start:.0f} s")
    return 0 if ok else 1
