"""``pytest -p dojo.dev.mistakes.plugin tests/``: the learner's specs, run against every catalogue entry.

Each spec test that a catalogue entry concerns runs once per entry, against the reference with
that entry swapped in (``DOJO_SUBSTITUTE``, which reaches every rank and program too).

A mistake runs as a learner meets it: the spec in file order, from the first test of the
replaced function's step on (a test of an earlier step never reaches a later step's code: a
learner at that step has not written it), until the first failure; the slow tests (real
torchrun, real hosts) only where the entry names them. That first failure is what
``dojo check`` shows in full, so it must be one of the tests the entry names in ``fails`` and say
every text in ``says``; the tests before it pass, as they would for the learner. The other
tests in ``fails`` then run too, and must fail saying the same: each once, in its first case
(another case of a test that already failed would say it again). A right answer's run passes when
the test passes. Every other test is deselected, GPU tests included. A catalogue that names a
test the spec does not have stops the run.

When the gate has recorded what each test's reference run reached (``dojo.dev.reach``, in
``DOJO_REACH_FROM``), a test that never reaches the swapped function is not run again for an
entry (it could only run the reference's code, which passed): it is reported skipped, saying so.

Under xdist a mistake's tests stay together on one worker, in order: ``-n N --dist loadfile``
keeps each spec file on one worker (another ``--dist`` stops the run; ``loadgroup`` cannot
group tests that a plugin parametrizes, and pytest 9.2 ignores its renaming of test ids).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass

import pytest

from dojo import curriculum, lang
from dojo.curriculum import steps
from dojo.dev import mistakes, reach, swaps
from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl
from dojo.spec import report as learners_report

_SPEC = re.compile(r"^test_(k\d\d_\w+)\.py$")
# Where the gate's run of every spec against the reference recorded what each test reached.
FROM_VAR = "DOJO_REACH_FROM"
UNREACHED = "not run again: the reference's own run of this test, which passed, never reaches"


@dataclass(frozen=True)
class Variant:
    kata: curriculum.Kata
    entry: Mistake | RightAnswer

    @property
    def is_mistake(self) -> bool:
        return isinstance(self.entry, Mistake)

    @property
    def id(self) -> str:
        return f"{'mistake' if self.is_mistake else 'right'}={self.entry.name}"

    def __repr__(self) -> str:  # what pytest shows for the parameter
        return self.id


def pytest_configure(config: pytest.Config) -> None:
    os.environ[impl.ENV_VAR] = "solutions"  # entries are swapped into the reference
    os.environ[lang.ENV_VAR] = "en"  # what an entry says is English, whatever the locale
    # A mistake's tests must run in order on one worker (the first failure is what counts).
    dist = getattr(config.option, "dist", "no")
    if dist not in ("no", "loadfile"):
        raise pytest.UsageError(
            f"the mistakes catalogues run each mistake's tests in order on one worker: use "
            f"`-n N --dist loadfile` (or no -n), not --dist {dist}"
        )


def _kata_of(path) -> curriculum.Kata | None:
    match = _SPEC.match(os.path.basename(str(path)))
    if not match or os.path.basename(os.path.dirname(str(path))) != "tests":
        return None
    try:
        return curriculum.find(match.group(1))
    except KeyError:
        return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    kata = _kata_of(metafunc.definition.path)
    catalogue = mistakes.load(kata) if kata else None
    if catalogue is None:
        return
    name = metafunc.function.__name__
    marked = set(steps.of_any_case(metafunc.definition))
    variants = [
        Variant(kata, m)
        for m in catalogue.MISTAKES
        if any(t.split("[")[0] == name for t in m.fails)
        or max(marked, default=0) >= _first_step(kata, m)
    ] + [
        Variant(kata, a)
        for a in catalogue.RIGHT_ANSWERS
        if set(mistakes.right_answer_steps(kata, a)) & marked
    ]
    if variants:
        metafunc.parametrize("dojo_variant", variants, ids=[v.id for v in variants], indirect=True)


def _first_step(kata: curriculum.Kata, mistake: Mistake) -> int:
    """The first step whose tests can meet the mistake: its function's step in the stub."""
    return mistakes.stub_steps(kata).get(mistake.replaces, 1)


