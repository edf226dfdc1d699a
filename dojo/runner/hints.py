"""``dojo hint``: a step's hints in tiers, from a nudge to nearly the answer.

By default the step is the first failing one (from the last test run while the files are
unchanged, else from a fresh run). ``dojo hint`` shows the tiers already seen (at least the
nudge) and never climbs by itself: going further is the learner's choice, ``dojo hint --more``.
"""

from __future__ import annotations

from dojo import curriculum
from dojo.commands import dojo
from dojo.lang import t
from dojo.runner import learn, progress, runs
from dojo.runner.term import fail, paint, wrap


def default_step(kata: curriculum.Kata) -> tuple[int | None, str]:
    """The first failing step, and where that came from."""
    run = progress.fresh_run(progress.load(), kata)
    if run is None:
        print(
            t("Running {kata}'s tests to find the first failing step...", kata=kata.id), flush=True
        )
        result = runs.run_kata(kata, capture=True)
        state = learn.remember(result)
        run = result.summary()
        if result.passed and progress.is_current(state, kata):
            print(
                t(
                    "{kata} passes: it stays your current kata until `{next}`.",
                    kata=kata.id,
                    next=f"{dojo()} next",
                )
            )
    if run.get("exit") == 0:
        return None, "why passes"
    return run.get("step"), "why first failing"


def _said(why: str) -> str:
    """Why this step's hints are shown, as the header says it."""
    return {
        "why first failing": t("the first failing step"),
        "why asked": t("the step asked for"),
        "why passes": t("it passes, so step 1"),
        "why unknown": t("no step could be told apart, so step 1"),
    }[why]


def show(
    kata: curriculum.Kata,
    step: int | None = None,
    level: int | None = None,
    more: bool = False,
    why: str = "why asked",  # a key of _said
    again: str | None = None,
) -> int:
    """Print hints 1..N of a step: N the highest tier seen so far (at least 1), one more with
    ``more``, or ``level``. ``again`` says how to ask for the next tier."""
    if not kata.steps:
        print(
            t(
                "{kata} has no hints yet (its file in dojo/curriculum/ lists no steps).",
                kata=kata.id,
            )
        )
        return 1
    if step is None:
        step, why = default_step(kata)
        if step is None:
            step = kata.steps[0].number
            why = why if why == "why passes" else "why unknown"
    try:
        chosen = kata.step(step)
    except KeyError as error:
        return fail(error.args[0])
    again = again or f"`{dojo()} hint {kata.id} --step {step} --more`"
    seen = progress.load().hints.get(kata.id, {}).get(str(step), 0)
    tiers = len(chosen.hints)
    if level is None:
        level = min(max(seen, 1) + (1 if more and seen else 0), tiers)
    elif not 1 <= level <= tiers:
        return fail(
            t(
                "{kata} step {step} has hint levels 1 to {tiers}, not {level}",
                kata=kata.id,
                step=step,
                tiers=tiers,
                level=level,
            )
        )
    with progress.editing() as state:
        state.hints.setdefault(kata.id, {})[str(step)] = max(seen, level)

    print(
        paint(f"{kata.id} {runs.describe_step(kata, step)}", "bold")
        + t(": hint {level} of {tiers} ({why})", level=level, tiers=tiers, why=_said(why))
    )
    for number, hint in enumerate(chosen.hints[:level], start=1):
        body = "\n".join(wrap(hint, width=100, indent="     ")).lstrip()
        print(f"  {number}. {paint(body, 'cyan') if number == level else body}")
    if level < tiers:
        print(
            t(
                "Stuck still? {again} shows hint {next} of {tiers} (it says more of the answer).",
                again=again,
                next=level + 1,
                tiers=tiers,
            )
        )
    else:
        print(
            t(
                "That was the last hint for this step; `{solution}` compares with the reference.",
                solution=f"{dojo()} solution {kata.id} --diff",
            )
        )
    return 0
