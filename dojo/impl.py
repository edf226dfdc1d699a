"""Which implementation is under test: the learner's ``katas`` or the reference ``solutions``.

``pytest --solutions`` sets ``DOJO_IMPL=solutions``; rank processes and other tools read the same
variable, so one switch reaches everything.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV_VAR = "DOJO_IMPL"
PACKAGES = ("katas", "solutions")


def current() -> str:
    """``katas`` (the default) or ``solutions``."""
    name = os.environ.get(ENV_VAR, "katas") or "katas"
    if name not in PACKAGES:
        raise ValueError(f"{ENV_VAR}={name!r} is not one of {', '.join(PACKAGES)}; unset it or fix it")
    return name


def load_kata(name: str) -> ModuleType:
    """Import kata ``name`` (for example ``"k04_allreduce"``) from the implementation under test."""
    return importlib.import_module(f"{current()}.{name}")
