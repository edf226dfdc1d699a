"""``dojo watch``: re-run the current kata's tests every time a file in ``katas/`` is saved.

Saves are noticed by polling modification times (every 0.5 s by default), the one mechanism
that works everywhere without a dependency: file events do not arrive on WSL's Windows drives,
network drives or some editors' atomic saves, and stat-ing a dozen files twice a second costs
nothing. Keys: [n]ext (only once the kata passes: the watcher never moves on by itself),
[h]int (the tiers seen so far), [m]ore (one hint tier further), [l]ist, [r]eset (asks
first), [c]heck again, [q]uit. A save during a run restarts it;
quitting stops pytest and everything it started.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from dojo import curriculum
from dojo.lang import t
from dojo.runner import hints, learn, progress, reset, runs
from dojo.runner.term import paint


def keys_help(passed: bool = False) -> str:
    """The keys the watcher answers, as its prompt lists them."""
    said = t("keys: [h] hint  [m] more hint  [l] list  [r] reset  [c] check again  [q] quit")
    return said + (t("  [n] next") if passed else "")


class Keys:
    """Single key presses from stdin, without waiting for Enter, and never blocking for long."""

    def __init__(self):
        self.fd = sys.stdin.fileno() if sys.stdin else -1
        self.saved = None
        self.closed = self.fd < 0

    def __enter__(self) -> Keys:
        if os.name == "posix" and not self.closed and os.isatty(self.fd):
            import termios
            import tty

            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)  # keys arrive one by one, unechoed; Ctrl-C still interrupts
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def read(self, timeout: float) -> str | None:
        """The next key, or None after ``timeout`` seconds."""
        if os.name == "nt":  # pragma: no cover - Windows consoles
            import msvcrt

            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if msvcrt.kbhit():
                    return msvcrt.getwch()
                time.sleep(0.05)
            return None
        if self.closed:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        data = os.read(self.fd, 1)
        if not data:  # stdin ended (a script, /dev/null): keep watching, without keys
            self.closed = True
            return None
        return data.decode(errors="ignore")


def snapshot() -> dict[str, tuple[int, int]]:
    found = {}
    for path in (curriculum.ROOT / "katas").glob("*.py"):
        try:
            info = path.stat()
        except FileNotFoundError:  # an editor replacing the file
            continue
        found[path.name] = (info.st_mtime_ns, info.st_size)
    return found


class Watcher:
    def __init__(self, kata: curriculum.Kata, keys: Keys, interval: float = 0.5, yes: bool = False):
        self.kata, self.keys, self.interval, self.yes = kata, keys, interval, yes
        self.running: runs.Running | None = None
        self.last: runs.RunResult | None = None
        self.files = snapshot()
        self.runs = 0

    def loop(self) -> int:
        self.start(t("first run"))
        while True:
            key = self.keys.read(self.interval)
            if self.running is not None and self.running.done():
                self.finish()
            changed = self.changes()
            if changed:
                named = ", ".join("katas/" + name for name in changed)
                self.start(t("{files} changed", files=named))
            if key:
                code = self.on_key(key.lower())
                if code is not None:
                    return code

    def changes(self) -> list[str]:
        now = snapshot()
        if now == self.files:
            return []
        time.sleep(0.2)  # let the editor finish writing before the tests read the file
        now = snapshot()
        changed = sorted(
            name for name in set(now) | set(self.files) if now.get(name) != self.files.get(name)
        )
        self.files = now
        return changed

    def start(self, why: str) -> None:
        self.stop()
        self.runs += 1
        if sys.stdout.isatty():
            print("\033[2J\033[H", end="")
        heading = t(
            "dojo watch · {kata} · {title} · run {number} ({why})",
            kata=self.kata.id,
            title=self.kata.title,
            number=self.runs,
            why=why,
        )
        print(paint(heading, "bold"))
        said = t(
            "Save {file} and its tests run again (checked every {seconds} s).",
            file=f"katas/{self.kata.module}.py",
            seconds=f"{self.interval:g}",
        )
        print(said + "\n", flush=True)
        self.last = None
        self.running = runs.Running(self.kata)

    def finish(self) -> None:
        result, self.running = self.running.result(), None
        state = learn.remember(result)
        self.last = result
        digest = result.digest()
        print(("\n" + digest) if digest else "")
        print(paint(result.describe(), "green" if result.passed else "red"))
        if result.passed:
            upcoming = progress.following(state, self.kata)
            after = (
                t("[n] next: {kata}", kata=f"{upcoming.id} · {upcoming.title}")
                if upcoming
                else t("every kata written so far passes")
            )
            print(paint(after, "green"))
        print(keys_help(result.passed), flush=True)

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None

    def on_key(self, key: str) -> int | None:
        if key == "q":
            self.stop()
            print(t("dojo watch stopped."))
            return 0
        if key in ("h", "m"):
            self.hint(more=key == "m")
        elif key == "l":
            print("\n" + learn.progress_view(progress.load()))
        elif key == "r":
            reset.reset(
                [self.kata], yes=self.yes, confirm=self.confirm
            )  # the save triggers the run
        elif key in ("c", "\n", "\r"):
            self.start(t("checked again"))
        elif key == "n":
            self.next()
        elif not key.isspace():
            print(keys_help(bool(self.last and self.last.passed)))
        sys.stdout.flush()
        return None

    def hint(self, more: bool = False) -> None:
        if self.last is None:
            print("\n" + t("The tests are still running: press h again once they finish."))
            return
        if self.last.passed:
            print("\n" + t("{kata} passes: no hint needed. [n] moves on.", kata=self.kata.id))
            return
        step = self.last.first_failing_step()
        if step is None and self.kata.steps:
            step, why = self.kata.steps[0].number, "why unknown"
        else:
            why = "why first failing"
        print()
        hints.show(self.kata, step, more=more, why=why, again="[m]")

    def next(self) -> None:
        if not (self.last and self.last.passed):
            print(
                "\n"
                + t(
                    "[n] works once {kata} passes: the watcher never moves on by itself.",
                    kata=self.kata.id,
                )
            )
            return
        upcoming = progress.following(progress.load(), self.kata)
        if upcoming is None:
            print("\n" + t("Every kata written so far passes. [q] quits."))
            return
        with progress.editing() as state:
            state.focus = upcoming.id
        self.kata = upcoming
        self.start(t("moved on to {kata}", kata=upcoming.id))

    def confirm(self, question: str) -> bool:
        print(f"\n{question} [y/N] ", end="", flush=True)
        key = self.keys.read(60.0) or ""
        print(key.strip())
        return key.lower() == "y"


def watch(interval: float = 0.5, yes: bool = False) -> int:
    kata = progress.current(progress.load())
    if kata is None:
        return learn.start()
    # A closed terminal or a plain kill must also stop the tests the watcher started.
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, _interrupt)
    with Keys() as keys:
        watcher = Watcher(kata, keys, interval, yes)
        try:
            return watcher.loop()
        except KeyboardInterrupt:
            watcher.stop()
            print("\n" + t("dojo watch stopped."))
            return 130


def _interrupt(signum, frame):
    raise KeyboardInterrupt
