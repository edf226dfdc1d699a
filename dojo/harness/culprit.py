"""Whose code an exception came from, and how it was called: the learner's, torch's, or a spec's.

A spec calls a kata's function (in a rank, or in the test process); when that raises, a learner
needs to read which of their functions failed, with which arguments, at which line of their
file, before any traceback: "your ring_all_reduce(tensor=float32[5], world_size=8) raised
IndexError at katas/k09_ring_allreduce.py:123". ``find`` reads that from the traceback while
its frames (and their arguments) are still alive.
"""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass
from types import TracebackType

from dojo.harness import stacks
from dojo.lang import t

_SPECS = os.path.join(stacks.ROOT, "tests") + os.sep
_SHOWN_ARGUMENTS = 4  # more make a line nobody reads
_SHOWN_CHARACTERS = 40  # a value's text beyond this is cut


@dataclass(frozen=True)
class Culprit:
    """Where an exception came from, as a learner reads it."""

    origin: str  # "kata": raised by the kata's own line; "torch": inside a call it made;
    # "library": inside another library it called; "spec": in the spec's own code
    entry: str  # the kata's function the spec called, with its arguments: "f(x=float32[5])"
    file: str  # the kata's innermost line (relative to the checkout)
    line: int
    function: str
    source: str
    callee: str  # origin torch or library: the function it called there ("all_gather")

    def said(self) -> str:
        """One line: whose code raised, called how, where."""
        where = f"{self.file}:{self.line}, in {self.function}"
        if self.origin == "kata":
            return f"your {self.entry} raised it at {where}"
        if self.origin in ("torch", "library"):
            inside = f"{'torch' if self.origin == 'torch' else 'a library'}'s {self.callee}"
            return f"{inside} raised it, called by your {self.entry} at {where}"
        return f"the spec's own code raised it at {where}"


def find(tb: TracebackType | None) -> Culprit | None:
    """The culprit of the exception whose traceback is ``tb``; None when no kata frame and no
    spec frame is in it (the harness's own, or a process of the learner's)."""
    frames = list(traceback.walk_tb(tb))
    if frames and _is_spec(frames[-1][0]):  # raised by the spec itself (an assert, a crash)
        return Culprit("spec", "", *_place(*frames[-1]), "")
    kata = [i for i, (frame, _) in enumerate(frames) if _is_kata(frame.f_code.co_filename)]
    if not kata:
        spec = [(f, n) for f, n in frames if _is_spec(f)]
        return Culprit("spec", "", *_place(*spec[-1]), "") if spec else None
    entry_frame, _ = frames[kata[0]]
    last, line = frames[kata[-1]]
    beyond = [f for f, _ in frames[kata[-1] + 1 :] if not _is_dojo(f.f_code.co_filename)]
    if not beyond:
        origin, callee = "kata", ""
    else:
        in_torch = any(f"{os.sep}torch{os.sep}" in f.f_code.co_filename for f in beyond)
        named = [  # neither torch's decorators nor a spec's own wrapper (that watches a call)
            f.f_code.co_name
            for f in beyond
            if f.f_code.co_name not in _WRAPPERS and not _is_spec(f)
        ]
        origin = "torch" if in_torch else "library"
        callee = named[0] if named else beyond[0].f_code.co_name
    return Culprit(origin, call_text(entry_frame), *_place(last, line), callee)


# The names of the frames torch's decorators add around the function a kata called.
_WRAPPERS = {"wrapper", "inner", "_fn", "decorate_context", "_call_impl", "_wrapped_call_impl"}
_DOJO = os.path.join(stacks.ROOT, "dojo") + os.sep


def _is_spec(frame) -> bool:
    return frame.f_code.co_filename.startswith(_SPECS)


def _is_dojo(path: str) -> bool:
    """The harness's own frames (the call recorder's wrapper around a torch call)."""
    return path.startswith(_DOJO) and not _is_kata(path)


def _is_kata(path: str) -> bool:
    return stacks.Frame(path, 0, "").is_learners


def _place(frame, line: int) -> tuple[str, int, str, str]:
    path = frame.f_code.co_filename
    shown = os.path.relpath(path, stacks.ROOT) if path.startswith(stacks.ROOT) else path
    source = linecache.getline(path, line).strip()
    return shown, line, frame.f_code.co_name, source


def call_text(frame) -> str:
    """``name(arg=value, ...)`` from a live frame: its arguments as they were bound."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = [n for n in code.co_varnames[:count] if n not in ("self", "cls")]
    shown = [f"{n}={describe(frame.f_locals.get(n))}" for n in names[:_SHOWN_ARGUMENTS]]
    if len(names) > _SHOWN_ARGUMENTS:
        shown.append("...")
    owner = frame.f_locals.get("self")
    name = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
    return f"{name}({', '.join(shown)})"


def describe(value: object) -> str:
    """A value as a learner recognises it: a tensor by dtype and shape, a list by what it holds."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the harness always has torch
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"{dtype}[{', '.join(map(str, value.shape))}]{where}"
    if torch is not None and isinstance(value, torch.nn.Module):
        return t("a {type_name}", type_name=type(value).__name__)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value[:2])
        more = ", ..." if len(value) > 2 else ""
        brackets = "[]" if isinstance(value, list) else "()"
        return f"{brackets[0]}{inner}{more}{brackets[1]} ({len(value)})"
    if isinstance(value, dict):
        return t("a dict of {count}", count=len(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= _SHOWN_CHARACTERS else text[: _SHOWN_CHARACTERS - 3] + "..."
    name = type(value).__name__
    if name in ("ProcessGroup", "ProcessGroupGloo", "ProcessGroupNCCL"):
        return t("a process group")
    return t("a {type_name}", type_name=name)
