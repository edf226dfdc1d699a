"""k04 all-reduce: the tutorial's demonstration, the reduce ops, and average_gradients."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from dojo.devices import rank_device
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.lang import t, tn
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import ranks_phrase, run_module_ok
from dojo.todo import KataTodo

KATA = "k04_allreduce"


def _show(tensor: torch.Tensor) -> str:
    values = tensor.flatten().tolist()
    return str(values[0] if len(values) == 1 else values)


# --------------------------------------------------------------------------- step 1: the demo


def _demo(rank, world_size):
    before, after = load_kata(KATA).tutorial_allreduce(rank, world_size)
    return before.cpu().tolist(), after.cpu().tolist(), str(after.device)


def check_tutorial_allreduce(world_size: int) -> list:
    results = run_world(_demo, world_size)
    total = sum(range(world_size))
    terms = " + ".join(str(r) for r in range(world_size))
    for rank, (before, after, _) in enumerate(results):
        if before == [total] and after == [total] and rank != total:
            raise AssertionError(
                t(
                    "rank {rank}'s 'before' tensor already holds the sum {total}: all_reduce works "
                    "in place and overwrote it. Keep a copy (tensor.clone()) made before the "
                    "all-reduce.",
                    rank=rank,
                    total=total,
                )
            )
        assert before == [rank], t(
            "rank {rank} started from {before}, expected tensor([{rank}]): each rank holds its "
            "own rank number, torch.tensor([rank])",
            rank=rank,
            before=before,
        )
        if after == [rank] and rank != total:
            raise AssertionError(
                t(
                    "rank {rank} still holds its own value {after} after the all-reduce: call "
                    "dist.all_reduce(tensor) on the very tensor you return (it works in place and "
                    "returns nothing useful), on every rank",
                    rank=rank,
                    after=after,
                )
            )
        assert after == [total], t(
            "rank {rank} holds {after} after the all-reduce, expected [{total}] ({terms}): use "
            "op=dist.ReduceOp.SUM",
            rank=rank,
            after=after,
            total=total,
            terms=terms,
        )
    return results


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size", [4, 3])
def test_tutorial_allreduce_gives_every_rank_the_sum(kata, world_size):
    check_tutorial_allreduce(world_size)


# --------------------------------------------------------------------------- step 2: reduce ops


def _values(rank: int) -> torch.Tensor:
    # Different on every rank, negatives included, so that each op has one right answer.
    return torch.tensor([rank + 1.0, 10.0 - rank, (-1.0) ** rank * (rank + 1)])


_EXPECTED_OPS = {
    "sum": (lambda: t("the element-wise sum"), lambda stack: stack.sum(0)),
    "product": (lambda: t("the element-wise product"), lambda stack: stack.prod(0)),
    "min": (lambda: t("the element-wise smallest"), lambda stack: stack.min(0).values),
    "max": (lambda: t("the element-wise largest"), lambda stack: stack.max(0).values),
}


def _ops(rank, world_size):
    all_reduce_with = load_kata(KATA).all_reduce_with
    got = {}
    for op in _EXPECTED_OPS:
        tensor = _values(rank).to(rank_device())
        returned = all_reduce_with(tensor, op)
        got[op] = (tensor.cpu(), returned is tensor, _what(returned))
    try:
        all_reduce_with(_values(rank), "median")
        refused = t("returned without an error")
    except ValueError as error:
        refused = ("ValueError", str(error))
    except KataTodo:
        raise
    except Exception as error:
        refused = t("raised {error_type}: {error}", error_type=type(error).__name__, error=error)
    return got, refused


def _what(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return t("another tensor, {value}", value=_show(value.cpu()))
    return t("a {type_name}", type_name=type(value).__name__)


def check_reduce_ops(world_size: int) -> None:
    results = run_world(_ops, world_size)
    stack = torch.stack([_values(rank) for rank in range(world_size)])
    for op, (what, reduce) in _EXPECTED_OPS.items():
        expected = reduce(stack)
        for rank, (got, _) in enumerate(results):
            tensor, same, returned = got[op]
            if torch.equal(tensor, _values(rank)):
                raise AssertionError(
                    t(
                        "all_reduce_with(tensor, {op!r}) left rank {rank}'s tensor as it was "
                        "({tensor}): reduce that tensor in place with dist.all_reduce",
                        op=op,
                        rank=rank,
                        tensor=_show(tensor),
                    )
                )
            assert torch.equal(tensor, expected), t(
                "all_reduce_with(tensor, {op!r}): rank {rank} holds {tensor}, expected {what} over "
                "the {world_size} ranks, {expected}. Which dist.ReduceOp did {op!r} map to?",
                op=op,
                rank=rank,
                tensor=_show(tensor),
                what=what(),
                world_size=world_size,
                expected=_show(expected),
            )
            assert same, t(
                "all_reduce_with(tensor, {op!r}) reduced rank {rank}'s tensor but returned "
                "{returned}: return the very tensor it reduced in place (callers write "
                "t = all_reduce_with(t, {op!r}))",
                op=op,
                rank=rank,
                returned=returned,
            )
    refused = results[0][1]
    assert isinstance(refused, tuple), t(
        "all_reduce_with(tensor, 'median') {refused}: an op it does not know must raise ValueError",
        refused=refused,
    )
    assert all(op in refused[1] for op in _EXPECTED_OPS), t(
        "all_reduce_with(tensor, 'median') raised ValueError({said!r}): name the ops it knows "
        "({ops}) so the caller can fix the call",
        said=refused[1],
        ops=", ".join(_EXPECTED_OPS),
    )


@pytest.mark.step(2)
def test_reduce_ops(kata):
    check_reduce_ops(3)


# --------------------------------------------------------------------------- step 3: gradients
#
# Rank r sets every parameter's gradient to (r + 1) * base, with base a distinct integer
# pattern per parameter: the mean, (N + 1) / 2 * base, and the sum are exact in floating point.
# Parameter values differ per rank too, so that reducing the values instead of the gradients
# shows.


def _model(with_none: bool = False) -> nn.Module:
    layers = OrderedDict(hidden=nn.Linear(3, 4), act=nn.ReLU(), out=nn.Linear(4, 2))
    if with_none:
        layers["frozen"] = nn.Linear(2, 2)  # requires_grad off: its .grad stays None
    model = nn.Sequential(layers)
    if with_none:
        model.frozen.requires_grad_(False)
        model.register_parameter("unused", nn.Parameter(torch.zeros(2)))  # trainable, no grad yet
    return model


def _pattern(index: int, param: torch.Tensor) -> torch.Tensor:
    return torch.arange(1.0, param.numel() + 1).reshape(param.shape) + 10.0 * index


def _own_grad(index: int, param: torch.Tensor, rank: int) -> torch.Tensor:
    return (rank + 1) * _pattern(index, param)


def _own_value(index: int, param: torch.Tensor, rank: int) -> torch.Tensor:
    return 0.5 * _pattern(index, param) - 100.0 * rank


def _no_grad(name: str) -> bool:
    return name.startswith("frozen") or name == "unused"


def _average(rank, world_size, with_none=False):
    device = rank_device()
    model = _model(with_none).to(device)
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            param.copy_(_own_value(index, param, rank))
            param.grad = None if _no_grad(name) else _own_grad(index, param, rank).to(device)
    average = load_kata(KATA).average_gradients
    try:
        average(model)
    except KataTodo:
        raise
    except Exception as error:
        if with_none and (
            "NoneType" in str(error) or isinstance(error, (AttributeError, TypeError))
        ):
            raise AssertionError(
                t(
                    "rank {rank}: average_gradients raised {error_type}: {error}\n"
                    "This model has parameters whose .grad is None (frozen.weight and frozen.bias "
                    "have requires_grad=False; 'unused' took no part in the forward pass): there "
                    "is nothing to average, so skip them (if param.grad is None: continue).",
                    rank=rank,
                    error_type=type(error).__name__,
                    error=error,
                )
            ) from error
        raise
    return {
        name: (
            param.detach().cpu().clone(),
            None if param.grad is None else param.grad.cpu().clone(),
        )
        for name, param in model.named_parameters()
    }


def _expectations(world_size: int, with_none: bool = False):
    model = _model(with_none)
    for index, (name, param) in enumerate(model.named_parameters()):
        own = [_own_grad(index, param, rank) for rank in range(world_size)]
        values = [_own_value(index, param, rank) for rank in range(world_size)]
        yield name, own, values


def _label(got: torch.Tensor, named: dict) -> str:
    for what, tensor in named.items():
        if _close(got, tensor):
            return what
    return t("neither the mean, the sum nor its own gradient")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=0)


def _run_average(world_size: int, with_none: bool):
    try:
        return run_world(_average, world_size, with_none)
    except WorldDeadlock as failure:
        stuck = sorted(failure.stuck)
        returned = [rank for rank in range(world_size) if rank not in stuck]
        if not returned:
            raise AssertionError(
                t(
                    "average_gradients never returned on any of the {world_size} ranks: the ranks "
                    "called different collectives, or the same ones in a different order. Every "
                    "rank must make the same dist.all_reduce calls, one per parameter with a "
                    "gradient, in the order of model.parameters().\n\n{failure}",
                    world_size=world_size,
                    failure=failure,
                )
            ) from None
        raise AssertionError(
            tn(
                "average_gradients deadlocked: {stuck} was still waiting in a collective after "
                "{returned} had returned, so {returned} skipped the all-reduces that {stuck} made. "
                "Every rank must call dist.all_reduce for every parameter with a gradient (a "
                "collective completes only when all ranks call it): no `if rank == ...` around "
                "the loop.\n\n{failure}",
                "average_gradients deadlocked: {stuck} were still waiting in a collective after "
                "{returned} had returned, so {returned} skipped the all-reduces that {stuck} made. "
                "Every rank must call dist.all_reduce for every parameter with a gradient (a "
                "collective completes only when all ranks call it): no `if rank == ...` around "
                "the loop.\n\n{failure}",
                len(stuck),
                stuck=ranks_phrase(stuck),
                returned=ranks_phrase(returned),
                failure=failure,
            )
        ) from None


def check_average_gradients(world_size: int, with_none: bool = False) -> None:
    results = _run_average(world_size, with_none)
    n = world_size
    averaged, untouched = [], []
    problems = []
    for name, own, values in _expectations(n, with_none):
        for rank in range(n):
            got_value = results[rank][name][0]
            if not _close(got_value, values[rank]):
                if _close(got_value, sum(values) / n) or _close(got_value, sum(values)):
                    raise AssertionError(
                        t(
                            "average_gradients changed the value of parameter {name!r} on rank "
                            "{rank} to {got} (it was {was}, and the ranks' values differ in this "
                            "test): it all-reduced param.data, the weights themselves. Reduce "
                            "param.grad instead.",
                            name=name,
                            rank=rank,
                            got=_show(got_value),
                            was=_show(values[rank]),
                        )
                    )
                raise AssertionError(
                    t(
                        "average_gradients changed the value of parameter {name!r} on rank {rank} "
                        "from {was} to {got}: it must touch only .grad (the optimizer's step "
                        "changes the values)",
                        name=name,
                        rank=rank,
                        was=_show(values[rank]),
                        got=_show(got_value),
                    )
                )
        if with_none and _no_grad(name):
            for rank in range(n):
                grad = results[rank][name][1]
                assert grad is None, t(
                    "parameter {name!r} had no gradient (.grad None) on rank {rank}, but after "
                    "average_gradients it holds {grad}: leave such parameters alone. The "
                    "optimizer skips a parameter without a gradient, while a zero gradient still "
                    "moves it through momentum or weight decay.",
                    name=name,
                    rank=rank,
                    grad=_show(grad),
                )
            continue
        mean, total = sum(own) / n, sum(own)
        grads = [results[rank][name][1] for rank in range(n)]
        emptied = [rank for rank, grad in enumerate(grads) if grad is None]
        if emptied:
            raise AssertionError(
                t(
                    "after average_gradients, parameter {name!r} has no gradient (.grad None) on "
                    "{ranks}, though it held one before: a gradient was replaced, not averaged. "
                    "dist.all_reduce returns None (a Work handle with async_op=True): it changes "
                    "the tensor you pass in place, so call it on param.grad and keep param.grad, "
                    "without assigning its result.",
                    name=name,
                    ranks=ranks_phrase(emptied),
                )
            )
        if all(_close(g, mean) for g in grads):
            averaged.append(name)
            continue
        if n > 1 and all(_close(g, own[rank]) for rank, g in enumerate(grads)):
            untouched.append(name)
            continue
        if all(_close(g, total) for g in grads):
            problems.append(
                t(
                    "every rank holds the sum of the {n} ranks' gradients for {name!r} ({total}), "
                    "not their mean ({mean}): after the SUM all-reduce, divide by the world size, "
                    "dist.get_world_size()",
                    n=n,
                    name=name,
                    total=_show(total),
                    mean=_show(mean),
                )
            )
        elif all(_close(g, own[rank] / n) for rank, g in enumerate(grads)):
            problems.append(
                t(
                    "each rank divided its own gradient of {name!r} by {n} but never combined "
                    "them (rank 0 holds {held}, the mean is {mean}): all_reduce the gradient "
                    "across the ranks as well",
                    name=name,
                    n=n,
                    held=_show(grads[0]),
                    mean=_show(mean),
                )
            )
        elif all(_close(g, grads[0]) for g in grads):
            problems.append(
                t(
                    "every rank holds {held} for the gradient of {name!r}, expected the mean "
                    "{mean}: the sum {total} divided by the world size {n}. Divide by "
                    "dist.get_world_size() (not a fixed number), after a SUM all-reduce.",
                    held=_show(grads[0]),
                    name=name,
                    mean=_show(mean),
                    total=_show(total),
                    n=n,
                )
            )
        else:
            named = {t("the mean"): mean, t("the sum"): total}
            own_gradient = t("its own gradient")
            lines = "\n".join(
                t(
                    "  rank {rank} holds {held} ({what})",
                    rank=rank,
                    held=_show(g),
                    what=_label(g, {**named, own_gradient: own[rank]}),
                )
                for rank, g in enumerate(grads)
            )
            problems.append(
                t(
                    "the ranks disagree about the gradient of {name!r} after average_gradients "
                    "(expected the mean {mean} on every rank):\n{lines}\n"
                    "Every rank must end with the same mean, or the replicas drift apart: use "
                    "dist.all_reduce (every rank gets the result; dist.reduce gives it to one "
                    "rank only), and divide on every rank.",
                    name=name,
                    mean=_show(mean),
                    lines=lines,
                )
            )
    if untouched and averaged:
        problems.insert(
            0,
            t(
                "the gradients of {untouched} were not averaged: every rank still holds its own, "
                "while {averaged} were. Average every parameter: loop over model.parameters() "
                "(weights and biases, every layer).",
                untouched=", ".join(map(repr, untouched)),
                averaged=", ".join(map(repr, averaged)),
            ),
        )
    elif untouched:
        problems.insert(
            0,
            t(
                "no gradient was averaged: after average_gradients every rank still holds its own "
                ".grad. Did you all-reduce param.data (the values) instead of param.grad, or a "
                "copy of the gradient that you then dropped? dist.all_reduce(param.grad) changes "
                "param.grad in place."
            ),
        )
    if problems:
        raise AssertionError(t("with {n} ranks: ", n=n) + "\n".join(problems))


@pytest.mark.step(3)
def test_average_gradients_gives_every_rank_the_mean(kata):
    check_average_gradients(4)


@pytest.mark.step(3)
def test_average_gradients_divides_by_the_world_size(kata):
    check_average_gradients(3)


@pytest.mark.step(3)
def test_average_gradients_leaves_missing_gradients_alone(kata):
    check_average_gradients(2, with_none=True)


@pytest.mark.step(3)
def test_average_gradients_in_a_world_of_one(kata):
    check_average_gradients(1)


# --------------------------------------------------------------------------- the program


@pytest.mark.step(1)
def test_program_prints_every_rank_before_and_after(kata):
    done = run_module_ok(
        KATA, "--world-size", "4", "--backend", "gloo", "--device", "cpu", timeout=90
    )
    expected = [f"[rank {rank}] before all_reduce: tensor([{rank}])" for rank in range(4)]
    expected += [f"[rank {rank}] after  all_reduce(SUM): tensor([6])" for rank in range(4)]
    shown = [line for line in done.stdout.splitlines() if line.startswith("[rank ")]
    assert shown == expected, t(
        "the program should print every rank's tensor before, then after, in rank order:\n"
        "{expected}\nbut it printed:\n{printed}",
        expected="\n".join(expected),
        printed=done.stdout,
    )
    assert "[main] every rank holds [6] after the all-reduce" in done.stdout, done.stdout


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()  # what a real program does before any CUDA work (the harness has too)
    kata = load_kata(KATA)
    before, after = kata.tutorial_allreduce(rank, world_size)
    model = _model().to(device)
    for param in model.parameters():
        param.grad = torch.full_like(param, float(rank + 1))
    kata.average_gradients(model)
    grad_devices = {p.grad.device.type for p in model.parameters()}
    return (
        after.cpu().tolist(),
        after.device.type,
        grad_devices,
        [p.grad.cpu() for p in model.parameters()],
    )


def _check_on_cuda(results, world_size):
    mean = (world_size + 1) / 2
    for rank, (after, device, grad_devices, grads) in enumerate(results):
        assert device == "cuda" and grad_devices == {"cuda"}, t(
            "rank {rank}: the tensors ended on {device} (gradients on {grad_devices}), expected "
            "cuda: make every tensor on dojo.devices.rank_device()",
            rank=rank,
            device=device,
            grad_devices=grad_devices,
        )
        assert after == [sum(range(world_size))], t(
            "rank {rank} holds {after} after the SUM all-reduce", rank=rank, after=after
        )
        assert all(torch.all(g == mean) for g in grads), t(
            "rank {rank}'s averaged gradients are not {mean}", rank=rank, mean=mean
        )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    results = run_world(_on_cuda, 1, **on_cuda(1, "nccl"))
    _check_on_cuda(results, 1)


@pytest.mark.step(3)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    results = run_world(_on_cuda, 2, **on_cuda(2, "gloo"))
    _check_on_cuda(results, 2)
