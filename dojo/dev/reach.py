"""Which of a kata's functions each spec test reaches, recorded in every process (maintainers only).

The gate runs every spec against the reference, then again for every catalogue entry with one
function swapped in. A test whose reference run never reached that function runs the same code
with the entry swapped in, so its result is already known (it passed): the catalogue pass need
not run it again (``dojo.dev.mistakes.plugin`` skips it and counts it).

An instrument of ``dojo.harness.impl``: while ``DOJO_INSTRUMENTS`` names it and ``DOJO_REACH_DIR``
is set, every process of the run (the test process, every rank, every program, a process the
reference starts) installs a trace function that notes, per test
(``DOJO_REACH_TEST``, set by this module's pytest hooks and carried into ranks by the harness and
into programs by the environment), the top-level names of the reference modules whose code runs:
``FullyShardedModule`` for any of its methods, ``launch_node`` for it and the functions nested in
it. The trace function sees only the threads Python starts; code that torch or gloo calls back on
threads of their own (a future's callback) is counted through the names the code that ran refers
to (``reached``), which over-counts, never under-counts: a test is skipped only when nothing that
ran could have reached the swapped name.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import types
from pathlib import Path

from dojo.harness import impl

DIR_VAR = "DOJO_REACH_DIR"  # where each process writes what it reached
TEST_VAR = "DOJO_REACH_TEST"  # the test it runs for
_SOLUTIONS = str(Path(__file__).resolve().parents[2] / "solutions") + os.sep

_names: dict[types.CodeType, str] = {}  # code -> "kNN_topic:name", or "" when not the reference's
_written: set[tuple[str, str]] = set()  # (test, name) pairs this process has written


def _name_of(code: types.CodeType) -> str:
    if not code.co_filename.startswith(_SOLUTIONS) or code.co_name == "<module>":
        return ""
    module = Path(code.co_filename).stem
    return f"{module}:{code.co_qualname.split('.')[0]}"


def _trace(frame, event, arg):
    code = frame.f_code
    name = _names.get(code)
    if name is None:
        name = _names[code] = _name_of(code)
    if name:
        test = _environ.get(TEST_VAR, "")
        if test and (test, name) not in _written:
            _written.add((test, name))
            _write(test, name)
    return None  # no line events: a call is all it needs to know


_environ = os.environ  # the trace outlives the os module's globals as the interpreter ends


def _write(test: str, name: str) -> None:
    with open(os.path.join(os.environ[DIR_VAR], f"{os.getpid()}.tsv"), "a") as f:
        f.write(f"{test}\t{name}\n")


def start() -> None:
    """Start noting what runs (an instrument's hook: ``DOJO_INSTRUMENTS`` names this module)."""
    if os.environ.get(DIR_VAR) and sys.gettrace() is None:
        sys.settrace(_trace)
        threading.settrace(_trace)
        atexit.register(sys.settrace, None)


def environment_for(folder: str) -> dict[str, str]:
    """The variables that record, in every process of a run, what each test reaches (in
    ``folder``), this instrument named."""
    return {**impl.naming(__name__), DIR_VAR: folder}


def environment() -> dict[str, str]:
    """What a rank needs to note what it reaches for the test that started it."""
    return {name: os.environ[name] for name in (DIR_VAR, TEST_VAR) if os.environ.get(name)}


# --------------------------------------------------------------------------- pytest hooks
# (``pytest -p dojo.dev.reach``: plain hooks, so that a program importing this needs no pytest)


def pytest_runtest_logstart(nodeid: str, location) -> None:
    """Before the test's setup: what it reaches from here on is its own."""
    if os.environ.get(DIR_VAR):
        os.environ[TEST_VAR] = nodeid
        _write(nodeid, "")  # it ran under recording, even if it reaches nothing


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    os.environ.pop(TEST_VAR, None)


# --------------------------------------------------------------------------- reading it back


def read(folder: str | os.PathLike) -> dict[str, set[str]]:
    """Test node id -> the names its run reached (an empty set: it ran and reached nothing)."""
    found: dict[str, set[str]] = {}
    for path in Path(folder).glob("*.tsv"):
        for line in path.read_text().splitlines():
            test, _, name = line.partition("\t")
            names = found.setdefault(test, set())
            if name:
                names.add(name)
    return found


def _codes(value) -> list[types.CodeType]:
    """The code objects of a function, or of a class's own functions."""
    if isinstance(value, types.FunctionType):
        return [value.__code__]
    if isinstance(value, type):
        codes = []
        for member in vars(value).values():
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, property):
                codes += [f.__code__ for f in (member.fget, member.fset, member.fdel) if f]
            elif isinstance(member, types.FunctionType):
                codes.append(member.__code__)
        return codes
    return []


def _referred(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _referred(const)
    return names


def reached(module: types.ModuleType, names: set[str]) -> set[str]:
    """``names`` (what ran, of ``module``), with every name of ``module`` that the code of what ran
    refers to, again and again: what could have run on a thread the trace did not see."""
    found, todo = set(names), list(names)
    while todo:
        for code in _codes(getattr(module, todo.pop(), None)):
            for name in _referred(code) - found:
                if name in vars(module):
                    found.add(name)
                    todo.append(name)
    return found


def observable(module: types.ModuleType, name: str) -> bool:
    """Whether running ``name`` of ``module`` always shows in the trace: a function of its own
    file, or a class whose construction runs its own code (its ``__init__``) or that is never
    constructed (an autograd Function). A constant, a dataclass or a class built by inherited
    code could be used without a call the trace sees."""
    value = getattr(module, name, None)
    filename = getattr(module, "__file__", None)
    if isinstance(value, types.FunctionType):
        return value.__code__.co_filename == filename
    if not isinstance(value, type) or dataclasses.is_dataclass(value):
        return False
    init = vars(value).get("__init__")
    if isinstance(init, types.FunctionType) and init.__code__.co_filename == filename:
        return True
    import torch

    return issubclass(value, torch.autograd.Function)
