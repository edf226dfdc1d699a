"""Which implementation is under test: the learner's ``katas`` or the reference ``solutions``.

``pytest --solutions`` sets ``DOJO_IMPL=solutions``; rank processes and other tools read the same
variable, so one switch reaches everything. The maintainers' gate tests the shipped stubs with
``DOJO_IMPL=dojo.pristine`` (their copies, whatever a learner has written in ``katas/``).

Maintainers' mistakes catalogues (``dojo/mistakes/``) go one step further: ``DOJO_SUBSTITUTE``
swaps single functions of a kata module for a mistaken (or differently written) version, in the
test process, in every rank and in a kata's program alike, so the learner's own spec can be run
against a known mistake.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import ModuleType
from typing import Any

ENV_VAR = "DOJO_IMPL"
SUBSTITUTE_VAR = (
    "DOJO_SUBSTITUTE"  # JSON: {"k04_allreduce": {"average_gradients": "module:function"}}
)
PACKAGES = ("katas", "solutions")
SHIPPED = "dojo.pristine"  # the shipped stubs' copies: what ``katas/`` holds before a learner
IMPLEMENTATIONS = (*PACKAGES, SHIPPED)


def current() -> str:
    """``katas`` (the default), ``solutions`` or ``dojo.pristine``: the package to import."""
    name = os.environ.get(ENV_VAR, "katas") or "katas"
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"{ENV_VAR}={name!r} is not one of {', '.join(IMPLEMENTATIONS)}; unset it or fix it"
        )
    return name


def load_kata(name: str) -> ModuleType:
    """Import kata ``name`` (for example ``"k04_allreduce"``) from the implementation under test."""
    module = importlib.import_module(f"{current()}.{name}")
    apply_substitutions(module)
    return module


def kata_name_of(module: ModuleType | None) -> str | None:
    """``"k04_allreduce"`` for ``katas.k04_allreduce``, ``solutions.k04_allreduce`` or
    ``dojo.pristine.k04_allreduce`` (also when it runs as ``__main__``, a program), else None."""
    spec = getattr(module, "__spec__", None)
    package, _, name = (spec.name if spec else getattr(module, "__name__", "")).rpartition(".")
    return name if package in IMPLEMENTATIONS else None


def substitutions() -> dict[str, dict[str, str]]:
    return json.loads(os.environ.get(SUBSTITUTE_VAR) or "{}")


def resolve(target: str):
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


# What the swaps replaced: (id of the namespace, attribute) -> (namespace, the original), so that a
# rank serving another world (dojo.rank) can put every kata back as it was.
_originals: dict[tuple[int, str], tuple[dict, Any]] = {}


def _swap(namespace: dict, attribute: str, target: str) -> None:
    if attribute in namespace:
        _originals.setdefault((id(namespace), attribute), (namespace, namespace[attribute]))
    namespace[attribute] = resolve(target)


def restore_substitutions() -> None:
    """Undo every swap made in this process."""
    for (_, attribute), (namespace, original) in _originals.items():
        namespace[attribute] = original
    _originals.clear()


def apply_substitutions(module: ModuleType | None = None) -> None:
    """Swap the functions ``DOJO_SUBSTITUTE`` names in ``module`` (default: the running program)."""
    module = module if module is not None else sys.modules.get("__main__")
    table = substitutions().get(kata_name_of(module) or "", {})
    for attribute, target in table.items():
        _swap(vars(module), attribute, target)


def apply_substitutions_for(fn) -> None:
    """The same, in the namespace ``fn`` runs in, when it comes from a program's main module: in a
    rank, multiprocessing rebuilds that module from a copy of its namespace, so only the
    function's own globals are the ones its calls see."""
    namespace = getattr(fn, "__globals__", None)
    if namespace is None or namespace.get("__name__") not in ("__main__", "__mp_main__"):
        return
    spec = namespace.get("__spec__")
    package, _, name = (spec.name if spec else "").rpartition(".")
    if package in IMPLEMENTATIONS:
        for attribute, target in substitutions().get(name, {}).items():
            _swap(namespace, attribute, target)