@pytest.fixture(autouse=True)
def dojo_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Swap the entry into the reference, here and (through the environment) in every rank."""
    variant = getattr(request, "param", None)
    if variant is not None:
        table = mistakes.swaps(variant.kata, variant.entry)
        # The reference as it is (load_kata would swap already): monkeypatch must keep the
        # originals, so the next test of this worker runs against the reference again.
        module = importlib.import_module(f"solutions.{variant.kata.module}")
        for attribute, target in table.items():
            monkeypatch.setattr(module, attribute, swaps.resolve(target))
        for name, value in swaps.environment_for({variant.kata.module: table}).items():
            monkeypatch.setenv(name, value)
    return variant


def _variant(item: pytest.Item) -> Variant | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("dojo_variant") if callspec else None


def _plain_name(item: pytest.Item, variant: Variant) -> str:
    """The test's name without the variant: ``test_x[4]`` for ``test_x[4-mistake=y]``."""
    if item.name.endswith(f"[{variant.id}]"):
        return item.name[: -len(variant.id) - 2]
    return item.name.replace(f"-{variant.id}", "").replace(f"{variant.id}-", "")


def _named(entry: Mistake, plain: str) -> bool:
    return any(t == plain or t == plain.split("[")[0] for t in entry.fails)


def _wanted(item: pytest.Item, variant: Variant) -> bool:
    if item.get_closest_marker("cuda"):
        return False
    if variant.is_mistake:
        if _named(variant.entry, _plain_name(item, variant)):
            return True
        # a test a learner meets before the named ones: it must pass (or be the first failure);
        # the slow ones (real torchrun, real hosts) run against the reference only, as for a
        # right answer
        if item.get_closest_marker("slow"):
            return False
        return max(steps.of_test(item), default=0) >= _first_step(variant.kata, variant.entry)
    if item.get_closest_marker("slow"):  # a right answer runs its step's quick tests; the slow
        return False  # ones (real torchrun, real hosts) run once, against the reference
    return bool(
        set(steps.of_test(item)) & set(mistakes.right_answer_steps(variant.kata, variant.entry))
    )


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    kept, dropped = [], []
    for item in items:
        variant = _variant(item)
        (kept if variant is not None and _wanted(item, variant) else dropped).append(item)
    # A mistake's tests in file order, together: the learner's order (xdist keeps a file on one
    # worker with --dist loadfile).
    position = {id(item): index for index, item in enumerate(kept)}
    first_of = {}
    for item in kept:
        first_of.setdefault(_variant(item).id + str(item.path), position[id(item)])
    kept.sort(key=lambda item: (first_of[_variant(item).id + str(item.path)], position[id(item)]))
    items[:] = kept
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    if not config.getoption("keyword") and not config.getoption("markexpr"):
        _check_every_entry_runs(items, {_kata_of(item.path) for item in dropped + kept} - {None})


def _check_every_entry_runs(items: list[pytest.Item], katas: set[curriculum.Kata]) -> None:
    """A catalogue entry that selects no test would prove nothing: stop, naming it."""
    ran: dict[tuple[str, str], set[str]] = {}
    for item in items:
        variant = _variant(item)
        ran.setdefault((variant.kata.id, variant.id), set()).add(_plain_name(item, variant))
    problems = []
    for kata in sorted(katas, key=lambda k: k.id):
        catalogue = mistakes.load(kata)
        names = (
            [Variant(kata, e).id for e in (catalogue.MISTAKES + catalogue.RIGHT_ANSWERS)]
            if catalogue
            else []
        )
        problems += [
            f"{kata.id}: two entries are called {n!r}: give each its own name"
            for n in sorted(set(names))
            if names.count(n) > 1
        ]
        for entry in (catalogue.MISTAKES + catalogue.RIGHT_ANSWERS) if catalogue else ():
            found = ran.get((kata.id, Variant(kata, entry).id), set())
            if isinstance(entry, Mistake):
                for wanted in entry.fails:
                    if not any(name == wanted or name.split("[")[0] == wanted for name in found):
                        problems.append(
                            f"{kata.id}: mistake {entry.name!r} names {wanted}, which is not a test in {kata.relative(kata.test_file)}"
                        )
            elif not found:
                problems.append(
                    f"{kata.id}: right answer {entry.name!r} selects no test (no test carries its step)"
                )
    if problems:
        raise pytest.UsageError("mistakes catalogue:\n  " + "\n  ".join(problems))


