"""Where the learner is: ``.dojo/progress.json`` in the checkout (git ignores ``.dojo/``).

* ``done``: katas whose tests passed, each with the fingerprint of the files it passed with;
* ``focus``: the kata the learner is on, set by ``next``/``goto`` and pinned when the current
  kata passes, so the runner never skips ahead by itself. Without it, the current kata is the
  first one in curriculum order that is not done;
* ``hints``: the highest hint tier shown per kata and step (``dojo hint`` shows the next one);
* ``runs``: the outcome of each kata's last test run (which step fails first, and each test's
  outcome), so ``hint`` and plain ``dojo`` need not run the tests again while the files are
  unchanged.

Every change reloads the file and writes it back atomically, so ``dojo watch`` in one terminal
and ``dojo hint`` in another do not undo each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dojo import curriculum

STATE_DIR = curriculum.ROOT / ".dojo"
STATE_FILE = STATE_DIR / "progress.json"
VERSION = 1


@dataclass
class State:
    done: dict[str, dict] = field(default_factory=dict)
    focus: str | None = None
    hints: dict[str, dict[str, int]] = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)

    def is_done(self, kata: curriculum.Kata) -> bool:
        return kata.id in self.done

    def forget(self, kata: curriculum.Kata) -> None:
        """The kata starts over: pending, no hints seen, no run remembered."""
        for table in (self.done, self.hints, self.runs):
            table.pop(kata.id, None)


def load() -> State:
    try:
        data = json.loads(STATE_FILE.read_text(encoding="utf-8"))
        return State(
            done=dict(data.get("done", {})),
            focus=data.get("focus"),
            hints=dict(data.get("hints", {})),
            runs=dict(data.get("runs", {})),
        )
    except FileNotFoundError:
        return State()
    except (ValueError, TypeError, AttributeError):
        # A damaged file must not lock the learner out: keep it for inspection, start afresh.
        broken = STATE_FILE.with_suffix(".broken.json")
        os.replace(STATE_FILE, broken)
        print(
            f"dojo: {STATE_FILE.name} was damaged; kept as {broken}, starting with no progress",
            file=sys.stderr,
        )
        return State()


def save(state: State) -> None:
    STATE_DIR.mkdir(exist_ok=True)
    temporary = STATE_FILE.with_name(f".progress.{os.getpid()}.tmp")
    temporary.write_text(
        json.dumps({"version": VERSION, **asdict(state)}, indent=2) + "\n", encoding="utf-8"
    )
    os.replace(temporary, STATE_FILE)


@contextlib.contextmanager
def editing() -> Iterator[State]:
    """``with editing() as state:`` load, change, save."""
    state = load()
    yield state
    save(state)


def available(kata: curriculum.Kata) -> bool:
    """A kata can be worked on once its stub and its tests exist (katas are still being written)."""
    return kata.kata_file.exists() and kata.test_file.exists()


def available_katas() -> list[curriculum.Kata]:
    return [k for k in curriculum.katas() if available(k)]


def current(state: State) -> curriculum.Kata | None:
    """The kata the learner is on: the focus, else the first available kata not done."""
    katas = available_katas()
    for kata in katas:
        if kata.id == state.focus:
            return kata
    return next((k for k in katas if not state.is_done(k)), None)


def is_current(state: State | None, kata: curriculum.Kata) -> bool:
    return state is not None and (now := current(state)) is not None and now.id == kata.id


def following(state: State, kata: curriculum.Kata) -> curriculum.Kata | None:
    """The first pending kata after ``kata``, wrapping round to an earlier one left pending."""
    katas = available_katas()
    index = next((i for i, k in enumerate(katas) if k.id == kata.id), -1)
    for candidate in katas[index + 1 :] + katas[: max(index, 0)]:
        if not state.is_done(candidate):
            return candidate
    return None


def status(state: State, kata: curriculum.Kata, now: curriculum.Kata | None) -> str:
    """``done``, ``current``, ``pending`` or ``later`` (its files are not written yet)."""
    if not available(kata):
        return "later"
    if now is not None and kata.id == now.id:
        return "current"
    return "done" if state.is_done(kata) else "pending"


def fingerprint(kata: curriculum.Kata) -> str:
    """What a kata's outcome depends on: its file and those of the katas before it (a kata may
    reuse an earlier one's code, never a later one's), its spec, the pytest set-up, and the kata
    and test API (``dojo/*.py``; not the runner, not the maintainers' catalogues). Unchanged
    fingerprint, unchanged outcome; work on a later kata leaves it alone."""
    root = curriculum.ROOT
    paths = [p for p in sorted((root / "katas").glob("*.py")) if p.stem <= kata.module]
    paths += [kata.test_file, root / "conftest.py", root / "pyproject.toml"]
    paths += [p for p in sorted((root / "tests").glob("*.py")) if not p.name.startswith("test_")]
    paths += sorted((root / "dojo").glob("*.py"))
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with contextlib.suppress(FileNotFoundError):
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def record_run(
    kata: curriculum.Kata,
    passed: bool,
    summary: dict,
    fingerprint_: str,
    records: list[dict] | None = None,
) -> State:
    """Remember a test run of ``kata`` (with ``records``, each test's outcome: what the learner
    was shown) of the files whose ``fingerprint_`` was taken before it ran; mark it done or
    pending. The state as saved: a kata that was current and passed stays current, pinned,
    until the learner moves on."""
    with editing() as state:
        was_current = (now := current(state)) is not None and now.id == kata.id
        state.runs[kata.id] = {**summary, "fingerprint": fingerprint_, "at": _now()}
        if records is not None:
            state.runs[kata.id]["records"] = [_kept(r) for r in records]
        if passed:
            state.done[kata.id] = {"at": _now(), "fingerprint": fingerprint_}
            if was_current:
                state.focus = kata.id
        else:
            state.done.pop(kata.id, None)
    return state


def _kept(record: dict) -> dict:
    """A test's outcome as the progress file keeps it: a failure's text, not a pass's."""
    if record.get("outcome") == "failed":
        return record
    return {k: v for k, v in record.items() if k in ("test", "when", "outcome", "steps", "left")}


def fresh_run(state: State, kata: curriculum.Kata) -> dict | None:
    """The last run of ``kata`` if nothing it depends on changed since."""
    run = state.runs.get(kata.id)
    return run if run and run.get("fingerprint") == fingerprint(kata) else None


def passed_unchanged(state: State, kata: curriculum.Kata) -> bool:
    done = state.done.get(kata.id)
    return bool(done) and done.get("fingerprint") == fingerprint(kata)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def relative(path: Path) -> str:
    return str(path.relative_to(curriculum.ROOT))
