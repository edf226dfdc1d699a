"""dojo.harness.stacks: a rank's stack dump read as the reports need it."""

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
