"""The kata contract: a stub and its solution offer the same lesson and the same API."""

import importlib
import inspect

import pytest

from dojo import curriculum

KATAS = [k for k in curriculum.katas() if k.kata_file.exists() and k.solution_file.exists()]


def _public(module):
    """Functions and classes the module defines itself (not what it imports), by name."""
    return {
        name: obj for name, obj in vars(module).items()
        if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module.__name__
    }


def _shape(fn):
    """A signature comparable across modules: a default that is a function counts by name."""
    return [
        (p.name, p.kind, getattr(p.default, "__qualname__", p.default), p.annotation)
        for p in inspect.signature(fn).parameters.values()
    ]


@pytest.mark.parametrize("kata", KATAS, ids=[k.id for k in KATAS])
def test_stub_and_solution_share_lesson_names_signatures_and_docstrings(kata):
    stub = importlib.import_module(f"katas.{kata.module}")  # a stub must never fail on import
    solution = importlib.import_module(f"solutions.{kata.module}")
    assert stub.__doc__ == solution.__doc__, f"{kata.id}: the lesson (module docstring) differs"
    ours, theirs = _public(stub), _public(solution)
    assert sorted(ours) == sorted(theirs), f"{kata.id}: public names differ: {sorted(set(ours) ^ set(theirs))}"
    for name in ours:
        if inspect.isfunction(ours[name]):
            assert _shape(ours[name]) == _shape(theirs[name]), f"{kata.id}.{name}: signatures differ"
        assert inspect.getdoc(ours[name]) == inspect.getdoc(theirs[name]), f"{kata.id}.{name}: docstrings differ"
