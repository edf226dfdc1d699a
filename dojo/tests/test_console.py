"""A kata program's last words: the first step still to write when it runs into an unwritten
one, and its verdict on how far its result is from the expected one."""

from __future__ import annotations

from dojo.console import _todo_message, verdict
from dojo.todo import KataTodo

STUB = """
from dojo.todo import KataTodo

def first():
    raise KataTodo("k05", 1, "give every replica rank 0's weights")

def loop():
    raise KataTodo("k05", 4, "the training loop")
"""


def test_the_program_names_the_first_unwritten_step_not_only_the_one_it_reached(tmp_path):
    stub = tmp_path / "k05_data_parallel.py"
    stub.write_text(STUB)
    message = _todo_message(KataTodo("k05", 4, "the training loop"), str(stub))
    assert message.startswith("not implemented yet: k05 step 4 (the training loop)"), message
    assert "still has step 1 (give every replica rank 0's weights) to write: start there" in message
    stub.write_text(STUB.replace('raise KataTodo("k05", 1', "return None  #"))
    alone = _todo_message(KataTodo("k05", 4, "the training loop"), str(stub))
    assert "still has" not in alone, "with the earlier steps written, the step reached is the one"


def test_a_verdict_says_the_gap_and_exits_with_0_only_within_the_tolerance(capfd):
    statuses = [
        verdict(gap, "the ranks agree", "the ranks differ") for gap in (3e-6, 0.5, float("nan"))
    ]
    assert statuses == [0, 1, 1], f"exit statuses {statuses}: 0 only below the tolerance (1e-4)"
    assert verdict(0.5, "close enough", "too far", tolerance=1.0) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines == [
        "[main] the ranks agree (largest gap 3.0e-06)",
        "[main] the ranks differ by up to 5.0e-01",
        "[main] the ranks differ by up to nan",
        "[main] close enough (largest gap 5.0e-01)",
    ], lines
