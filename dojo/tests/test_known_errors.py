"""dojo.harness.culprit and known_errors: an exception said in the kata's words first."""

import linecache
import os

import pytest
import torch

from dojo.curriculum import ROOT
from dojo.harness import culprit, known_errors
from dojo.harness.world import RankFailed, run_world

# A learner's kata, as far as the culprit can tell: code whose file lies in katas/.
FAKE_KATA = os.path.join(ROOT, "katas", "k99_fake.py")
SOURCE = """\
def ring(tensor, world_size):
    chunks = list(tensor.chunk(world_size))
    return chunks[world_size - 1]


def split(tensor, sizes):
    return tensor.split(sizes)


def split_watched(tensor, sizes):
    return watched(tensor, sizes)
"""
WRAPPER = """\
def watched(tensor, sizes):
    return tensor.split(sizes)
"""


def _fake_kata():
    linecache.cache[FAKE_KATA] = (len(SOURCE), None, SOURCE.splitlines(True), FAKE_KATA)
    namespace = {}
    exec(compile(SOURCE, FAKE_KATA, "exec"), namespace)
    return namespace


def _caught(fn, *args):
    with pytest.raises(Exception) as caught:
        fn(*args)
    return caught


def test_the_learners_own_exception_names_the_function_its_arguments_and_line():
    caught = _caught(_fake_kata()["ring"], torch.zeros(5), 8)
    found = culprit.find(caught.tb)
    assert (found.origin, found.file, found.line) == ("kata", "katas/k99_fake.py", 3)
    assert found.entry == "ring(tensor=float32[5], world_size=8)"
    said = known_errors.said("IndexError", str(caught.value), found)
    assert said.startswith("your ring(tensor=float32[5], world_size=8) raised IndexError at "), said
    assert "return chunks[world_size - 1]" in said and "IndexError: list index out of range" in said
    assert "Likely: torch.chunk(t, n) returns FEWER than n pieces" in said, said
    assert not known_errors.is_raw("IndexError", str(caught.value), found)


def test_no_likely_without_evidence_on_the_learners_line():
    found = culprit.Culprit("kata", "f(x=1)", "katas/k99_fake.py", 3, "f", "return xs[4]", "")
    said = known_errors.said("IndexError", "list index out of range", found)
    assert "Likely" not in said and said.startswith("your f(x=1) raised IndexError"), said


def test_torchs_error_inside_a_call_the_learner_made_is_translated_raw_text_below():
    caught = _caught(_fake_kata()["split"], torch.zeros(4), [1, 2])
    found = culprit.find(caught.tb)
    assert found.origin == "torch" and found.callee == "split", found
    said = known_errors.said("RuntimeError", str(caught.value), found)
    first, *rest = said.splitlines()
    assert first.startswith("split (torch), called by your split(tensor=float32[4], sizes=["), said
    assert "the sizes given to torch.split add up to another length than the tensor's 4" in said
    assert rest[-1].strip().startswith("torch said: RuntimeError: split_with_sizes"), said


def test_a_specs_wrapper_around_the_torch_call_is_not_named_as_the_call():
    # A spec may wrap a torch call to watch it (k19 watches every all-gather's output): the
    # learner called torch's function, not the spec's wrapper.
    spec = {}
    exec(compile(WRAPPER, os.path.join(ROOT, "tests", "test_k99_fake.py"), "exec"), spec)
    kata = _fake_kata()
    kata["watched"] = spec["watched"]
    found = culprit.find(_caught(kata["split_watched"], torch.zeros(4), [1, 2]).tb)
    assert found.origin == "torch" and found.callee == "split", found


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: torch.zeros(4).sum(dim=3), "a dimension the tensor does not have: it has 1"),
        (
            lambda: torch.zeros(4).set_(torch.zeros(2).untyped_storage(), 0, (4,)),
            "a view reaches past the end of the memory it views",
        ),
        (
            lambda: torch.zeros(2, 3) @ torch.zeros(2, 3),
            "a matrix product of shapes that do not fit",
        ),
        (
            lambda: torch.zeros(3) + torch.zeros(4),
            "two tensors of different lengths met in one operation (3 against 4)",
        ),
        (
            lambda: torch.nn.Parameter(torch.zeros(2)).add_(1),
            "a parameter changed in place while autograd records",
        ),
    ],
)
def test_torchs_own_messages_on_this_torch_are_known(make, says):
    with pytest.raises(Exception) as caught:
        make()
    meaning = known_errors.explain(type(caught.value).__name__, str(caught.value))
    assert meaning is not None and says in meaning, f"{caught.value!r} -> {meaning!r}"


def _gathers_unequal_shards(rank, world_size):
    import torch.distributed as dist

    out = torch.zeros(170 * world_size)
    dist.all_gather_into_tensor(out, torch.zeros(170 + rank))


def _sends_to_itself(rank, world_size):
    import torch.distributed as dist

    dist.send(torch.zeros(3), dst=rank)


@pytest.mark.parametrize(
    ("fn", "world_size", "says"),
    [
        (_gathers_unequal_shards, 2, "the ranks handed one collective tensors of different sizes"),
        (_sends_to_itself, 1, "a rank sent to (or received from) itself"),
    ],
)
def test_glooes_errors_in_a_world_come_with_their_meaning(fn, world_size, says):
    with pytest.raises(RankFailed) as caught:
        run_world(fn, world_size, deadline=20)
    assert says in str(caught.value), str(caught.value)[:800]


def test_a_spec_crash_and_an_unexplained_torch_error_are_raw():
    spec = culprit.Culprit("spec", "", "tests/test_k18_zero.py", 300, "check", "table[t]", "")
    assert known_errors.is_raw("KeyError", "tensor([0.07, ...])", spec)
    assert not known_errors.is_raw("AssertionError", "rank 1 holds 3.0", spec)
    torch_side = culprit.Culprit("torch", "f()", "katas/k99.py", 3, "f", "dist.x()", "x")
    assert known_errors.is_raw("RuntimeError", "some new torch message", torch_side)
    said = known_errors.said("KeyError", "tensor([0.07])", spec)
    assert said.startswith("the test's own code failed on what your code gave it"), said


def test_a_spec_that_fails_with_pytest_fail_speaks_its_own_words():
    spec = culprit.Culprit("spec", "", "tests/test_k07_point_to_point.py", 380, "t", "fail()", "")
    message = "rank 0 received [2, 4, 6], expected [1, 3, 5]: it noted the counter after adding 1"
    assert not known_errors.is_raw("Failed", message, spec)
    assert known_errors.said("Failed", message, spec) == message


class _ReturnsTooFew(torch.autograd.Function):
    """A learner's Function whose backward forgets the None for its second input."""

    @staticmethod
    def forward(ctx, x, scale):
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_functions_wrong_gradient_count_met_in_the_specs_backward_is_the_learners():
    """autograd checks a Function's backward only after it returned, so the error surfaces at
    the spec's .backward(): the learner's, said so, not the spec's crash."""
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError) as caught:
        _ReturnsTooFew.apply(x, 2.0).sum().backward()
    spec = culprit.Culprit(
        "spec", "", "tests/test_k26_ring_attention.py", 506, "t", "y.backward()", ""
    )
    message = str(caught.value)
    assert not known_errors.is_raw("RuntimeError", message, spec), message
    said = known_errors.said("RuntimeError", message, spec)
    assert said.startswith("the test's call at tests/test_k26_ring_attention.py:506"), said
    assert "backward returned 1 of the 2 gradients" in said, said
    assert "None for each input that needs none" in said, said
