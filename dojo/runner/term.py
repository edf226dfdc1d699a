"""The runner's terminal manners: colour only on a TTY (``NO_COLOR`` honoured), questions that
never block a script (``--yes`` answers them; without a terminal the answer is no).
"""

from __future__ import annotations

import os
import subprocess
import sys

_STYLES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}


def colour_on(stream=None) -> bool:
    """Colour for ``stream`` (stdout by default): a terminal, and no ``NO_COLOR`` (no-color.org)."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, *styles: str, stream=None) -> str:
    if not styles or not colour_on(stream):
        return text
    codes = ";".join(_STYLES[s] for s in styles)
    return f"\033[{codes}m{text}\033[0m"


def bar(done: int, total: int, width: int = 24) -> str:
    """``[██████░░░░░░]``, or ``[######------]`` where the output cannot carry block characters."""
    filled = round(width * done / total) if total else 0
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    full, empty = ("█", "░") if encoding == "utf8" else ("#", "-")
    return "[" + full * filled + empty * (width - filled) + "]"


def ask(question: str, yes: bool = False) -> bool:
    """Ask a yes/no question; ``yes`` (the ``--yes`` flag) answers it.

    Without a terminal the answer is read from stdin as other tools do (``yes | dojo reset k02``);
    nothing to read (``< /dev/null``, a closed pipe) means no.
    """
    if yes:
        print(f"{question} yes (--yes)")
        return True
    interactive = bool(sys.stdin) and sys.stdin.isatty()
    if interactive:
        try:
            answer = input(f"{question} [y/N] ")
        except EOFError:
            answer = ""
    else:
        answer = sys.stdin.readline() if sys.stdin else ""
        shown = answer.strip() or "no: nothing answered on stdin (add --yes to answer yes)"
        print(f"{question} [y/N] {shown}")
    return answer.strip().lower() in ("y", "yes")


def fail(message: str) -> int:
    """Print a usage problem on stderr and return the exit status for it (2, like argparse)."""
    print(f"dojo: {message}", file=sys.stderr)
    return 2


def foreground(command: list[str], cwd) -> int:
    """Run a program as the learner would, showing the command; its exit status.

    Ctrl-C reaches the program too (same terminal), which stops its own ranks: wait for it to.
    """
    from dojo.commands import python

    print("$ " + " ".join([python(), *command[1:]]), flush=True)
    program = subprocess.Popen(command, cwd=cwd)
    try:
        return program.wait()
    except KeyboardInterrupt:
        try:
            return program.wait(timeout=10)
        except subprocess.TimeoutExpired:
            program.kill()
            program.wait()
            return 130


def display_width(text: str) -> int:
    """Columns ``text`` takes on a terminal: a Chinese (wide) character takes two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def wrap(text: str, width: int = 96, indent: str = "") -> list[str]:
    """Lines of at most ``width`` columns: breaks at spaces, or between two wide characters, never
    inside an English word or an identifier (a lone one longer than a line keeps its own line),
    and never before a Chinese comma or full stop."""
    import re

    pieces = re.findall(r"[^\s\u2e80-\uffff]+|[\u2e80-\uffff][，。；：、？！）」』]*|\s+", text)
    lines, line = [], ""
    for piece in pieces:
        if piece.isspace():
            line += " " if line else ""
            continue
        if line and display_width(indent + line + piece) > width:
            lines.append(indent + line.rstrip())
            line = ""
        line += piece
    if line:
        lines.append(indent + line.rstrip())
    return lines or [indent]
