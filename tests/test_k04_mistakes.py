"""The k04 tests, tested: each real mistake in tests/mistakes_k04.py fails them with a message
that names it, and each right answer written another way passes.

This checks the tests, not the learner's code, so it runs with ``--solutions`` (the maintainers'
run) and is skipped in a learner's run.
"""

from __future__ import annotations

import pytest

from dojo import impl
from dojo.world import RankFailed
from tests.test_k04_allreduce import check_average_gradients, check_reduce_ops, check_tutorial_allreduce

CHECKS = {"demo": check_tutorial_allreduce, "ops": check_reduce_ops, "average": check_average_gradients}

# (mistake in tests/mistakes_k04.py, check, its arguments, what the failure message must say)
MISTAKES = [
    ("demo_without_copy", "demo", {"world_size": 4}, ["'before' tensor already holds the sum", "clone()"]),
    ("demo_reduces_a_copy", "demo", {"world_size": 4}, ["still holds its own value"]),
    ("demo_with_max", "demo", {"world_size": 4}, ["expected [6] (0 + 1 + 2 + 3)", "ReduceOp.SUM"]),
    ("demo_from_ones", "demo", {"world_size": 4}, ["rank 0 started from [1.0], expected tensor([0])"]),
    ("ops_product_as_sum", "ops", {"world_size": 3}, ["all_reduce_with(tensor, 'product')", "Which dist.ReduceOp"]),
    ("ops_on_a_copy", "ops", {"world_size": 3}, ["left rank 0's tensor as it was", "in place"]),
    ("ops_key_error", "ops", {"world_size": 3}, ["raised KeyError", "must raise ValueError"]),
    ("ops_silent_value_error", "ops", {"world_size": 3}, ["name the ops it knows"]),
    ("the_tutorials_own", "average", {"world_size": 2, "with_none": True}, ["is None", "skip them"]),
    ("summed_not_divided", "average", {"world_size": 4}, ["holds the sum of the 4 ranks' gradients", "divide by the world size"]),
    ("reduced_data_not_grad", "average", {"world_size": 4}, ["all-reduced param.data", "Reduce param.grad instead"]),
    ("reduced_a_copy", "average", {"world_size": 4}, ["no gradient was averaged", "a copy of the gradient"]),
    ("divided_own_without_reducing", "average", {"world_size": 4}, ["never combined them"]),
    ("only_weights", "average", {"world_size": 4}, ["'hidden.bias', 'out.bias' were not averaged", "every layer"]),
    ("return_inside_the_loop", "average", {"world_size": 4}, ["were not averaged", "loop over model.parameters()"]),
    ("divided_by_four", "average", {"world_size": 3}, ["not a fixed number"]),
    ("reduce_not_all_reduce", "average", {"world_size": 4}, ["the ranks disagree", "dist.reduce gives it to one rank only"]),
    ("only_rank_0_divides", "average", {"world_size": 4}, ["rank 1 holds", "(the sum)", "divide on every rank"]),
    # The harness reports a deadlock once the other ranks have been back for `straggler` seconds.
    ("only_rank_0_calls_all_reduce", "average", {"world_size": 4, "straggler": 2.0},
     ["deadlock: rank(s) 0 still had not returned", "rank 0 is waiting here", "dist.all_reduce(param.grad"]),
    ("rank_0_skips_all_reduce", "average", {"world_size": 4, "straggler": 2.0},
     ["deadlock: rank(s) 1, 2, 3 still had not returned", "rank 3 is waiting here", "dist.all_reduce(param.grad"]),
    ("zero_fills_missing_grads", "average", {"world_size": 2, "with_none": True}, ["had no gradient (.grad None)", "leave such parameters alone"]),
]

RIGHT_ANSWERS = [
    ("with_avg_op", "average", {"world_size": 4}),
    ("with_avg_op", "average", {"world_size": 2, "with_none": True}),
    ("divided_first", "average", {"world_size": 3}),
    ("one_flat_buffer", "average", {"world_size": 4}),
    ("one_flat_buffer", "average", {"world_size": 2, "with_none": True}),
    ("the_tutorials_own", "average", {"world_size": 4}),
    ("the_tutorials_own", "average", {"world_size": 1}),
]


@pytest.fixture(autouse=True)
def _maintainers_only():
    if impl.current() != "solutions":
        pytest.skip("checks the k04 tests themselves, not your code: runs with --solutions")


@pytest.mark.parametrize("mistake, check, arguments, said", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_fails_with_a_message_that_names_it(mistake, check, arguments, said):
    with pytest.raises(AssertionError) as caught:
        CHECKS[check](impl=f"tests.mistakes_k04:{mistake}", **arguments)
    message = str(caught.value)
    missing = [text for text in said if text not in message]
    assert not missing, f"the failure for {mistake!r} should say {missing}, but it said:\n{message}"


@pytest.mark.parametrize("answer, check, arguments", RIGHT_ANSWERS, ids=[f"{a[0]}-{i}" for i, a in enumerate(RIGHT_ANSWERS)])
def test_right_answer_written_another_way_passes(answer, check, arguments):
    try:
        CHECKS[check](impl=f"tests.mistakes_k04:{answer}", **arguments)
    except RankFailed as failure:
        if answer == "with_avg_op" and "AVG" in str(failure):  # gloo gained ReduceOp.AVG late
            pytest.skip(f"this torch's gloo has no ReduceOp.AVG: {str(failure).splitlines()[0]}")
        raise
