"""dojo.harness.stacks: a rank's stack dump read as the reports need it."""

import linecache
import os

import dojo.harness
from dojo.harness import stacks

HARNESS = os.path.dirname(os.path.abspath(dojo.harness.__file__))
KATA = os.path.join(os.path.dirname(os.path.dirname(HARNESS)), "katas", "k04_allreduce.py")


def _dump(*frames: tuple[str, int, str]) -> str:
    """A faulthandler dump of the main thread, most recent call first (as a rank writes it)."""
    lines = "\n".join(f'  File "{path}", line {line} in {name}' for path, line, name in frames)
    return f"Current thread 0x00007f00 (most recent call first):\n{lines}\n"


def test_a_rank_inside_the_call_recorder_waits_in_torch_distributed():
    for recorder in ("calls.py", "timeline.py"):
        dump = _dump(
            (os.path.join(HARNESS, recorder), 120, "wrapper"),
            (KATA, 90, "average_gradients"),
            (os.path.join(HARNESS, "rank.py"), 200, "main"),
        )
        assert stacks.waits_in_torch_distributed(dump), f"inside {recorder}'s wrapper of a call"


def test_the_harness_frames_are_not_shown_the_learners_are():
    dump = _dump(
        (os.path.join(HARNESS, "calls.py"), 120, "wrapper"),
        (KATA, 90, "average_gradients"),
        (os.path.join(HARNESS, "rank.py"), 200, "main"),
    )
    shown = stacks.format_stack_dump(dump)
    assert "k04_allreduce.py" in shown and "average_gradients" in shown, shown
    assert os.path.join("harness", "rank.py") not in shown, f"the harness's own frame: {shown}"
    assert os.path.join("harness", "calls.py") not in shown, f"the recorder's wrapper: {shown}"


# A learner's kata with one line per call a rank may wait in (linecache holds its source).
FAKE_KATA = os.path.join(os.path.dirname(KATA), "k99_fake.py")
FAKE_SOURCE = """\
dist.send(tensor, dst=1 - rank)
dist.recv(tensor, src=1 - rank)  # a comment the advice leaves out
request.wait()
dist.all_reduce(tensor)
time.sleep(60)
"""
_LINE = {"send": 1, "recv": 2, "wait": 3, "all_reduce": 4, "sleep": 5}
C10D = os.path.join(os.sep, "venv", "site-packages", "torch", "distributed", "distributed_c10d.py")


def _waiting_in(call: str) -> str:
    """A rank's dump as it waits in ``call``, made by the fake kata's line for it."""
    linecache.cache[FAKE_KATA] = (
        len(FAKE_SOURCE),
        None,
        FAKE_SOURCE.splitlines(True),
        FAKE_KATA,
    )
    inside = [(C10D, 3400, call)] if call in ("send", "recv", "all_reduce") else []
    return _dump(
        *inside,
        (FAKE_KATA, _LINE[call], "exchange"),
        (os.path.join(HARNESS, "rank.py"), 200, "main"),
    )


COLLECTIVE_ADVICE = "must call every collective"


def test_two_ranks_in_recv_are_told_what_they_wait_in_and_the_point_to_point_lesson():
    said = stacks.advice({0: _waiting_in("recv"), 1: _waiting_in("recv")})
    assert said.startswith("Ranks 0, 1 wait in recv (`dist.recv(tensor, src=1 - rank)`)"), said
    assert "A recv returns only once its source sends to it" in said, said
    assert "collective" not in said, f"two ranks in recv are no collective out of order: {said}"


def test_ranks_all_in_a_blocking_send_are_told_that_both_sides_wait():
    said = stacks.advice({0: _waiting_in("send"), 1: _waiting_in("send")})
    assert said.startswith("Ranks 0, 1 wait in send (`dist.send(tensor, dst=1 - rank)`)"), said
    assert "A blocking send returns only once its peer has made the matching call" in said
    assert "dist.isend" in said and COLLECTIVE_ADVICE not in said, said


def test_a_send_and_a_request_wait_get_the_point_to_point_lesson_with_both_places():
    said = stacks.advice({0: _waiting_in("send"), 1: _waiting_in("wait")})
    assert said.startswith("Rank 0 waits in send (`dist.send(tensor, dst=1 - rank)`); "), said
    assert "rank 1 in wait() on a request (`request.wait()`)" in said, said
    assert "does every send have its recv on the destination" in said, said
    assert COLLECTIVE_ADVICE not in said, said


def test_ranks_that_only_wait_on_requests_get_no_collective_lead():
    said = stacks.advice({0: _waiting_in("wait"), 1: _waiting_in("wait")})
    assert said.startswith("Ranks 0, 1 wait in wait() on a request (`request.wait()`)"), said
    assert "A request completes only once its peer makes the matching call" in said, said
    assert COLLECTIVE_ADVICE not in said, said


def test_the_collective_advice_is_for_ranks_stuck_in_collectives():
    said = stacks.advice({0: _waiting_in("all_reduce"), 2: _waiting_in("all_reduce")})
    assert said.startswith("Ranks 0, 2 wait in all_reduce (`dist.all_reduce(tensor)`)"), said
    assert COLLECTIVE_ADVICE in said, said
    mixed = stacks.advice({0: _waiting_in("all_reduce"), 1: _waiting_in("recv")})
    assert "others in a collective" in mixed and "rank 1 in recv" in mixed, mixed


def test_ranks_outside_torch_distributed_get_no_advice():
    said = stacks.advice({0: _waiting_in("sleep"), 1: _waiting_in("sleep")})
    assert said.startswith("No rank waits inside a torch.distributed call"), said
    assert "collective" not in said and "recv" not in said, said


def test_a_rank_inside_a_functional_collective_waits_in_torch_distributed():
    """DTensor's full_tensor (a comparison world's torch side) waits beneath torch's op dispatch:
    its innermost frame is torch/_ops.py, inside a torch.distributed call all the same."""
    torch = os.path.join("site-packages", "torch")
    dump = _dump(
        (os.path.join(os.sep, "venv", torch, "_ops.py"), 926, "redispatch"),
        (os.path.join(os.sep, "venv", torch, "_library", "autograd.py"), 43, "redispatch_no_grad"),
        (os.path.join(os.sep, "venv", torch, "_ops.py"), 1350, "__call__"),
        (
            os.path.join(os.sep, "venv", torch, "distributed", "_functional_collectives.py"),
            142,
            "wait_tensor",
        ),
        (
            os.path.join(os.sep, "venv", torch, "distributed", "tensor", "_api.py"),
            856,
            "full_tensor",
        ),
        (KATA, 90, "average_gradients"),
        (os.path.join(HARNESS, "rank.py"), 200, "main"),
    )
    assert stacks.waits_in_torch_distributed(dump), "inside DTensor's full_tensor, waiting"
    assert stacks.calls({0: dump}) == {"wait_tensor"}, (
        f"the call shown is {stacks.calls({0: dump})}: the torch.distributed one, not the op "
        "dispatch beneath it"
    )


def test_a_rank_computing_inside_torch_ops_does_not_wait_in_torch_distributed():
    torch = os.path.join("site-packages", "torch")
    dump = _dump(
        (os.path.join(os.sep, "venv", torch, "_ops.py"), 926, "redispatch"),
        (os.path.join(os.sep, "venv", torch, "nn", "functional.py"), 100, "linear"),
        (KATA, 90, "average_gradients"),
        (os.path.join(HARNESS, "rank.py"), 200, "main"),
    )
    assert not stacks.waits_in_torch_distributed(dump), "a torch op outside torch.distributed"
