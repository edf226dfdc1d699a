"""k04's mistakes catalogue: real mistakes in all-reduce and gradient averaging, and right answers
written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer

SUM = dist.ReduceOp.SUM

# --------------------------------------------------------------------------- tutorial_allreduce


def demo_without_copy(rank, world_size):
    tensor = torch.tensor([rank])
    before = tensor  # the same tensor: all_reduce overwrites "before" too
    dist.all_reduce(tensor, op=SUM)
    return before, tensor


def demo_reduces_a_copy(rank, world_size):
    tensor = torch.tensor([rank])
    dist.all_reduce(tensor.clone(), op=SUM)  # the result lands in the copy, which is dropped
    return tensor.clone(), tensor


def demo_with_max(rank, world_size):
    tensor = torch.tensor([rank])
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return before, tensor


def demo_reduces_the_returned_copy(rank, world_size):
    """Right, written another way: keep the original, reduce a copy and return the copy."""
    before = torch.tensor([rank])
    after = before.clone()
    dist.all_reduce(after, op=SUM)
    return before, after


def demo_from_ones(rank, world_size):
    tensor = torch.ones(1)  # the other tutorial's starting point
    before = tensor.clone()
    dist.all_reduce(tensor, op=SUM)
    return before, tensor


# --------------------------------------------------------------------------- all_reduce_with

_OPS = {
    "sum": SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


def ops_product_as_sum(tensor, op):
    ops = {**_OPS, "product": SUM}  # a copy-paste slip in the table
    if op not in ops:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(ops)}")
    dist.all_reduce(tensor, op=ops[op])
    return tensor


def ops_on_a_copy(tensor, op):
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(_OPS)}")
    result = tensor.clone()
    dist.all_reduce(result, op=_OPS[op])
    return result  # the caller's tensor is left as it was


def ops_key_error(tensor, op):
    dist.all_reduce(tensor, op=_OPS[op])  # an unknown name escapes as a bare KeyError
    return tensor


def ops_returns_nothing(tensor, op):
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(_OPS)}")
    return dist.all_reduce(tensor, op=_OPS[op])  # all_reduce returns None (no async_op)


def ops_by_getattr(tensor, op):
    """Right, written another way: the op's name is the ReduceOp member's, in capitals."""
    if op not in ("sum", "product", "min", "max"):
        raise ValueError(f"{op!r} is not a reduce op this function knows: sum, product, min, max")
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return tensor


def ops_silent_value_error(tensor, op):
    if op not in _OPS:
        raise ValueError("bad op")
    dist.all_reduce(tensor, op=_OPS[op])
    return tensor


# --------------------------------------------------------------------------- average_gradients


def the_tutorials_own(model):
    """The tutorial's code, word for word: right, except that it trips on a .grad of None."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=SUM)
        param.grad.data /= size


def summed_not_divided(model):
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)


def reduced_data_not_grad(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.data, op=SUM)
            param.data /= size


def assigned_what_all_reduce_returns(model):
    """A real course's code: the gradient set to what the collective returned (None)."""
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            param.grad = dist.all_reduce(param.grad / size, op=SUM)


def reduced_a_copy(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad.clone()
            dist.all_reduce(grad, op=SUM)
            grad /= size  # never written back to param.grad


def divided_own_without_reducing(model):
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= dist.get_world_size()


def only_weights(model):
    size = dist.get_world_size()
    for name, param in model.named_parameters():
        if "weight" in name and param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)
            param.grad /= size


def return_inside_the_loop(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)
            param.grad /= size
            return  # one indentation level too deep: only the first parameter is averaged


def divided_by_four(model):
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)
            param.grad /= 4  # the tutorial's world size, hard-coded


def reduce_not_all_reduce(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.reduce(param.grad, dst=0, op=SUM)  # only rank 0 receives the sum
            param.grad /= size


def only_rank_0_divides(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)
            if dist.get_rank() == 0:
                param.grad /= size


def only_rank_0_calls_all_reduce(model):
    size = dist.get_world_size()
    if dist.get_rank() != 0:
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)
            param.grad /= size


def rank_0_skips_all_reduce(model):
    size = dist.get_world_size()
    if dist.get_rank() == 0:  # "rank 0 already has the answer"
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)
            param.grad /= size


def zero_fills_missing_grads(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)  # "so that every rank reduces the same list"
        dist.all_reduce(param.grad, op=SUM)
        param.grad /= size


# Right answers written differently: the checks must accept every one.


def with_avg_op(model):
    if not _gloo_has_avg():
        import pytest

        pytest.skip("this torch's gloo has no ReduceOp.AVG")
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)


def _gloo_has_avg() -> bool:
    try:
        dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError):
        return False
    return True


def divided_first(model):
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(size)
            dist.all_reduce(param.grad, op=SUM)


