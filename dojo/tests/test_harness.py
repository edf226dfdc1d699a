"""The rank harness's own tests: what every kata test relies on."""

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dojo.curriculum import ROOT
from dojo.dev import swaps
from dojo.harness import impl, world
from dojo.harness.world import RankCrashed, RankFailed, WorldDeadlock, run_world
from dojo.spec.testing import hears_ctrl_c
from dojo.todo import KataTodo


def _identify(rank, world_size, extra):
    value = torch.tensor([rank])
    dist.all_reduce(value)
    env = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])
    return {
        "rank": dist.get_rank(),
        "size": dist.get_world_size(),
        "sum": int(value),
        "env": env,
        "extra": extra,
        "pid": os.getpid(),
    }


def _warm():
    """Start this process's forkserver (it imports torch: long on a loaded machine) before a
    test times how fast the harness itself reacts."""
    run_world(_identify, 1, None)


def test_a_passing_world_returns_every_result_in_rank_order():
    results = run_world(_identify, 4, "x")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["size"] == 4 and r["sum"] == 6 and r["extra"] == "x" for r in results)
    assert [r["env"] for r in results] == [(str(i), "4", str(i)) for i in range(4)]
    assert len({r["pid"] for r in results}) == 4
    _assert_gone_or_waiting([r["pid"] for r in results])


def _assert_gone_or_waiting(pids):
    """The ranks of a world that passed end, or wait for this process's next world (and end
    with it)."""
    waiting = {r.process.pid for r in world._idle}
    _assert_gone([p for p in pids if p not in waiting])
    world.end_idle_ranks()
    _assert_gone(pids)


def _leave_traces(rank, world_size, how):
    """A world that changes what the next world must not see; ``how`` adds one change that
    cannot be put back, so that the rank must not serve again."""
    global _LEFT_IN_THIS_MODULE
    _LEFT_IN_THIS_MODULE = "yes"
    os.environ["DOJO_TEST_LEFT"] = "yes"
    os.chdir("/")
    torch.manual_seed(rank + 123)
    if how == "thread":
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    elif how == "dtype":
        torch.set_default_dtype(torch.float64)
    elif how == "patched":
        dist.barrier = print
    elif how == "child":
        subprocess.Popen(["sleep", "60"])
    elif how == "hook":
        torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    elif how == "dtensor":  # its plans stay cached under a mesh equal to a later world's
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,))
        (distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]) * 2).full_tensor()
    return os.getpid()


_LEFT_IN_THIS_MODULE = None


def _look(rank, world_size):
    """What a world sees of the process it runs in."""
    return {
        "left": os.environ.get("DOJO_TEST_LEFT"),
        "module": _LEFT_IN_THIS_MODULE,
        "cwd": os.getcwd(),
        "torch": torch.rand(2).tolist(),
        "dtype": str(torch.get_default_dtype()),
        "barrier": dist.barrier.__name__,
        "kata": impl.load_kata("k04_allreduce").average_gradients.__module__,
        "pid": os.getpid(),
    }


def _fresh_look(monkeypatch):
    monkeypatch.setenv(world.FRESH_VAR, "1")
    looks = run_world(_look, 2)
    monkeypatch.delenv(world.FRESH_VAR)
    for look in looks:
        del look["pid"]
    return looks


def test_a_rank_serves_the_next_world_as_it_was_forked(monkeypatch):
    """Reused ranks save a fork and an exit per rank; the next world must not see the last."""
    monkeypatch.setenv(impl.ENV_VAR, "solutions")
    fresh = _fresh_look(monkeypatch)
    world.end_idle_ranks()
    swap = {
        "k04_allreduce": {"average_gradients": "dojo.dev.mistakes.k04_allreduce:summed_not_divided"}
    }
    for name, value in swaps.environment_for(swap).items():
        monkeypatch.setenv(name, value)
    before = run_world(_leave_traces, 2, None)
    assert run_world(_look, 2)[0]["kata"] == "dojo.dev.mistakes.k04_allreduce"
    monkeypatch.delenv(swaps.ENV_VAR)
    looks = run_world(_look, 2)
    assert {look.pop("pid") for look in looks} == set(before), "the ranks were not reused"
    assert looks == fresh


@pytest.mark.parametrize("how", ["thread", "dtype", "patched", "child", "hook", "dtensor"])
def test_a_rank_that_cannot_be_put_back_does_not_serve_again(monkeypatch, how):
    monkeypatch.setenv(impl.ENV_VAR, "solutions")
    fresh = _fresh_look(monkeypatch)
    before = run_world(_leave_traces, 2, how)
    looks = run_world(_look, 2)
    assert not {look.pop("pid") for look in looks} & set(before), (
        f"a rank left a {how} served again"
    )
    assert looks == fresh
    _assert_gone(before)


