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
        print(f"Running {kata.id}'s tests to find the first failing step...", flush=True)
        result = runs.run_kata(kata, capture=True)
        state = learn.remember(result)
        run = result.summary()
        if result.passed and progress.is_current(state, kata):
            print(f"{kata.id} passes: it stays your current kata until `{dojo()} next`.")
    if run.get("exit") == 0:
        return None, "why passes"
    return run.get("step"), "why first failing"


def show(
    kata: curriculum.Kata,
    step: int | None = None,
    level: int | None = None,
    more: bool = False,
    why: str = "why asked",  # a key of dojo.lang's sentences
    again: str | None = None,
) -> int:
    """Print hints 1..N of a step: N the highest tier seen so far (at least 1), one more with
    ``more``, or ``level``. ``again`` says how to ask for the next tier."""
    if not kata.steps:
        print(f"{kata.id} has no hints yet (its file in dojo/curriculum/ lists no steps).")
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
        return fail(f"{kata.id} step {step} has hint levels 1 to {tiers}, not {level}")
    with progress.editing() as state:
        state.hints.setdefault(kata.id, {})[str(step)] = max(seen, level)

    print(
        paint(f"{kata.id} {runs.describe_step(kata, step)}", "bold")
        + t("hint header", level=level, tiers=tiers, why=t(why))
    )
    for number, hint in enumerate(chosen.hints[:level], start=1):
        body = "\n".join(wrap(hint, width=100, indent="     ")).lstrip()
        print(f"  {number}. {paint(body, 'cyan') if number == level else body}")
    if level < tiers:
        print(t("stuck still", again=again, next=level + 1, tiers=tiers))
    else:
        print(t("last hint", solution=f"{dojo()} solution {kata.id} --diff"))
    return 0
