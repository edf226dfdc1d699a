"""A kata program whose ranks hang: under test it ends within seconds with the report of where
each rank waits; run by a learner it says so and keeps waiting, and Ctrl-C says it again and
leaves nothing behind, whether it hit the program or the pytest running it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dojo.curriculum import ROOT
from dojo.dev import swaps
from dojo.spec.testing import hears_ctrl_c, run_module

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc"), reason="needs /proc to see leftover processes"
)

# The k04 program, with the tutorial's all-reduce swapped for one only rank 0 calls.
HANG = {
    "DOJO_IMPL": "solutions",
    **swaps.environment_for(
        {"k04_allreduce": {"tutorial_allreduce": f"{__name__}:only_rank_0_all_reduces"}}
    ),
}


def only_rank_0_all_reduces(rank, world_size):
    tensor = torch.tensor([rank])
    before = tensor.clone()
    if rank == 0:
        dist.all_reduce(tensor)  # the others never call it: rank 0 waits for ever
    return before, tensor


def both_send_first(rank, world_size):
    peer = 1 - rank
    dist.send(torch.ones(1 << 16), dst=peer)  # gloo's send waits for the matching recv
    dist.recv(torch.ones(1 << 16), src=peer)
    return torch.tensor([rank]), torch.tensor([rank])


BOTH_SEND = {
    "DOJO_IMPL": "solutions",
    **swaps.environment_for(
        {"k04_allreduce": {"tutorial_allreduce": f"{__name__}:both_send_first"}}
    ),
}


def _marked(token: str) -> list[int]:
    """Processes whose environment holds ``DOJO_TEST_TOKEN=token`` (the program and its ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"DOJO_TEST_TOKEN={token}".encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _gone(token: str, seconds: float = 15) -> list[int]:
    end = time.monotonic() + seconds
    while (left := _marked(token)) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _wait_for(token: str, count: int, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while len(_marked(token)) < count:
        assert time.monotonic() < end, f"the program never started its {count - 1} ranks"
        time.sleep(0.1)


# A program under test is forked from the harness's forkserver, unless the test gives it an
# environment of its own (or DOJO_FRESH_PROGRAMS=1): then it is a new interpreter. Both must end
# a hang the same way.
WAYS = ("forked", "fresh")


def _run_hanging(way: str, monkeypatch, environment: dict, *args: str):
    if way == "fresh":
        return run_module("solutions.k04_allreduce", *args, env=environment)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return run_module("solutions.k04_allreduce", *args)


@pytest.mark.parametrize("way", WAYS)
def test_a_hung_program_under_test_ends_within_seconds_saying_where_each_rank_waits(
    way, monkeypatch
):
    with pytest.raises(AssertionError) as caught:
        _run_hanging(
            way, monkeypatch, HANG, "--world-size", "4", "--backend", "gloo", "--device", "cpu"
        )
    message = str(caught.value)
    # Ended by its seconds without progress, not by run_module's timeout (start-up on a loaded
    # machine takes what it takes: that is not the hang's time).
    assert "made no progress for 5 s" in message, message
    assert " -m solutions.k04_allreduce --world-size 4" in message, (
        message
    )  # however python is named
    assert "hung: its ranks stopped making progress" in message, message
    assert "rank 0 waits in all_reduce (solutions/k04_allreduce.py:" in message, message
    assert "ranks 1, 2, 3 wait in barrier (solutions/k04_allreduce.py:" in message, message


def test_a_program_whose_ranks_both_send_first_is_told_about_sends_not_collectives(monkeypatch):
    with pytest.raises(AssertionError) as caught:
        _run_hanging(
            "forked", monkeypatch, BOTH_SEND,
            "--world-size", "2", "--backend", "gloo", "--device", "cpu",
        )  # fmt: skip
    message = str(caught.value)
    assert "ranks 0, 1 wait in send (solutions/k04_allreduce.py:" in message, message
    assert "returns only once its peer has made the matching call" in message, message
    assert "collective" not in message.split("\n")[1], message


def test_a_learners_hung_program_says_where_ranks_wait_and_ctrl_c_says_it_again(tmp_path):
    token = f"program-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, **HANG, "DOJO_HANG_REPORT_S": "2", "DOJO_TEST_TOKEN": token}
    env.pop("DOJO_HANG_FAILS", None)
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        program = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "solutions.k04_allreduce",
                "--world-size",
                "3",
                "--backend",
                "gloo",
                "--device",
                "cpu",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=hears_ctrl_c,
        )
    try:
        end = time.monotonic() + 60
        while "no progress for" not in err.read_text():
            assert time.monotonic() < end and program.poll() is None, (
                f"no report of the hang:\n{err.read_text()}"
            )
            time.sleep(0.2)
        assert program.poll() is None, "the report must not stop the program: it keeps waiting"
        report = err.read_text()
        assert "[main] no progress for 2 s: rank 0 waits in all_reduce" in report, report
        assert "ranks 1, 2 wait in barrier" in report and "Ctrl-C stops every rank" in report, (
            report
        )
        os.killpg(program.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert program.wait(timeout=30) == 130
        said = err.read_text()[len(report) :]
        assert "[main] interrupted: rank 0 waits in all_reduce" in said, said
    finally:
        if program.poll() is None:
            os.killpg(program.pid, signal.SIGKILL)
    assert _gone(token) == [], "the program's ranks outlived Ctrl-C"


TEST_FILE = """
import dojo.spec.testing
from dojo.spec.testing import run_module

def test_hangs(monkeypatch):
    monkeypatch.setattr(dojo.spec.testing, "PROGRAM_HANG_S", 600.0)  # it hangs until pytest ends
    run_module("solutions.k04_allreduce", "--world-size", "2", "--backend", "gloo", "--device", "cpu", timeout=300)
"""


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    "how, ending",
    [
        ("ctrl-c", "Ctrl-C on pytest left the program under test running"),
        ("kill -9", "a program outlived the pytest process that ran it"),
    ],
)
def test_a_program_under_test_ends_with_its_pytest_however_pytest_ends(tmp_path, how, ending, way):
    token = f"pytest-{os.getpid()}-{time.monotonic_ns()}"
    (tmp_path / "test_hanging_program.py").write_text(TEST_FILE)
    fresh = {"DOJO_FRESH_PROGRAMS": "1" if way == "fresh" else "0"}
    pytest_run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
         "-c", str(ROOT / "pyproject.toml"), str(tmp_path / "test_hanging_program.py")],
        cwd=ROOT,
        env={**os.environ, **HANG, **fresh, "DOJO_TEST_TOKEN": token, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=hears_ctrl_c,
    )  # fmt: skip
    try:
        _wait_for(token, 5)  # pytest, a forkserver, the program and its 2 ranks
        if how == "ctrl-c":
            time.sleep(1)
            os.killpg(
                pytest_run.pid, signal.SIGINT
            )  # the terminal's Ctrl-C reaches pytest's group only
        else:
            os.kill(pytest_run.pid, signal.SIGKILL)  # no clean-up code runs in pytest
        pytest_run.wait(timeout=60)
    finally:
        if pytest_run.poll() is None:
            os.killpg(pytest_run.pid, signal.SIGKILL)
    assert _gone(token) == [], f"{ending} ({way})"
