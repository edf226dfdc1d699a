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
