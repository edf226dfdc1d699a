"""``dojo watch`` for real: in a pseudo-terminal, a saved file triggers a re-run, the keys work,
[n] appears only once the kata passes, and [q] during a run leaves no process behind; and Ctrl-C
during ``dojo check`` leaves none either.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from dojo.spec.testing import hears_ctrl_c
from dojo.tests.test_runner import (
    add_stand_in_kata,
    dojo,
    kill_leftovers,
    learner_copy,
    learner_env,
    processes_in,
    set_value,
    wait_for_hang,
    wait_until_gone,
)

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc"), reason="needs /proc to see leftover processes"
)


class Terminal:
    """A program in a pseudo-terminal, and everything it has written so far."""

    def __init__(self, command: list[str], cwd, env):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
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
        raise AssertionError(
            f"dojo watch never printed {missing}; its output since then:\n{self.text[after:][-4000:]}"
        )

    def press(self, key: str) -> None:
        os.write(self.master, key.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        os.close(self.master)


def only_the_watcher(root, terminal: Terminal, seconds: float = 15) -> list[str]:
    """Processes in ``root`` other than dojo watch itself, after waiting for them to go."""
    end = time.monotonic() + seconds
    while True:
        left = [p for p in processes_in(root) if not p.startswith(f"{terminal.process.pid}:")]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_watch_reruns_on_save_offers_next_once_passing_and_moves_on_only_when_asked(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    assert dojo(root, "goto", second).returncode == 0
    terminal = Terminal(
        [sys.executable, "-m", "dojo", "watch", "--interval", "0.2"],
        root,
        learner_env(TERM="xterm"),
    )
    try:
        mark = terminal.wait_for("run 1 (first run)", f"{second}: 0 of 1 tests pass", "keys:")
        assert "[n] next" not in terminal.text, "[n] offered before the kata passes"
        terminal.press("n")
        mark = terminal.wait_for(f"[n] works once {second} passes", after=mark)
        terminal.press("l")
        mark = terminal.wait_for("current  " + second, "k01", after=mark)

        set_value(root, module, 1)
        mark = terminal.wait_for(
            f"run 2 (katas/{module}.py changed)",
            f"{second} passes",
            "[n] next",
            after=mark,
            seconds=90,
        )
        terminal.press("h")
        mark = terminal.wait_for("no hint needed", after=mark)
        terminal.press("r")
        mark = terminal.wait_for("with the shipped stub", "[y/N]", after=mark)
        terminal.press("n")  # no: keep my file
        mark = terminal.wait_for("Nothing was changed.", after=mark)
        assert "VALUE = 1" in (root / "katas" / f"{module}.py").read_text(), (
            "reset without a yes changed the file"
        )

        terminal.press("n")  # only now does it move on, to the kata still pending
        mark = terminal.wait_for(
            "run 3 (moved on to k01)",
            "k01: 0 of",
            "First failing step: step 1",
            after=mark,
            seconds=90,
        )
        terminal.press("q")
        terminal.wait_for("dojo watch stopped.", after=mark, seconds=30)
        assert terminal.process.wait(timeout=30) == 0, "q must end dojo watch with status 0"
        left = wait_until_gone(root)
        assert not left, "dojo watch left processes running after q:\n" + "\n".join(left)
    finally:
        terminal.close()
        kill_leftovers(root)


@pytest.mark.timeout(240)
def test_watch_stops_a_hung_run_when_a_save_restarts_it_and_when_q_quits(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root, value=2)  # its test hangs for 300 s
    assert dojo(root, "goto", second).returncode == 0
    terminal = Terminal(
        [sys.executable, "-m", "dojo", "watch", "--interval", "0.2"],
        root,
        learner_env(TERM="xterm"),
    )
    try:
        mark = terminal.wait_for("run 1 (first run)")
        wait_for_hang(root)

        set_value(
            root, module, 1
        )  # saved while the run hangs: that run is stopped, a new one starts
        mark = terminal.wait_for(
            f"run 2 (katas/{module}.py changed)", f"{second} passes", after=mark, seconds=90
        )
        left = only_the_watcher(root, terminal)
        assert not left, (
            "the hung run was not stopped when a save restarted the tests:\n" + "\n".join(left)
        )

        set_value(root, module, 2)
        mark = terminal.wait_for("run 3", after=mark)
        wait_for_hang(root)
        terminal.press("q")  # quit while the run hangs
        terminal.wait_for("dojo watch stopped.", after=mark, seconds=30)
        assert terminal.process.wait(timeout=30) == 0
        left = wait_until_gone(root)
        assert not left, "q left the hung run's processes behind:\n" + "\n".join(left)
    finally:
        terminal.close()
        kill_leftovers(root)


@pytest.mark.timeout(120)
def test_ctrl_c_during_check_stops_the_tests_and_everything_they_started(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root, value=2)  # its test hangs for 300 s
    spec = root / "tests" / f"test_{module}.py"
    spec.write_text(  # a failure found before the hang: Ctrl-C must not hide it
        "def test_a_first_one():\n    assert False, 'the first test fails on purpose'\n\n\n"
        + spec.read_text()
    )
    check = subprocess.Popen(
        [sys.executable, "-m", "dojo", "check", second],
        cwd=root,
        env=learner_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=hears_ctrl_c,
    )
    try:
        wait_for_hang(root)
        os.kill(check.pid, signal.SIGINT)  # what Ctrl-C does: pytest runs in a session of its own
        output = check.communicate(timeout=30)[0]
        assert check.returncode == 130, (
            f"dojo check ended with {check.returncode} after Ctrl-C:\n{output}"
        )
        assert "the first test fails on purpose" in output, (
            f"Ctrl-C hid the failure already found:\n{output}"
        )
        assert "Interrupted after" in output and "KeyboardInterrupt" not in output, output
        left = wait_until_gone(root, seconds=10)
        assert not left, "Ctrl-C left processes running:\n" + "\n".join(left)
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
            check.wait()
        kill_leftovers(root)


HANGING_KATA = '''"""A stand-in kata whose rank 0 hangs outside torch.distributed (no deadlock to catch)."""
import time


def wait(rank, mark):
    if rank == 0:
        open(mark, "w").close()  # tells the runner's tests it hangs now
        time.sleep(300)
    return rank
'''

HANGING_SPEC = """
from dojo.harness.world import run_world


