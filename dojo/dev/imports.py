"""Who may import what, checked (``dojo dev check``): the folders of ``dojo`` are its floors.

* kata files (``katas/``, ``solutions/``) import only the kata API (``KATA_API``: the modules at
  the top of ``dojo/``); their packages' ``__init__`` also ``dojo.commands`` (a Python outside
  the environment says how to get in), and the reference's ``dojo.harness.impl`` (a process the
  reference starts runs the gate's instruments too);
* only the runner (``dojo/runner/``, ``dojo/__main__.py`` and the tooling's own tests in
  ``dojo/tests/``) imports the runner;
* nothing a learner runs imports the maintainers' ``dojo/dev/``: only ``dojo/dev/`` itself, the
  runner's hand-over of ``dojo dev`` (``dojo.runner.cli``) and the tooling's tests do (the
  gate's instruments reach every process through ``dojo.harness.impl``, by name);
* no two modules of ``dojo`` import each other, directly or round a circle (imports inside
  functions count: a circle is a design knot even where Python forgives it).
"""

from __future__ import annotations

import ast
from pathlib import Path

from dojo import curriculum

KATA_API = (
    "dojo.console",
    "dojo.data",
    "dojo.devices",
    "dojo.launch",
    "dojo.models",
    "dojo.todo",
    "dojo.toy_models",
)
PACKAGE_API = (*KATA_API, "dojo.commands")  # katas/__init__.py, solutions/__init__.py
# solutions/__init__.py: a process the reference starts runs the gate's instruments too
REFERENCE_PACKAGE_API = (*PACKAGE_API, "dojo.harness.impl")
RUNNER = "dojo.runner"
DEV = "dojo.dev"
DEV_HANDOVER = "dojo.runner.cli"  # `dojo dev ...`: the one place the runner hands over to dojo.dev


def module_name(path: Path) -> str:
    parts = list(path.relative_to(curriculum.ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    """The ``dojo`` modules a file imports, anywhere in it (``from dojo import data`` -> ``dojo.data``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _exists(candidate) else node.module)
    return {name for name in found if name == "dojo" or name.startswith("dojo.")}


def _exists(module: str) -> bool:
    base = curriculum.ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((curriculum.ROOT / folder).rglob("*.py"))]


def problems() -> list[str]:
    found = []
    for path in _python_files("katas", "solutions"):
        allowed = KATA_API
        if path.name == "__init__.py":
            allowed = REFERENCE_PACKAGE_API if path.parent.name == "solutions" else PACKAGE_API
        for name in sorted(imported(path)):
            if name not in allowed:
                found.append(
                    f"{module_name(path)} imports {name}: kata files import only the kata API "
                    f"({', '.join(KATA_API)})"
                )
    for path in _python_files("katas", "solutions", "tests", "benchmarks", "dojo"):
        name = module_name(path)
        if name.startswith((RUNNER, "dojo.tests.")) or name == "dojo.__main__":
            continue
        for target in sorted(imported(path)):
            if _within(target, RUNNER):
                found.append(
                    f"{name} imports {target}: only the runner (dojo/runner/) imports the runner"
                )
    for path in _python_files("katas", "solutions", "tests", "benchmarks", "dojo"):
        name = module_name(path)
        if _within(name, DEV) or name.startswith("dojo.tests.") or name == DEV_HANDOVER:
            continue
        for target in sorted(imported(path)):
            if _within(target, DEV):
                found.append(
                    f"{name} imports {target}: the maintainers' dojo/dev/ is imported only by "
                    f"itself and {DEV_HANDOVER} (`dojo dev`); an instrument reaches the other "
                    "processes through dojo.harness.impl (DOJO_INSTRUMENTS)"
                )
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles()]
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def cycles() -> list[list[str]]:
    """Every import circle among dojo's own modules (its tests aside)."""
    files = [
        p for p in _python_files("dojo") if "tests" not in p.relative_to(curriculum.ROOT).parts
    ]
    return find_cycles({module_name(p): imported(p) for p in files})


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles in an import graph (module -> modules it imports), each reported once. A package
    importing its own submodules, or a submodule its package, is not a circle."""
    graph = {
        name: {t for t in targets if t in graph and t != name and not name.startswith(t + ".")}
        for name, targets in graph.items()
    }
    found, seen, done = [], set(), set()

    def visit(node: str, path: list[str]) -> None:
        for target in sorted(graph[node]):
            if target in path:
                cycle = path[path.index(target) :]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append([*cycle, target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    return found