def one_flat_buffer(model):
    """What DistributedDataParallel does: one all-reduce over every gradient at once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=SUM)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


# --------------------------------------------------------------------------- the catalogue

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "demo_without_copy",
        replaces="tutorial_allreduce",
        fails=["test_tutorial_allreduce_gives_every_rank_the_sum[4]"],
        says=["'before' tensor already holds the sum", "clone()"],
    ),
    Mistake(
        "demo_reduces_a_copy",
        replaces="tutorial_allreduce",
        fails=["test_tutorial_allreduce_gives_every_rank_the_sum[4]"],
        says=["still holds its own value"],
    ),
    Mistake(
        "demo_with_max",
        replaces="tutorial_allreduce",
        fails=["test_tutorial_allreduce_gives_every_rank_the_sum[4]"],
        says=["expected [6] (0 + 1 + 2 + 3)", "ReduceOp.SUM"],
    ),
    Mistake(
        "demo_from_ones",
        replaces="tutorial_allreduce",
        fails=["test_tutorial_allreduce_gives_every_rank_the_sum[4]"],
        says=["rank 0 started from [1.0], expected tensor([0])"],
    ),
    Mistake(
        "ops_product_as_sum",
        replaces="all_reduce_with",
        fails=["test_reduce_ops"],
        says=["all_reduce_with(tensor, 'product')", "Which dist.ReduceOp"],
    ),
    Mistake(
        "ops_on_a_copy",
        replaces="all_reduce_with",
        fails=["test_reduce_ops"],
        says=["left rank 0's tensor as it was", "in place"],
    ),
    Mistake(
        "ops_key_error",
        replaces="all_reduce_with",
        fails=["test_reduce_ops"],
        says=["raised KeyError", "must raise ValueError"],
    ),
    Mistake(
        "ops_silent_value_error",
        replaces="all_reduce_with",
        fails=["test_reduce_ops"],
        says=["name the ops it knows"],
    ),
    Mistake(
        "ops_returns_nothing",
        replaces="all_reduce_with",
        fails=["test_reduce_ops"],
        says=["returned None", "return the very tensor it reduced in place"],
    ),
    Mistake(
        "the_tutorials_own",
        replaces="average_gradients",
        fails=["test_average_gradients_leaves_missing_gradients_alone"],
        says=["is None", "skip them"],
    ),
    Mistake(
        "summed_not_divided",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["holds the sum of the 4 ranks' gradients", "divide by the world size"],
    ),
    Mistake(
        "reduced_data_not_grad",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["all-reduced param.data", "Reduce param.grad instead"],
    ),
    Mistake(
        "reduced_a_copy",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["no gradient was averaged", "a copy of the gradient"],
    ),
    Mistake(
        "assigned_what_all_reduce_returns",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["has no gradient (.grad None)", "dist.all_reduce returns None", "without assigning"],
    ),
    Mistake(
        "divided_own_without_reducing",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["never combined them"],
    ),
    Mistake(
        "only_weights",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["'hidden.bias', 'out.bias' were not averaged", "every layer"],
    ),
    Mistake(
        "return_inside_the_loop",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["were not averaged", "loop over model.parameters()"],
    ),
    Mistake(
        "divided_by_four",
        replaces="average_gradients",
        fails=["test_average_gradients_divides_by_the_world_size"],
        says=["not a fixed number"],
    ),
    Mistake(
        "reduce_not_all_reduce",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["the ranks disagree", "dist.reduce gives it to one rank only"],
    ),
    Mistake(
        "only_rank_0_divides",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=["rank 1 holds", "(the sum)", "divide on every rank"],
    ),
    Mistake(
        "only_rank_0_calls_all_reduce",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=[
            "rank 0 was still waiting in a collective after ranks 1, 2 and 3 had returned",
            "ranks 1, 2 and 3 skipped the all-reduces",
            "Every rank must call dist.all_reduce",
        ],
    ),
    Mistake(
        "rank_0_skips_all_reduce",
        replaces="average_gradients",
        fails=["test_average_gradients_gives_every_rank_the_mean"],
        says=[
            "ranks 1, 2 and 3 were still waiting in a collective after rank 0 had returned",
            "rank 0 skipped the all-reduces",
            "no `if rank == ...`",
        ],
    ),
    Mistake(
        "zero_fills_missing_grads",
        replaces="average_gradients",
        fails=["test_average_gradients_leaves_missing_gradients_alone"],
        says=["had no gradient (.grad None)", "leave such parameters alone"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("demo_reduces_the_returned_copy", replaces="tutorial_allreduce"),
    RightAnswer("ops_by_getattr", replaces="all_reduce_with"),
    RightAnswer("with_avg_op", replaces="average_gradients"),
    RightAnswer("divided_first", replaces="average_gradients"),
    RightAnswer("one_flat_buffer", replaces="average_gradients"),
]
