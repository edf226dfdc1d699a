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
from dojo.lang import t
from dojo.runner import progress, runs
from dojo.runner.term import bar, foreground, paint

_STYLE = {"done": ("green",), "current": ("bold", "yellow"), "pending": (), "later": ("dim",)}


def progress_view(state: progress.State) -> str:
    katas, now = curriculum.katas(), progress.current(state)
    done = sum(1 for k in katas if state.is_done(k) and progress.available(k))
    lines = [
        paint("torch-dist-katas", "bold")
        + f" {bar(done, len(katas))} "
        + t("{done} of {total} katas done", done=done, total=len(katas))
    ]
    for number, name in curriculum.parts().items():
        members = [k for k in katas if k.part == number]
        if members:  # a part named before its first kata lands is not shown yet
            lines.append(f"\n  {name}")
        for kata in members:
            status = progress.status(state, kata, now)
            label = _status(status)
            row = f"  {label}{' ' * max(1, 9 - _width(label))}{kata.id}  {kata.title}"
            if status == "later":
                row += "  " + t("(not written yet)")
            elif status == "current" and state.is_done(kata):
                row += "  " + t("(passes: `{next}` moves on)", next=f"{dojo()} next")
            lines.append("  " + paint(row, *_STYLE[status]))
    return "\n".join(lines)


def _status(status: str) -> str:
    """A kata's status (``progress.status``) as the list shows it."""
    return {
        "done": t("done"),
        "current": t("current"),
        "pending": t("pending"),
        "later": t("later"),
    }[status]


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
    """Run one kata's tests; record the outcome (not for ``--solutions``, which tests the reference).
    Ctrl-C shows what the tests that had finished found, then ends as an interrupt."""
    where = "solutions/" if solutions else "katas/"
    tests = runs.spec_file(kata)
    print(
        paint(f"\n{kata.id} · {kata.title}", "bold")
        + t(": testing {file} with {tests}", file=f"{where}{kata.module}.py", tests=tests),
        flush=True,
    )
    try:
        result = runs.run_kata(kata, solutions=solutions, capture=capture)
    except runs.Interrupted as interrupted:
        partial = interrupted.result
        digest = partial.digest()
        print(("\n" + digest) if digest else "", flush=True)
        print(paint(partial.describe_interrupted(), "yellow"))
        raise KeyboardInterrupt from None
    if not solutions:
        result.state = remember(result)
    if capture and result.broken:  # pytest itself may have said why (a conftest, an option)
        print(result.output, end="")
    _show(result)
    return result


def remember(result: runs.RunResult) -> progress.State:
    """Record a run of the learner's kata in the progress file (what the run tested: the files
    as they were when it started); the progress file as it saved it."""
    return progress.record_run(
        result.kata, result.passed, result.summary(), result.fingerprint, result.records
    )


def _show(result: runs.RunResult) -> None:
    digest = result.digest()
    print(("\n" + digest) if digest else "", flush=True)
    print(paint(result.describe(), "green" if result.passed else "red"), flush=True)


def _last_run(state: progress.State, kata: curriculum.Kata) -> runs.RunResult | None:
    """The kata's last run as the learner saw it, if nothing it depends on changed since."""
    run = progress.fresh_run(state, kata)
    if not run or "records" not in run or run.get("exit") in (None, 0):
        return None
    print(paint(f"\n{kata.id} · {kata.title}", "bold"))
    print(
        t(
            "(the outcome of its last run, at {at}: nothing has changed since; `{check}` runs the tests again)",
            at=run.get("at", "?"),
            check=f"{dojo()} check {kata.id}",
        )
    )
    return runs.RunResult(kata, run["exit"], run["records"])


def start() -> int:
    """``dojo``: where the learner stands, the current kata's tests, and what to do next."""
    state = progress.load()
    print(progress_view(state))
    kata = progress.current(state)
    if kata is None:
        return _all_done(state)
    if state.is_done(kata) and progress.passed_unchanged(state, kata):
        print(
            "\n"
            + t("{kata} passes (nothing changed since it did).", kata=f"{kata.id} · {kata.title}")
        )
        return _after_pass(kata, state)
    result = _last_run(state, kata)  # nothing changed: minutes of tests would say the same
    if result is not None:
        _show(result)
    else:
        result = check(kata)
    if result.passed:
        return _after_pass(kata, result.state or state)
    step = result.first_failing_step()
    where = runs.describe_step(kata, step) if step else t("the first failing step")
    print(
        "\n"
        + t(
            "Next: open {file}, read its lesson (the docstring at the top, or `{lesson}`) and write {step}.",
            file=f"katas/{kata.module}.py",
            lesson=f"{dojo()} lesson",
            step=where,
        )
    )
    print(
        t(
            "      `{hint}` gives a nudge; `{watch}` re-runs the tests every time you save.",
            hint=f"{dojo()} hint",
            watch=f"{dojo()} watch",
        )
    )
    if dojo() != "dojo":  # make learn ran it from .venv without activating it
        activate = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "activate"))
        print(
            t(
                "      (`source {activate}` once per shell, and plain `dojo` works too.)",
                activate=activate,
            )
        )
    return 0


