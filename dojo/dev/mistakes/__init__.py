"""Mistakes catalogues: the kata tests, tested (maintainers only; a learner never runs these).

``dojo/dev/mistakes/kNN_topic.py`` holds, for one kata, real mistakes a teacher sees in a hundred
submissions and right answers written another way, each a function (or class) that stands in for
one of the kata's own. Its two lists say what must happen when the learner's spec runs against
the reference with that one piece swapped in:

    MISTAKES = [
        Mistake("summed_not_divided", replaces="average_gradients",
                fails=["test_average_gradients_gives_every_rank_the_mean"],
                says=["holds the sum of the 4 ranks' gradients", "divide by the world size"]),
    ]
    RIGHT_ANSWERS = [RightAnswer("with_avg_op", replaces="average_gradients")]

* a mistake must fail every test named in ``fails`` (a bare name: every parametrization of it;
  ``"test_x[4]"``: that one), each with a message holding every text in ``says``;
* a right answer must pass every test of the step it belongs to (the step whose todo the
  replaced function raises in the shipped stub; ``steps=`` overrides), but the slow ones
  (``@pytest.mark.slow``: real torchrun, real hosts), which run against the reference only.

``pytest -p dojo.dev.mistakes.plugin`` runs them (``make test`` does, through ``dojo dev check``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from types import ModuleType

from dojo import curriculum
from dojo.curriculum import steps, stubs


@dataclass
class Mistake:
    name: str  # the function (or class) in the catalogue module
    replaces: str  # the kata's function (or class) it stands in for
    fails: list[str]  # tests that must catch it
    says: list[str]  # what each of those failures must say
    also: dict[str, str] = field(
        default_factory=dict
    )  # further swaps: kata attribute -> catalogue attribute


@dataclass
class RightAnswer:
    name: str
    replaces: str
    steps: tuple[int, ...] = ()  # default: the step of the function it replaces
    also: dict[str, str] = field(default_factory=dict)


def load(kata: curriculum.Kata) -> ModuleType | None:
    """A kata's catalogue module, or None when it has none yet."""
    if not kata.catalogue_file.exists():
        return None
    return importlib.import_module(f"dojo.dev.mistakes.{kata.module}")


def swaps(kata: curriculum.Kata, entry: Mistake | RightAnswer) -> dict[str, str]:
    """The kata attributes an entry replaces -> ``"module:attribute"`` (for ``DOJO_SUBSTITUTE``)."""
    here = f"dojo.dev.mistakes.{kata.module}"
    return {
        entry.replaces: f"{here}:{entry.name}",
        **{a: f"{here}:{b}" for a, b in entry.also.items()},
    }


@functools.cache  # asked for every test of every entry: parse each stub once
def stub_steps(kata: curriculum.Kata) -> dict[str, int]:
    """Function or class name -> the (lowest) step whose todo it raises in the shipped stub."""
    found: dict[str, int] = {}
    for todo in steps.raised(stubs.stub(kata)):
        for name in todo.within:
            found[name] = min(todo.step, found.get(name, todo.step))
    return found


def right_answer_steps(kata: curriculum.Kata, answer: RightAnswer) -> tuple[int, ...]:
    if answer.steps:
        return answer.steps
    step = stub_steps(kata).get(answer.replaces)
    if step is None:
        raise ValueError(
            f"{kata.id} catalogue: right answer {answer.name!r} replaces {answer.replaces!r}, which raises "
            "no todo in the shipped stub: say which steps it must pass (steps=...)"
        )
    return (step,)