def _wait(rank, world_size, mark):
    from katas.{module} import wait

    return wait(rank, mark)


def test_a_first_one_passes():
    pass


def test_hangs():
    run_world(_wait, 2, {mark!r}, deadline=120, straggler=120)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_hang_says_where_the_ranks_waited_and_never_reads_as_a_pass(tmp_path):
    root = learner_copy(tmp_path)
    second, module = add_stand_in_kata(root)
    (root / "katas" / f"{module}.py").write_text(HANGING_KATA)
    mark = str(root / "stand-in-hangs")
    (root / "tests" / f"test_{module}.py").write_text(HANGING_SPEC.format(module=module, mark=mark))
    check = subprocess.Popen(
        [sys.executable, "-m", "dojo", "check", second],
        cwd=root, env=learner_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=hears_ctrl_c,
    )  # fmt: skip
    try:
        wait_for_hang(root)
        os.kill(check.pid, signal.SIGINT)
        output = check.communicate(timeout=60)[0]
        assert check.returncode == 130, output
        sleeping = 1 + HANGING_KATA.splitlines().index("        time.sleep(300)")
        assert "Ctrl-C stopped test_hangs:" in output, output
        assert f"rank 0 waits in wait (katas/{module}.py:{sleeping}, wait)" in output, (
            f"Ctrl-C must say where the ranks waited, as a program does:\n{output}"
        )
        assert "1 passed in" not in output and "does not pass yet" in output, (
            f"after Ctrl-C, the tests that passed must not read as the kata passing:\n{output}"
        )
        assert not wait_until_gone(root, seconds=10), "Ctrl-C left processes running"
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
            check.wait()
        kill_leftovers(root)
