"""A mistakes catalogue's swaps: single functions of a kata replaced, in every process of a run.

An instrument of ``dojo.harness.impl`` (``DOJO_INSTRUMENTS=dojo.dev.swaps``). ``DOJO_SUBSTITUTE``
(JSON: ``{"k04_allreduce": {"average_gradients": "module:function"}}``) says what replaces what;
the swap reaches the test process, every rank and a kata's program alike, so the learner's own
spec can be run against a known mistake.
"""

from __future__ import annotations

import importlib
import json
import os
from types import ModuleType
from typing import Any

from dojo.harness import impl

ENV_VAR = "DOJO_SUBSTITUTE"

# What the swaps replaced: (id of the namespace, attribute) -> (namespace, the original), so that a
# rank serving another world (dojo.harness.rank) can put every kata back as it was.
_originals: dict[tuple[int, str], tuple[dict, Any]] = {}


def environment_for(table: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables that swap ``table`` in every process of a run, this instrument named."""
    return {**impl.naming(__name__), ENV_VAR: json.dumps(table)}


def substitutions() -> dict[str, dict[str, str]]:
    return json.loads(os.environ.get(ENV_VAR) or "{}")


def resolve(target: str):
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _swap(namespace: dict, attribute: str, target: str) -> None:
    if attribute in namespace:
        _originals.setdefault((id(namespace), attribute), (namespace, namespace[attribute]))
    namespace[attribute] = resolve(target)


# ------------------------------------------------------------------- the instrument's hooks


def on_kata(module: ModuleType | None) -> None:
    """Swap the functions ``DOJO_SUBSTITUTE`` names in a kata module (or a kata's program)."""
    table = substitutions().get(impl.kata_name_of(module) or "", {})
    for attribute, target in table.items():
        _swap(vars(module), attribute, target)


def on_rank_function(fn) -> None:
    """The same, in the namespace ``fn`` runs in, when it comes from a program's main module: in a
    rank, multiprocessing rebuilds that module from a copy of its namespace, so only the
    function's own globals are the ones its calls see."""
    namespace = getattr(fn, "__globals__", None)
    if namespace is None or namespace.get("__name__") not in ("__main__", "__mp_main__"):
        return
    spec = namespace.get("__spec__")
    name = impl.kata_name_of_spec(spec.name if spec else "")
    for attribute, target in substitutions().get(name or "", {}).items():
        _swap(namespace, attribute, target)


def reset() -> None:
    """Undo every swap made in this process."""
    for (_, attribute), (namespace, original) in _originals.items():
        namespace[attribute] = original
    _originals.clear()


def environment() -> dict[str, str]:
    return {ENV_VAR: os.environ[ENV_VAR]} if os.environ.get(ENV_VAR) else {}


def identity() -> str:
    return os.environ.get(ENV_VAR, "")
