"""``dojo watch`` for real: in a pseudo-terminal, a saved file triggers a re-run, the keys work,
[n] appears only once the kata passes, and [q] during a run leaves no process behind.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from tests.test_runner import add_stand_in_kata, dojo, kill_leftovers, learner_copy, learner_env, wait_until_gone

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to see leftover processes")


class Terminal:
    """A program in a pseudo-terminal, and everything it has written so far."""

    def __init__(self, command: list[str], cwd, env):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        self.process = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the program closed the terminal
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, *texts: str, after: int = 0, seconds: float = 60) -> int:
        """Wait until every text has appeared after offset ``after``; the offset of the output then."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seen = self.text[after:]
            if all(t in seen for t in texts):
                return len(self.text)
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        missing = [t for t in texts if t not in self.text[after:]]
        raise AssertionError(f"dojo watch never printed {missing}; its output since then:\n{self.text[after:][-4000:]}")

    def press(self, key: str) -> None:
        os.write(self.master, key.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        os.close(self.master)


@pytest.mark.timeout(240)
def test_watch_reruns_on_save_offers_next_once_passing_and_quits_cleanly(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    assert dojo(root, "goto", second).returncode == 0
    terminal = Terminal([sys.executable, "-m", "dojo", "watch", "--interval", "0.2"], root, learner_env(TERM="xterm"))
    try:
        mark = terminal.wait_for(f"run 1 (first run)", f"{second}: 0 of 1 tests pass", "keys:")
        assert "[n] next" not in terminal.text, "[n] offered before the kata passes"
        terminal.press("n")
        mark = terminal.wait_for(f"[n] works once {second} passes", after=mark)
        terminal.press("l")
        mark = terminal.wait_for("current  " + second, "k01", after=mark)

        (root / "katas" / f"{module}.py").write_text('"""A stand-in kata."""\nVALUE = 1\n')
        mark = terminal.wait_for(f"run 2 (katas/{module}.py changed)", f"{second} passes", "[n] next", after=mark, seconds=90)

        terminal.press("h")
        mark = terminal.wait_for("no hint needed", after=mark)
        terminal.press("r")
        mark = terminal.wait_for("with the shipped stub", "[y/N]", after=mark)
        terminal.press("n")  # no: keep my file
        mark = terminal.wait_for("Nothing was changed.", after=mark)
        assert "VALUE = 1" in (root / "katas" / f"{module}.py").read_text(), "reset without a yes changed the file"

        terminal.press("n")  # on to k01, whose tests start running ...
        mark = terminal.wait_for("run 3 (moved on to k01)", after=mark)
        time.sleep(1.0)
        terminal.press("q")  # ... and quit while they run
        terminal.wait_for("dojo watch stopped.", after=mark, seconds=30)
        assert terminal.process.wait(timeout=30) == 0, "q must end dojo watch with status 0"
        left = wait_until_gone(root)
        assert not left, f"dojo watch left processes running after q:\n" + "\n".join(left)
    finally:
        terminal.close()
        kill_leftovers(root)