def test_a_world_of_one_works():
    assert run_world(_identify, 1, None)[0]["sum"] == 0


def _pid_file(tmp_path, rank):
    return tmp_path / f"rank{rank}.pid"


def _write_pid(tmp_path, rank):
    _pid_file(tmp_path, rank).write_text(str(os.getpid()))


def _read_pids(tmp_path, world_size):
    """The pids the ranks have written so far (a file a rank is still writing is not one yet)."""
    texts = [_pid_file(tmp_path, r) for r in range(world_size)]
    texts = [path.read_text().strip() for path in texts if path.exists()]
    return [int(text) for text in texts if text.isdigit()]


def _assert_gone(pids, within=5.0):
    end = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    assert not alive, f"processes {alive} outlived their world"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _raise_on_rank_one(rank, world_size, tmp_path):
    _write_pid(tmp_path, rank)
    print(f"rank {rank} is about to work")
    if rank == 1:
        time.sleep(0.2)
        raise ValueError("rank one fails on purpose")
    time.sleep(60)


def test_a_raising_rank_is_named_with_its_traceback_and_its_peers_stop_at_once(tmp_path):
    _warm()
    start = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        run_world(_raise_on_rank_one, 3, tmp_path, deadline=60)
    assert time.monotonic() - start < 30, "the peers of a failed rank must be stopped at once"
    message = str(caught.value)
    assert caught.value.rank == 1
    assert "rank 1 raised ValueError: rank one fails on purpose" in message
    assert "_raise_on_rank_one" in message and "test_harness.py" in message, (
        "the traceback is missing"
    )
    assert "rank 1 is about to work" in message, "the failing rank's output is missing"
    _assert_gone(_read_pids(tmp_path, 3))