def _after_pass(kata: curriculum.Kata, state: progress.State) -> int:
    upcoming = progress.following(state, kata)
    if upcoming is None:
        return _all_done(state)
    print(
        t(
            "Next: `{next}` moves on to {kata}.",
            next=f"{dojo()} next",
            kata=f"{upcoming.id} · {upcoming.title}",
        )
    )
    return 0


def _all_done(state: progress.State) -> int:
    later = [k.id for k in curriculum.katas() if not progress.available(k)]
    if later:
        print(
            "\n"
            + t(
                "Every kata written so far passes; {later} are still being written.",
                later=", ".join(later),
            )
        )
    else:
        print("\n" + t("Every kata passes: you have finished torch-dist-katas."))
    return 0


def check_command(kata: curriculum.Kata, solutions: bool = False) -> int:
    result = check(kata, solutions)
    if result.passed and not solutions:
        if progress.is_current(result.state, kata):  # it stays current until `dojo next`
            _after_pass(kata, result.state)
    elif not result.passed and not solutions:
        print(t("`{hint}` gives a nudge.", hint=f"{dojo()} hint {kata.id}"))
    return 0 if result.passed else 1


def verify(fresh: bool = False, solutions: bool = False) -> int:
    """Every available kata in order; stops at the first that does not pass and names it."""
    for kata in progress.available_katas():
        state = progress.load()
        if not fresh and not solutions and progress.passed_unchanged(state, kata):
            print(
                t(
                    "{kata} passes (unchanged since it passed at {at}; --fresh re-runs it)",
                    kata=kata.id,
                    at=state.done[kata.id]["at"],
                )
            )
            continue
        result = check(kata, solutions=solutions, capture=True)
        if not result.passed:
            named = f"{kata.id} · {kata.title}"
            if solutions:
                said = t("{kata} its reference solution fails.", kata=named)
            else:
                said = t("{kata} does not pass yet: it is the first pending kata.", kata=named)
            print(paint("\n" + said, "red"))
            return 1
    later = [k.id for k in curriculum.katas() if not progress.available(k)]
    if later:
        said = t("Every kata passes (not written yet: {later}).", later=", ".join(later))
    else:
        said = t("Every kata passes.")
    print(paint("\n" + said, "green"))
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
                t(
                    "{kata} does not pass yet, so you stay on it. `{hint}` helps; `{goto}` jumps elsewhere on purpose.",
                    kata=kata.id,
                    hint=f"{dojo()} hint",
                    goto=f"{dojo()} goto kNN",
                )
            )
            return 1
        state = result.state
    upcoming = progress.following(state, kata)
    if upcoming is None:
        return _all_done(state)
    with progress.editing() as state:
        state.focus = upcoming.id
    print(
        "\n"
        + t(
            "{kata} done. Now: {upcoming}",
            kata=kata.id,
            upcoming=f"{upcoming.id} · {upcoming.title}",
        )
    )
    print(
        t(
            "Open {file} and read its lesson (`{lesson}`); `{dojo}` runs its tests.",
            file=f"katas/{upcoming.module}.py",
            lesson=f"{dojo()} lesson",
            dojo=dojo(),
        )
    )
    return 0


def goto(kata: curriculum.Kata) -> int:
    with progress.editing() as state:
        state.focus = kata.id
    named, file = f"{kata.id} · {kata.title}", f"katas/{kata.module}.py"
    if state.is_done(kata):
        print(t("Now: {kata} ({file}); it already passes.", kata=named, file=file))
    else:
        print(
            t(
                "Now: {kata} ({file}); its tests run with `{dojo}`.",
                kata=named,
                file=file,
                dojo=dojo(),
            )
        )
    return 0


def run_kata_program(kata: curriculum.Kata, solutions: bool, args: list[str]) -> int:
    """``dojo run kNN``: the kata's program (``python -m katas.kNN_topic ARGS``)."""
    package = "solutions" if solutions else "katas"
    return foreground([sys.executable, "-m", f"{package}.{kata.module}", *args], curriculum.ROOT)


def _width(text: str) -> int:
    """Columns a label takes on a terminal (a Chinese character takes two)."""
    return sum(2 if ord(c) > 0x2E7F else 1 for c in text)


def lesson(kata: curriculum.Kata) -> int:
    """``dojo lesson [kNN]``: the kata's lesson, in the learner's language."""
    text = curriculum.lesson(kata)
    if text is None:
        print(t("{kata} has no lesson in this language yet.", kata=kata.id) + "\n")
        text = curriculum.lesson(kata, "en") or ""
    print(paint(f"{kata.id} · {kata.title}", "bold") + f"  (katas/{kata.module}.py)\n")
    print(text)
    return 0
