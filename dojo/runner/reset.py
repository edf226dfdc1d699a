"""``dojo reset``: give the learner the shipped stub back, keeping their own version.

The stub is made afresh from its reference, ``solutions/kNN_topic.py`` (``dojo.curriculum.stubs``),
as it was made for the shipped ``katas/``: no git needed (a learner may have downloaded a zip,
or committed their work) and no copy kept beside it.
"""

from __future__ import annotations

import filecmp
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from dojo import curriculum
from dojo.commands import dojo
from dojo.curriculum import stubs
from dojo.runner import progress
from dojo.runner.term import ask

BACKUP_DIR = progress.STATE_DIR / "backups"


def backup(kata: curriculum.Kata) -> Path:
    """Copy the learner's file to ``.dojo/backups/kNN_topic-YYYYmmdd-HHMMSS.py`` (never overwriting)."""
    BACKUP_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = BACKUP_DIR / f"{kata.module}-{stamp}.py", 1
    while target.exists():
        n += 1
        target = BACKUP_DIR / f"{kata.module}-{stamp}-{n}.py"
    shutil.copy2(kata.kata_file, target)
    return target


def reset(
    katas: list[curriculum.Kata], yes: bool = False, confirm: Callable[[str], bool] | None = None
) -> int:
    """Restore each kata's stub after asking once; 0 when done (or nothing to do), 1 if refused.

    ``confirm`` asks the question (``dojo watch`` asks for a single key); ``yes`` answers it.
    """
    made, missing = {}, []
    for kata in katas:
        try:
            made[kata] = stubs.stub(kata)
        except OSError:
            print(
                f"{kata.id}: solutions/{kata.module}.py, which its stub is made from, is not in "
                "this checkout; nothing reset"
            )
            missing.append(kata)
        except stubs.StubError as error:
            print(f"{kata.id}: its stub cannot be made ({error}); nothing reset")
            missing.append(kata)
    changed = [k for k in made if not _holds(k, made[k])]
    for kata in made:
        if kata not in changed:
            print(f"{kata.id}: katas/{kata.module}.py is already the shipped stub")
    if not changed:
        return 1 if missing else 0
    names = ", ".join(f"katas/{k.module}.py" for k in changed)
    question = f"Replace {names} with the shipped stub (your version is kept in .dojo/backups/)?"
    if not (ask(question, yes) if confirm is None or yes else confirm(question)):
        print("Nothing was changed.")
        return 1
    for kata in changed:
        kept = backup(kata) if kata.kata_file.exists() else None
        stubs.write([kata])
        with progress.editing() as state:
            state.forget(kata)
        where = (
            f"; your version is in {progress.relative(kept)} (`{dojo()} reset {kata.id} --undo` "
            "brings it back)"
            if kept
            else ""
        )
        print(f"{kata.id}: katas/{kata.module}.py is the shipped stub again{where}")
    return 1 if missing else 0


def _holds(kata: curriculum.Kata, stub: str) -> bool:
    return kata.kata_file.exists() and kata.kata_file.read_text("utf-8", "replace") == stub


def backups(kata: curriculum.Kata) -> list[Path]:
    """The kata's backups in ``.dojo/backups/``, oldest first."""
    pattern = re.compile(rf"^{re.escape(kata.module)}-(\d{{8}}-\d{{6}})(?:-(\d+))?\.py$")
    found = []
    for path in BACKUP_DIR.glob(f"{kata.module}-*.py"):
        match = pattern.match(path.name)
        if match:
            found.append(((match.group(1), int(match.group(2) or 1)), path))
    return [path for _, path in sorted(found)]


def undo(kata: curriculum.Kata) -> int:
    """Put the newest backup back in ``katas/`` (the file there is backed up first, so an undo
    can be undone too); 1 when there is none."""
    kept = backups(kata)
    if not kept:
        print(
            f"{kata.id}: there is no backup of katas/{kata.module}.py in .dojo/backups/ to bring back"
        )
        return 1
    newest = kept[-1]
    if kata.kata_file.exists() and filecmp.cmp(newest, kata.kata_file, shallow=False):
        print(f"{kata.id}: katas/{kata.module}.py is already {progress.relative(newest)}")
        return 0
    current = backup(kata) if kata.kata_file.exists() else None
    shutil.copyfile(newest, kata.kata_file)
    newest.unlink()
    with progress.editing() as state:
        state.forget(kata)
    also = f" (the file it replaced is in {progress.relative(current)})" if current else ""
    print(f"{kata.id}: katas/{kata.module}.py is your version from {newest.name} again{also}")
    return 0