def _only_rank_zero_all_reduces(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return rank


def test_a_deadlock_names_the_stuck_rank_and_where_it_waits():
    _warm()
    start = time.monotonic()
    with pytest.raises(WorldDeadlock) as caught:
        run_world(_only_rank_zero_all_reduces, 3, deadline=60, straggler=2)
    assert time.monotonic() - start < 30, "the straggler window, not the deadline, should end this"
    assert caught.value.stuck == [0]
    message = str(caught.value)
    assert "rank 0 is waiting here" in message
    assert "dist.all_reduce(torch.ones(1))" in message, (
        f"the stuck line is missing from:\n{message}"
    )
    assert "rank(s) 1, 2" in message, "the report should say which ranks had finished"
    assert "rank 0 waits in all_reduce (dojo/tests/test_harness.py:" in message, message
    assert "_only_rank_zero_all_reduces); ranks 1, 2 returned" in message, message


def _broadcast_or_all_reduce(rank, world_size):
    if rank == 0:
        dist.broadcast(torch.ones(1), src=0)
    else:
        dist.all_reduce(torch.ones(1))
    return rank


def test_ranks_in_different_collectives_are_named_as_such():
    with pytest.raises(WorldDeadlock) as caught:
        run_world(_broadcast_or_all_reduce, 3, deadline=4)
    message = str(caught.value)
    assert "rank 0 waits in broadcast (dojo/tests/test_harness.py:" in message, message
    assert "ranks 1, 2 wait in all_reduce (" in message, message
    assert "the ranks called different collectives (all_reduce, broadcast)" in message, message


def _everyone_receives_first(rank, world_size, tmp_path):
    _write_pid(tmp_path, rank)
    buffer = torch.zeros(1)
    dist.recv(buffer, src=(rank + 1) % world_size)  # nobody ever sends
    return rank


def test_a_world_where_every_rank_is_stuck_ends_at_the_deadline(tmp_path):
    with pytest.raises(WorldDeadlock) as caught:
        run_world(_everyone_receives_first, 2, tmp_path, deadline=3)
    assert caught.value.stuck == [0, 1]
    message = str(caught.value)
    assert "ranks 0, 1 wait in recv (dojo/tests/test_harness.py:" in message, message
    # One stack for ranks stuck alike (the advice before it quotes the line too, unindented).
    stacks = message.count("\n    dist.recv(buffer")
    assert stacks == 1, f"one stack for ranks stuck alike:\n{message}"
    assert "ranks 0, 1 are waiting here" in message, message
    _assert_gone(_read_pids(tmp_path, 2))
    # The next world works.
    assert [r["sum"] for r in run_world(_identify, 2, None)] == [1, 1]


def _receive_from_the_next(rank, world_size):
    dist.recv(torch.zeros(1), src=(rank + 1) % world_size)  # nobody sends: every rank waits


def test_a_wait_where_an_earlier_world_deadlocked_ends_at_once():
    with pytest.raises(WorldDeadlock):
        run_world(_receive_from_the_next, 2, deadline=3)  # at its deadline: remembered
    start = time.monotonic()
    with pytest.raises(WorldDeadlock) as again:
        run_world(_receive_from_the_next, 2, deadline=120)
    assert time.monotonic() - start < 20, "a known deadlock must not wait out the deadline again"
    message = str(again.value)
    assert "where an earlier test's ranks deadlocked" in message, message
    assert "ranks 0, 1 wait in recv (dojo/tests/test_harness.py:" in message, message


# Each stall test waits at a line of its own: a line where an earlier world deadlocked ends the
# next world there after KNOWN_STALL_S, whatever its stall says.
def _receive_then_stall_2_s(rank, world_size):
    dist.recv(torch.zeros(1), src=(rank - 1) % world_size)


def _receive_then_stall_by_default(rank, world_size):
    dist.recv(torch.zeros(1), src=(rank - 1) % world_size)


def _receive_in_a_group_of_its_own(rank, world_size):
    dist.recv(torch.zeros(1), src=(rank - 1) % world_size)


@pytest.mark.parametrize(
    "stall, fn",
    [(2, _receive_then_stall_2_s), ("auto", _receive_then_stall_by_default)],
    ids=["stall=2", "stall=auto"],
)
def test_stall_ends_a_deadlock_seconds_after_the_ranks_stop(stall, fn):
    """By default a world in the harness's group is deadlocked once its ranks have waited idle
    in torch.distributed for DEFAULT_STALL_S (3 s): only the group's timeout could move them."""
    _warm()
    start = time.monotonic()
    with pytest.raises(WorldDeadlock) as caught:
        run_world(fn, 2, deadline=120, stall=stall)
    assert time.monotonic() - start < 30, "ranks idle in recv for seconds are deadlocked"
    assert "made no progress for" in str(caught.value), str(caught.value)


def _gather_a_dtensor_that_no_peer_gathers(rank, world_size):
    """Rank 0 waits in DTensor's full_tensor (a functional collective, beneath torch's op
    dispatch: a comparison world's torch side), rank 1 in a recv that nothing sends."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    if rank == 0:
        DTensor.from_local(torch.ones(2), mesh, [Shard(0)]).full_tensor()
    else:
        dist.recv(torch.zeros(1), src=0)


def test_stall_ends_a_deadlock_inside_torch_s_own_collectives():
    """A rank idle in a functional collective's wait (DTensor, FSDP2, a spec's comparison with
    torch) waits inside torch.distributed too: reported in seconds, not at the deadline."""
    _warm()
    start = time.monotonic()
    with pytest.raises(WorldDeadlock) as caught:
        run_world(_gather_a_dtensor_that_no_peer_gathers, 2, deadline=120)
    assert time.monotonic() - start < 60, f"it waited for its deadline: {caught.value}"
    assert "made no progress for" in str(caught.value), str(caught.value)
    assert "rank 0 waits in wait_tensor" in str(caught.value), str(caught.value)


def _receive_in_own_group(rank, world_size, path):
    """A world that makes its own group (as katas 01-03 do), then waits in it for ever."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    _receive_in_a_group_of_its_own(rank, world_size)


def test_worlds_in_a_group_of_their_own_wait_for_their_deadline(tmp_path):
    """Their calls may time out by themselves (the group's timeout is theirs): no stall."""
    _warm()
    start = time.monotonic()
    with pytest.raises(WorldDeadlock) as caught:
        run_world(
            _receive_in_own_group, 2, str(tmp_path / "rendezvous"), deadline=8, init_group=False
        )
    assert time.monotonic() - start >= 8, f"it ended before its deadline: {caught.value}"
    assert "did not return within the 8 s deadline" in str(caught.value), str(caught.value)


def _sleep_then_return(rank, world_size, seconds):
    time.sleep(seconds)  # idle, but not inside a torch.distributed call: not a deadlock
    dist.barrier()
    return rank


def test_idle_ranks_outside_torch_distributed_are_not_taken_for_a_deadlock():
    assert run_world(_sleep_then_return, 2, 4.0, deadline=30, stall=1) == [0, 1]


