"""How to type our commands in the learner's own shell, so that what we print works as printed:
``dojo`` where it is on the PATH (an activated environment), else the path of the script
``make learn`` installed (``.venv/bin/dojo``), else ``python -m dojo`` with this Python; the same
for ``python`` itself.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


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
    the environment ``make learn`` made; None when it can. ``typed``: the words after ``dojo``."""
    words = " ".join(typed if typed is not None else sys.argv[1:])
    return _problem(("torch", "pytest"), f"{_venv_script('dojo')} {words}", f"dojo {words}")


def require(*needs: str) -> None:
    """Stop a command typed with another Python (``python -m katas.k04_allreduce``, ``pytest``
    from outside the environment) with what ``dojo`` says there, instead of a traceback: how to
    get into the environment. Cheap where ``needs`` are imported already (every rank)."""
    if all(name in sys.modules for name in needs):
        return
    typed = _typed_command()
    inside, plain = typed or (None, None)
    problem = _problem(needs, inside, plain)
    if problem:
        raise SystemExit(f"{(plain or 'python').split()[0]}: {problem}")


def _typed_command() -> tuple[str, str] | None:
    """This process's command line as typed with the environment's Python and as typed once it is
    activated: (``.venv/bin/python -m katas.k04_allreduce --epochs 1``, ``python -m
    katas.k04_allreduce --epochs 1``), the same for ``pytest ...``; None when unknown."""
    argv = list(getattr(sys, "orig_argv", None) or [])
    if "-m" in argv[1:-1]:  # python [options] -m module args
        words = shlex.join(argv[argv.index("-m", 1) + 1 :])
        return f"{_venv_script('python')} -m {words}", f"python -m {words}"
    if os.path.basename(sys.argv[0]) in ("pytest", "py.test"):
        words = shlex.join(sys.argv[1:])
        return f"{_venv_script('python')} -m pytest {words}", f"pytest {words}"
    return None


def _venv_script(name: str) -> str:
    """``.venv/bin/NAME`` as typed from here (relative when below the working directory)."""
    script = _ROOT / ".venv" / ("Scripts" if os.name == "nt" else "bin") / name
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)


def _problem(needs: tuple[str, ...], inside: str | None, plain: str | None) -> str | None:
    import importlib.util

    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    venv = _ROOT / ".venv"
    named = " or ".join(name.replace("_", "-") for name in missing)  # pytest_timeout: a package
    head = f"this Python ({sys.executable}) has no {named}"
    if Path(sys.prefix).resolve() == venv.resolve():
        return (
            f"{head}, though it is the environment `make learn` made: remake it with "
            "`make clean-venv learn`."
        )
    if not (venv / ("Scripts" if os.name == "nt" else "bin") / "dojo").exists():
        return (
            f"{head}: set the project up first with `make learn` (it creates .venv and installs "
            "torch)."
        )
    activate = os.path.relpath(venv / ("Scripts" if os.name == "nt" else "bin") / "activate")
    if inside is None or plain is None:
        return (
            f"{head}: it is not the environment `make learn` made. Use `{_venv_script('python')}`, "
            f"or once per shell `source {activate}`."
        )
    return (
        f"{head}: it is not the environment `make learn` made. Type `{inside.strip()}` instead, or "
        f"once per shell `source {activate}`, then plain `{plain.strip()}`."
    )