# A mistake's first failure, per worker (its tests run there together, in order): variant id ->
# the test that failed first; and the tests (without their cases) that ran since, failing.
_first_failure: dict[str, str] = {}
_failed_since: dict[str, set[str]] = {}


@functools.cache
def _reference_reach() -> dict[str, set[str]]:
    """What each test's reference run reached (``dojo.dev.reach``), when the gate recorded it."""
    folder = os.environ.get(FROM_VAR)
    return reach.read(folder) if folder else {}


def _unreached(item: pytest.Item, variant: Variant) -> str | None:
    """The swapped names, when the test's reference run reached none of them (so its run with
    the entry swapped in is the reference's, which passed); else None."""
    plain = f"{item.nodeid.split('::')[0]}::{_plain_name(item, variant)}"
    ran = _reference_reach().get(plain)
    if ran is None:
        return None
    module = importlib.import_module(f"solutions.{variant.kata.module}")
    swapped = set(mistakes.swaps(variant.kata, variant.entry))
    if not all(reach.observable(module, name) for name in swapped):
        return None
    prefix = f"{variant.kata.module}:"
    names = {name[len(prefix) :] for name in ran if name.startswith(prefix)}
    if swapped & reach.reached(module, names):
        return None
    return ", ".join(sorted(swapped))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test the entry can only meet as the reference's run: not run again, said so."""
    variant = _variant(item)
    if variant is None or (
        variant.is_mistake and _named(variant.entry, _plain_name(item, variant))
    ):
        return
    names = _unreached(item, variant)
    if names is not None:
        pytest.skip(f"{UNREACHED}: {names}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """After a mistake's first failure, only the tests its entry names still run."""
    variant = _variant(item)
    if variant is None or not variant.is_mistake:
        return None
    key = f"{variant.kata.id}-{variant.id}"
    plain = _plain_name(item, variant)
    if key in _first_failure and (
        not _named(variant.entry, plain) or _test_of(plain) in _failed_since[key]
    ):
        # the learner never gets here (or this test already said it, in another case): nothing
        # to run, nothing to report; but what the test before kept set up for this one must go,
        # as pytest would after running it
        item.session._setupstate.teardown_exact(nextitem)
        return True
    return None


def _test_of(plain: str) -> str:
    """``test_x`` for ``test_x[4]``: the test, whichever of its cases."""
    return plain.split("[")[0]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: after the learner's compact report
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    variant = _variant(item)
    if variant is None or not variant.is_mistake or call.when != "call" or report.skipped:
        return
    entry, test = variant.entry, _plain_name(item, variant)
    key = f"{variant.kata.id}-{variant.id}"
    first = key not in _first_failure
    named = _named(entry, test)
    if call.excinfo is None:
        if named:
            report.outcome = "failed"
            report.longrepr = (
                f"the mistake {entry.name!r} (in place of {entry.replaces}) PASSED {test}: "
                "the spec does not catch it. Make the test stricter."
            )
        return  # a test before the first failure passes, as it would for the learner
    if first:
        _first_failure[key] = test
    _failed_since.setdefault(key, set()).add(_test_of(test))
    message = str(call.excinfo.value)
    missing = [text for text in entry.says if text not in message]
    if first and not named:
        report.outcome = "failed"
        report.longrepr = (
            f"the mistake {entry.name!r} first fails {test}, not one of {entry.fails}: that is the "
            f"failure `dojo check` shows a learner in full"
            + (
                f", and it does not say {missing}. Make the earlier test name the mistake, or "
                "the named test come first"
                if missing
                else f" (it does say {entry.says}: list it in fails)"
            )
            + f"; it said:\n{call.excinfo.exconly()}"
        )
    elif missing:
        report.outcome = "failed"
        report.longrepr = (
            f"the mistake {entry.name!r} failed {test}"
            + (" (the first failure a learner sees)" if first else "")
            + f", but the message does not say {missing}; it said:\n{call.excinfo.exconly()}"
        )
    elif first and (why := learners_report.raw_reason(call.excinfo)):
        report.outcome = "failed"
        report.longrepr = (
            f"the mistake {entry.name!r} first fails {test}, but a learner would read it raw "
            f"({why}): say it in the kata's words (a check with a message of its own, or an "
            "entry in dojo/harness/known_errors.py for torch's or gloo's text); it said:\n"
            f"{learners_report.said(call.excinfo)}"
        )
    else:
        report.outcome = "passed"
        report.longrepr = None
