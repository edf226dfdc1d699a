"""Which implementation is under test, and the seam through which maintainers' instruments reach it.

``pytest --solutions`` sets ``DOJO_IMPL=solutions``; rank processes and other tools read the same
variable, so one switch reaches everything: ``katas`` (the learner's, the default),
``solutions`` (the reference), or the shipped stubs the maintainers' gate checks.

The maintainers' gate runs instruments in every process of a run: a mistakes catalogue swaps
single functions of a kata for a mistaken one (``dojo.dev.swaps``), the coverage trace notes what
each test reaches (``dojo.dev.reach``). Learner-facing code must not name them, so they travel as
``DOJO_INSTRUMENTS`` (module names, comma-separated): the harness imports them where a run goes
(the test process, every rank, every kata program, a process the reference starts) and calls their
hooks, each optional:

    start()                 once per process, as the first kata is about to run
    on_kata(module)         a kata module was loaded, or is about to run as a program
    on_rank_function(fn)    a rank is about to run fn (a program's own function, maybe)
    reset()                 a rank serves the next world: undo what the last one changed
    environment() -> dict   what a rank needs besides (the instrument's own variables)
    identity() -> str       what makes a result differ from the plain implementation's
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV_VAR = "DOJO_IMPL"
INSTRUMENTS_VAR = "DOJO_INSTRUMENTS"
PACKAGES = ("katas", "solutions")
SHIPPED = "dojo.dev.shipped"  # the stubs made from solutions/, as katas/ holds them when shipped
IMPLEMENTATIONS = (*PACKAGES, SHIPPED)


def current() -> str:
    """``katas`` (the default), ``solutions`` or the shipped stubs: the package to import."""
    name = os.environ.get(ENV_VAR, "katas") or "katas"
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"{ENV_VAR}={name!r} is not one of {', '.join(IMPLEMENTATIONS)}; unset it or fix it"
        )
    return name


def load_kata(name: str) -> ModuleType:
    """Import kata ``name`` (for example ``"k04_allreduce"``) from the implementation under test."""
    module = importlib.import_module(f"{current()}.{name}")
    on_kata(module)
    return module


def kata_name_of(module: ModuleType | None) -> str | None:
    """``"k04_allreduce"`` for ``katas.k04_allreduce``, ``solutions.k04_allreduce`` or the
    shipped stub (also when it runs as ``__main__``, a program), else None."""
    spec = getattr(module, "__spec__", None)
    return kata_name_of_spec(spec.name if spec else getattr(module, "__name__", ""))


def kata_name_of_spec(dotted: str) -> str | None:
    package, _, name = dotted.rpartition(".")
    return name if package in IMPLEMENTATIONS else None


# ----------------------------------------------------------------------------- the instruments

_started: dict[str, ModuleType] = {}


def instruments() -> list[ModuleType]:
    """The instruments this run names, imported and started (once per process)."""
    names = [n.strip() for n in os.environ.get(INSTRUMENTS_VAR, "").split(",") if n.strip()]
    found = []
    for name in names:
        if name not in _started:
            module = importlib.import_module(name)
            _started[name] = module
            if hasattr(module, "start"):
                module.start()
        found.append(_started[name])
    return found


def naming(instrument: str) -> dict[str, str]:
    """``DOJO_INSTRUMENTS`` as it is, with ``instrument`` (a module's name) added."""
    named = [n for n in os.environ.get(INSTRUMENTS_VAR, "").split(",") if n]
    return {INSTRUMENTS_VAR: ",".join(dict.fromkeys([*named, instrument]))}


def start() -> None:
    """Start the run's instruments in this process (a process the reference itself started)."""
    instruments()


def on_kata(module: ModuleType | None) -> None:
    for instrument in instruments():
        if hasattr(instrument, "on_kata"):
            instrument.on_kata(module)


def on_rank_function(fn) -> None:
    for instrument in instruments():
        if hasattr(instrument, "on_rank_function"):
            instrument.on_rank_function(fn)


def reset() -> None:
    for instrument in _started.values():
        if hasattr(instrument, "reset"):
            instrument.reset()


def environment() -> dict[str, str]:
    """What every rank of a world inherits: the implementation, the instruments and theirs."""
    env = {ENV_VAR: os.environ.get(ENV_VAR, "katas")}
    if os.environ.get(INSTRUMENTS_VAR):
        env[INSTRUMENTS_VAR] = os.environ[INSTRUMENTS_VAR]
        for instrument in instruments():
            if hasattr(instrument, "environment"):
                env.update(instrument.environment())
    return env


def identity() -> tuple[str, ...]:
    """What a kata's result depends on besides its arguments: the implementation under test and
    what the instruments change of it (a catalogue's swap). A cache keyed by it never hands one
    implementation's result to another."""
    changed = [i.identity() for i in instruments() if hasattr(i, "identity")]
    return (current(), *changed)
