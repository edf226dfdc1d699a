"""The learner's path through the katas: the progress view, ``check``, ``verify``, ``next``, ``goto``.

A kata is done when its tests pass, and pending again when they stop passing. The current kata
changes only when the learner says so (``next``, ``goto``): passing never moves it by itself.
"""

from __future__ import annotations

import json
import os
import sys

from dojo import curriculum
from dojo.commands import dojo
from dojo.runner import progress, runs
from dojo.runner.term import bar, foreground, paint

_STYLE = {"done": ("green",), "current": ("bold", "yellow"), "pending": (), "later": ("dim",)}


def progress_view(state: progress.State) -> str:
    katas, now = curriculum.katas(), progress.current(state)
    done = sum(1 for k in katas if state.is_done(k) and progress.available(k))
    lines = [
        paint("torch-dist-katas", "bold")
        + f" {bar(done, len(katas))} {done} of {len(katas)} katas done"
    ]
    for number, name in curriculum.parts().items():
        lines.append(f"\n  {name}")
        for kata in (k for k in katas if k.part == number):
            status = progress.status(state, kata, now)
            row = f"  {status:<9}{kata.id}  {kata.title}"
            if status == "later":
                row += "  (not written yet)"
            elif status == "current" and state.is_done(kata):
                row += f"  (passes: `{dojo()} next` moves on)"
            lines.append("  " + paint(row, *_STYLE[status]))
    return "\n".join(lines)


def listing(state: progress.State) -> list[dict]:
    now = progress.current(state)
    return [
        {
            "id": k.id,
            "module": k.module,
            "part": k.part,
            "title": k.title,
            "teaches": k.teaches,
            "status": progress.status(state, k, now),
            "done": state.is_done(k),
            "steps": len(k.steps),
            "file": f"katas/{k.module}.py",
            "tests": [runs.spec_file(k)],
        }
        for k in curriculum.katas()
    ]


def show_list(as_json: bool = False) -> int:
    state = progress.load()
    print(json.dumps(listing(state), indent=2) if as_json else progress_view(state))
    return 0


def check(kata: curriculum.Kata, solutions: bool = False, capture: bool = False) -> runs.RunResult:
    """Run one kata's tests; record the outcome (not for ``--solutions``, which tests the reference)."""
    where = "solutions/" if solutions else "katas/"
    tests = runs.spec_file(kata)
    print(
        paint(f"\n{kata.id} · {kata.title}", "bold")
        + f": testing {where}{kata.module}.py with {tests}",
        flush=True,
    )
    result = runs.run_kata(kata, solutions=solutions, capture=capture)
    if not solutions:
        progress.record_run(kata, result.passed, result.summary(), progress.fingerprint(kata))
    if capture and result.broken:  # pytest itself may have said why (a conftest, an option)
        print(result.output, end="")
    digest = result.digest()
    print(("\n" + digest) if digest else "", flush=True)
    print(paint(result.describe(), "green" if result.passed else "red"), flush=True)
    return result


def start() -> int:
    """``dojo``: where the learner stands, the current kata's tests, and what to do next."""
    state = progress.load()
    print(progress_view(state))
    kata = progress.current(state)
    if kata is None:
        return _all_done(state)
    if state.is_done(kata) and progress.passed_unchanged(state, kata):
        print(f"\n{kata.id} · {kata.title} passes (nothing changed since it did).")
        return _after_pass(kata)
    result = check(kata)
    if result.passed:
        return _after_pass(kata)
    step = result.first_failing_step()
    print(
        f"\nNext: open katas/{kata.module}.py, read its lesson (the docstring at the top) and write "
        f"{runs.describe_step(kata, step) if step else 'the first failing step'}."
    )
    print(
        f"      `{dojo()} hint` gives a nudge; `{dojo()} watch` re-runs the tests every time you save."
    )
    if dojo() != "dojo":  # make learn ran it from .venv without activating it
        activate = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "activate"))
        print(f"      (`source {activate}` once per shell, and plain `dojo` works too.)")
    return 0


def _after_pass(kata: curriculum.Kata) -> int:
    upcoming = progress.following(progress.load(), kata)
    if upcoming is None:
        return _all_done(progress.load())
    print(f"Next: `{dojo()} next` moves on to {upcoming.id} · {upcoming.title}.")
    return 0


def _all_done(state: progress.State) -> int:
    later = [k.id for k in curriculum.katas() if not progress.available(k)]
    if later:
        print(f"\nEvery kata written so far passes; {', '.join(later)} are still being written.")
    else:
        print("\nEvery kata passes: you have finished torch-dist-katas.")
    return 0


def check_command(kata: curriculum.Kata, solutions: bool = False) -> int:
    result = check(kata, solutions)
    if result.passed and not solutions:
        now = progress.current(progress.load())
        if now is not None and now.id == kata.id:
            _after_pass(kata)
    elif not result.passed and not solutions:
        print(f"`{dojo()} hint {kata.id}` gives a nudge.")
    return 0 if result.passed else 1


def verify(fresh: bool = False, solutions: bool = False) -> int:
    """Every available kata in order; stops at the first that does not pass and names it."""
    for kata in progress.available_katas():
        state = progress.load()
        if not fresh and not solutions and progress.passed_unchanged(state, kata):
            print(
                f"{kata.id} passes (unchanged since it passed at {state.done[kata.id]['at']}; --fresh re-runs it)"
            )
            continue
        result = check(kata, solutions=solutions, capture=True)
        if not result.passed:
            why = (
                "its reference solution fails"
                if solutions
                else "does not pass yet: it is the first pending kata"
            )
            print(paint(f"\n{kata.id} · {kata.title} {why}.", "red"))
            return 1
    later = [k.id for k in curriculum.katas() if not progress.available(k)]
    print(
        paint(
            "\nEvery kata passes" + (f" (not written yet: {', '.join(later)})." if later else "."),
            "green",
        )
    )
    return 0


def next_kata() -> int:
    """Move on once the current kata passes (running its tests first if needed)."""
    state = progress.load()
    kata = progress.current(state)
    if kata is None:
        return _all_done(state)
    if not progress.passed_unchanged(state, kata):
        result = check(kata)
        if not result.passed:
            print(
                f"{kata.id} does not pass yet, so you stay on it. `{dojo()} hint` helps; "
                f"`{dojo()} goto kNN` jumps elsewhere on purpose."
            )
            return 1
    upcoming = progress.following(progress.load(), kata)
    if upcoming is None:
        return _all_done(progress.load())
    with progress.editing() as state:
        state.focus = upcoming.id
    print(f"\n{kata.id} done. Now: {upcoming.id} · {upcoming.title}")
    print(f"Open katas/{upcoming.module}.py and read its lesson; `{dojo()}` runs its tests.")
    return 0


def goto(kata: curriculum.Kata) -> int:
    with progress.editing() as state:
        state.focus = kata.id
    status = "it already passes" if state.is_done(kata) else f"its tests run with `{dojo()}`"
    print(f"Now: {kata.id} · {kata.title} (katas/{kata.module}.py); {status}.")
    return 0


def run_program(kata: curriculum.Kata, solutions: bool, args: list[str]) -> int:
    """``dojo run kNN``: the kata's program (``python -m katas.kNN_topic ARGS``)."""
    package = "solutions" if solutions else "katas"
    return foreground([sys.executable, "-m", f"{package}.{kata.module}", *args], curriculum.ROOT)