def _spin(rank, world_size, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return rank


def test_a_deadline_stretches_while_ranks_still_compute_and_a_busy_loop_still_ends():
    # A loaded machine: ranks that take longer than the deadline but use the CPU all along.
    _warm()
    assert run_world(_spin, 2, 3.0, deadline=1.5) == [0, 1]
    start = time.monotonic()
    with pytest.raises(WorldDeadlock) as caught:
        run_world(_spin, 2, 600.0, deadline=1.0)
    assert time.monotonic() - start < 30, "a busy loop must still end, at a few times its deadline"
    assert "stretched to" in str(caught.value), str(caught.value)


def _both_send_first(rank, world_size):
    dist.send(torch.ones(1 << 16), dst=1 - rank)  # gloo's send waits for the matching recv
    dist.recv(torch.ones(1 << 16), src=1 - rank)


def test_ranks_that_both_send_first_are_told_about_sends_not_collectives():
    with pytest.raises(WorldDeadlock) as caught:
        run_world(_both_send_first, 2, deadline=5)
    message = str(caught.value)
    assert "ranks 0, 1 wait in send (dojo/tests/test_harness.py:" in message, message
    assert "returns only once its peer has made the matching call" in message, message
    assert "collective" not in message.split("\n")[0], message
    plain = caught.value.without_advice()  # behind a spec's own diagnosis
    assert caught.value.advice in message and "matching call" not in plain, plain
    assert "ranks 0, 1 wait in send (dojo/tests/test_harness.py:" in plain, plain


def _abort_while_the_peer_waits(rank, world_size):
    if rank == 1:
        time.sleep(0.5)
        print("rank 1 is about to abort")
        os.abort()
    dist.all_reduce(torch.ones(1 << 16))  # gloo: "Connection reset by peer" once rank 1 dies


def test_a_crash_is_reported_not_the_peers_lost_connection_that_follows_it():
    with pytest.raises(RankCrashed) as caught:
        run_world(_abort_while_the_peer_waits, 2, deadline=60)
    message = str(caught.value)
    assert "rank 1 died from SIGABRT" in message and "about to abort" in message, message


def _crash(rank, world_size, how):
    if rank == 1:
        print("rank 1 is about to crash")
        if how == "abort":
            os.abort()
        if how == "segfault":
            ctypes.string_at(0)
        if how == "exit":
            os._exit(7)
    time.sleep(60)


@pytest.mark.parametrize(
    "how, expected",
    [
        ("abort", "died from SIGABRT"),
        ("segfault", "died from SIGSEGV"),
        ("exit", "exited with code 7"),
    ],
)
def test_a_crash_names_the_rank_the_signal_and_its_last_output(how, expected):
    with pytest.raises(RankCrashed) as caught:
        run_world(_crash, 2, how, deadline=60)
    message = str(caught.value)
    assert f"rank 1 {expected}" in message, message
    assert "rank 1 is about to crash" in message, message
    if how != "exit":
        assert "where it crashed" in message and "_crash" in message, message


def _skip_on_rank_one(rank, world_size):
    if rank == 1:
        pytest.skip("needs something this machine lacks")
    return rank


def test_a_skip_inside_a_rank_skips_the_test():
    with pytest.raises(pytest.skip.Exception, match="rank 1: needs something this machine lacks"):
        run_world(_skip_on_rank_one, 2)


def _todo_on_rank_two(rank, world_size):
    if rank == 2:
        raise KataTodo("k04", 2, "divide by the world size")
    return rank


def test_a_kata_todo_inside_a_rank_comes_back_as_itself():
    with pytest.raises(KataTodo) as caught:
        run_world(_todo_on_rank_two, 3)
    assert (caught.value.kata, caught.value.step) == ("k04", 2)
    assert str(caught.value) == "not implemented yet: k04 step 2 (divide by the world size)"


def _todo_everywhere(rank, world_size):
    os.environ["DOJO_TEST_LEFT"] = "yes"
    raise KataTodo("k04", 3, f"average every gradient (rank {rank}, pid {os.getpid()})")


def test_ranks_that_all_stop_at_a_todo_serve_the_next_world(monkeypatch):
    """A stub's worlds (a learner's first runs, the gate's check of the stubs) end at a todo on
    every rank: nothing is left half done, so the ranks serve again."""
    monkeypatch.setenv(impl.ENV_VAR, "solutions")
    with pytest.raises(KataTodo) as caught:
        run_world(_todo_everywhere, 2)
    pid = int(str(caught.value).rsplit("pid ", 1)[1].rstrip(")"))
    looks = run_world(_look, 2)
    assert pid in {look["pid"] for look in looks}, "the ranks were not reused"
    assert all(look["left"] is None for look in looks)


def test_a_function_that_ranks_cannot_import_is_refused_with_advice():
    with pytest.raises(TypeError, match="module level"):
        run_world(lambda rank, world_size: rank, 2)


def _tagged_sum(rank, world_size, tag):
    value = torch.tensor([tag])
    dist.all_reduce(value)
    return int(value)


def test_concurrent_worlds_in_one_process_do_not_mix():
    results = {}

    def run(tag):
        results[tag] = run_world(_tagged_sum, 2, tag)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in (10, 20, 30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {10: [20, 20], 20: [40, 40], 30: [60, 60]}


@pytest.mark.parametrize("tag", range(4))
def test_worlds_in_parallel_pytest_workers_do_not_collide(tag):
    """Under `pytest -n 2` these run at the same time in two workers, each with its own store."""
    assert run_world(_tagged_sum, 3, tag) == [3 * tag] * 3


def _average_gradients_then_end(rank, world_size):
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 8)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    optimizer.step()
    return rank  # model and optimizer are still alive when the harness tears down


def test_ranks_end_without_the_teardown_abort():
    """The findings saw 3-15% of such worlds abort at teardown; the harness's ending avoids it."""
    for _ in range(10):
        assert run_world(_average_gradients_then_end, 2) == [0, 1]


def test_rank_output_is_echoed_with_the_rank(capsys):
    run_world(_identify_and_print, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def _identify_and_print(rank, world_size):
    print(f"hello from {rank}")


_RUN_A_HANGING_WORLD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from dojo.harness.world import run_world
    from dojo.tests.test_harness import _sleep_forever
    if __name__ == "__main__":
        run_world(_sleep_forever, 2, {pid_dir!r}, deadline=600)
    """
)


def _sleep_forever(rank, world_size, pid_dir):
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _start_hanging_world(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(_RUN_A_HANGING_WORLD.format(root=str(ROOT), pid_dir=str(tmp_path)))
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=hears_ctrl_c,  # the tests press Ctrl-C on it
    )
    end = time.monotonic() + 240  # it imports torch twice: slow on a loaded machine, not stuck
    while len(_read_pids(tmp_path, 2)) < 2:
        assert parent.poll() is None, f"the world did not start: {parent.stderr.read()}"
        assert time.monotonic() < end, "the world did not start within 240 s"
        time.sleep(0.1)
    return parent, _read_pids(tmp_path, 2)


_RUN_A_WORLD_AND_LEAVE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from dojo.harness.world import run_world
    from dojo.tests.test_harness import _identify
    if __name__ == "__main__":
        print(*[r["pid"] for r in run_world(_identify, 2, None)])
    """
)


def test_ranks_waiting_for_another_world_end_with_their_parent(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(_RUN_A_WORLD_AND_LEAVE.format(root=str(ROOT)))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    # the last line: the ranks' echoed output comes first (torch 2.10's gloo prints a line)
    _assert_gone([int(pid) for pid in done.stdout.splitlines()[-1].split()])


def test_kill_9_of_the_parent_takes_every_rank_with_it(tmp_path):
    parent, pids = _start_hanging_world(tmp_path)
    parent.kill()
    parent.wait()
    _assert_gone(pids)


def test_ctrl_c_in_the_parent_stops_every_rank(tmp_path):
    parent, pids = _start_hanging_world(tmp_path)
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=30) != 0
    assert "KeyboardInterrupt" in parent.stderr.read()
    _assert_gone(pids, within=1.0)


_TEST_THAT_OUTLIVES_PYTEST_TIMEOUT = textwrap.dedent(
    """
    import pytest
    from dojo.harness.world import run_world
    from dojo.tests.test_harness import _sleep_forever

    @pytest.mark.timeout(3)
    def test_hangs():
        run_world(_sleep_forever, 2, {pid_dir!r}, deadline=600)
    """
)


def test_pytest_timeout_as_the_outer_backstop_leaves_nothing_running(tmp_path):
    test_file = tmp_path / "test_outer_timeout.py"
    test_file.write_text(_TEST_THAT_OUTLIVES_PYTEST_TIMEOUT.format(pid_dir=str(tmp_path)))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--rootdir={ROOT}",
            str(test_file),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "Timeout" in result.stdout, result.stdout + result.stderr
    _assert_gone(_read_pids(tmp_path, 2))
