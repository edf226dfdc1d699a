"""How to type our commands in the learner's own shell, so that what we print works as printed:
``dojo`` where it is on the PATH (an activated environment), else the path of the script
``make learn`` installed (``.venv/bin/dojo``), else ``python -m dojo`` with this Python; the same
for ``python`` itself.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def dojo() -> str:
    return _typed(Path(sys.prefix) / ("Scripts" if os.name == "nt" else "bin") / "dojo", "dojo")


def python() -> str:
    """How to type this Python: ``python`` where that is it, else its path (``.venv/bin/python``)."""
    return _typed(Path(sys.executable), "python")


def _typed(program: Path, name: str) -> str:
    on_path = shutil.which(name)
    if on_path and Path(on_path).absolute() == program.absolute():
        return name
    if not program.exists():
        return (
            f"{_typed(Path(sys.executable), 'python')} -m dojo" if name == "dojo" else str(program)
        )
    relative = os.path.relpath(program)
    return relative if not relative.startswith("..") else str(program)


def environment_problem(typed: list[str] | None = None) -> str | None:
    """Why this Python cannot run the katas (torch or pytest missing), and exactly how to get into
    the environment ``make learn`` made; None when it can."""
    import importlib.util

    missing = [name for name in ("torch", "pytest") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    root = Path(__file__).resolve().parent.parent
    script = root / ".venv" / ("Scripts" if os.name == "nt" else "bin") / "dojo"
    words = " ".join(typed if typed is not None else sys.argv[1:])
    head = f"this Python ({sys.executable}) has no {' or '.join(missing)}"
    if script.exists():
        relative = os.path.relpath(script)
        shown = relative if not relative.startswith("..") else str(script)
        activate = os.path.relpath(script.parent / "activate")
        command, plain = f"{shown} {words}".strip(), f"dojo {words}".strip()
        return (
            f"{head}: it is not the environment `make learn` made. Type `{command}` instead, or "
            f"once per shell `source {activate}`, then plain `{plain}`."
        )
    return (
        f"{head}: set the project up first with `make learn` (it creates .venv and installs torch)."
    )
