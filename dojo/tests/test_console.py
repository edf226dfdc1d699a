"""A kata program that runs into an unwritten step names the first step still to write."""

from __future__ import annotations

from dojo.console import _todo_message
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
