"""k25 sequence parallel: collectives along the sequence, the conjugate pair, the LayerNorm's
partial gradients, the gathering and scattering linears, the whole block, its activation bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.spec import collectives
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import ranks_phrase, run_module_ok, shared_run, succeeded
from dojo.todo import KataTodo
from dojo.toy_models import Block

KATA = "k25_sequence_parallel"

# Exactness. Gathers and scatters move values unchanged and a reduce-scatter of small integers
# sums exactly: those are compared bit for bit. A layer's output adds partial sums in another
# order than the dense layer (k20), so layers and the block are compared to a close tolerance.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

# Worlds: the whole world of 2 or 4 ranks, or 4 ranks as two groups [0, 1] and [2, 3] (a grid's
# rows, k17): rank and size come from the group, never from the world.
WORLDS = {"2": (2, None), "4": (4, None), "4-rows": (4, [[0, 1], [2, 3]])}
LENGTH = 8  # the toy model's sequence: 4 positions per rank on 2 ranks, 2 on 4


def _calls(calls, group) -> list[tuple[str, str | None, str]]:
    """Each recorded call: its kind (all-gather, reduce-scatter or its name), its op, its group."""
    return [
        (collectives.kind(c.name), c.op, collectives.which_group(c.group, group))
        for c in calls
        if c.name != "new_group"
    ]


def _kinds(calls) -> list[str]:
    return [c[0] for c in calls]


def _where(world: str) -> str:
    return collectives.where(*WORLDS[world])


def _close(a, b) -> bool:
    return close(a, b, **TOLERANCE)


def _fail(rank: int, what: str, error: Exception) -> str:
    text = str(error).strip()
    if "invalid gradient" in text:
        text += (
            ". An autograd function's backward returns one gradient per forward input, shaped "
            "like that input: a gather's input is this rank's positions, a reduce-scatter's the "
            "whole sequence"
        )
    return f"rank {rank}: {what} raised {type(error).__name__}: {text[:500]}"


def _place(rank, world_size, groups):
    """``(group, members, size, index, per)``: this rank's group, the group's ranks and their
    number, this rank's index among them, and how many of the sequence's positions each holds."""
    group, members = collectives.rank_group(rank, world_size, groups)
    size = len(members)
    return group, members, size, members.index(rank), LENGTH // size


def _share(index: int, width: int) -> slice:
    """The ``index``-th of equal shares ``width`` wide."""
    return slice(index * width, (index + 1) * width)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_one(rank: int, calls, kind: str, what: str, where: str) -> None:
    """Exactly one call of ``kind`` (an all-gather or a reduce-scatter, a sum), on the group."""
    kinds = _kinds(calls)
    if kind == "reduce-scatter" and kinds == ["all-reduce"]:
        raise AssertionError(
            f"rank {rank}: {what} all-reduced and kept its own positions {where}: right values, "
            "but an all-reduce sends every rank every position's sum, and N-1 of N are thrown "
            "away. A reduce-scatter sends each rank only its positions' sums: half the bytes of "
            "an all-reduce (which is a reduce-scatter and an all-gather). Reduce-scatter instead"
        )
    assert kinds == [kind], (
        f"rank {rank}: {what} called {kinds or 'nothing'} {where}: exactly one {kind}"
    )
    _, op, group = calls[0]
    assert op in (None, "SUM"), f"rank {rank}: {what} reduced with op={op}: it is a sum (SUM)"
    assert group == "the group", (
        f"rank {rank}: {what} ran on {group} {where}: pass the group it was given (kept in ctx "
        "for backward)"
    )


# --------------------------------------------------------------------------- step 1


def _along(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    out = {"members": members, "index": index, "per": per}
    try:
        out["range"] = kata.sequence_range(LENGTH, group)
    except KataTodo:
        raise
    except Exception as error:
        out["range"] = _fail(rank, f"sequence_range({LENGTH})", error)
    # small integers: sums are exact; every rank's values differ
    piece = torch.arange(4 * per * 3, dtype=torch.float32).view(4, per, 3) + 1000 * rank
    full = torch.arange(4 * LENGTH * 3, dtype=torch.float32).view(4, LENGTH, 3) * (rank + 1)
    out["piece"], out["full"] = piece, full
    for name, fn, given in (
        ("gather", kata.all_gather_sequence, piece),
        ("scatter", kata.reduce_scatter_sequence, full),
    ):
        before = given.clone()
        try:
            with recording() as calls:
                value = fn(given, group)
        except KataTodo:
            raise
        except Exception as error:
            out[name] = {"failure": _fail(rank, f"{fn.__name__}", error)}
            continue
        out[name] = {
            "failure": None,
            "value": value.detach().clone(),
            "changed": not torch.equal(given, before),
            "calls": _calls(calls, group),
        }
    return out


_along_world = shared_run(lambda world: run_world(_along, *WORLDS[world]))


@pytest.mark.step(1)
@pytest.mark.parametrize("world", list(WORLDS))
def test_sequence_range_gives_each_rank_its_positions_in_group_order(kata, world):
    where = _where(world)
    for rank, got in enumerate(_along_world(world)):
        index, per = got["index"], got["per"]
        expected = (index * per, (index + 1) * per)
        if isinstance(got["range"], str):
            raise AssertionError(got["range"])
        assert tuple(got["range"]) == expected, (
            f"rank {rank} (rank {index} of its group {got['members']}): sequence_range({LENGTH}) "
            f"is {got['range']}, expected {expected} {where}: equal shares in the order of the "
            "ranks IN THE GROUP, dist.get_rank(group) (the world rank is another number in a "
            "subgroup)"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("world", list(WORLDS))
def test_all_gather_sequence_puts_every_rank_s_positions_in_order(kata, world):
    where = _where(world)
    results = _along_world(world)
    for rank, got in enumerate(results):
        done = succeeded(got["gather"])
        members = got["members"]
        pieces = [results[m]["piece"] for m in members]
        expected = torch.cat(pieces, dim=1)
        value = done["value"]
        if value.shape == torch.cat(pieces, dim=0).shape and value.shape != expected.shape:
            raise AssertionError(
                f"rank {rank}: all_gather_sequence returned a tensor shaped {tuple(value.shape)}, "
                f"expected {tuple(expected.shape)} {where}: it gathered along the batch (dim 0), "
                "as the all-gather into one tensor does. The sequence is dim 1 of (batch, "
                "sequence, dim): put the ranks' pieces end to end along dim 1"
            )
        _check_one(rank, done["calls"], "all-gather", "all_gather_sequence", where)
        if value.shape == expected.shape and not torch.equal(value, expected):
            if torch.equal(torch.cat(pieces, dim=0).reshape(expected.shape), value):
                raise AssertionError(
                    f"rank {rank}: all_gather_sequence mixed the batch and the ranks {where}: "
                    "reshaping the gathered (N * batch, sequence / N, dim) straight to (batch, "
                    "sequence, dim) puts rank 0's second sequence where rank 1's positions of the "
                    "first belong. View it as (N, batch, sequence / N, dim) and move the ranks' "
                    "dimension next to the sequence (transpose(0, 1)) before the reshape"
                )
        assert value.shape == expected.shape and torch.equal(value, expected), (
            f"rank {rank}: all_gather_sequence is not every rank's positions end to end along "
            f"the sequence, in the group's order {members} ({gap(value, expected)}) {where}"
        )
        assert not done["changed"], f"rank {rank}: all_gather_sequence changed its input"


@pytest.mark.step(1)
@pytest.mark.parametrize("world", list(WORLDS))
def test_reduce_scatter_sequence_gives_each_rank_the_sum_of_its_positions(kata, world):
    where = _where(world)
    results = _along_world(world)
    for rank, got in enumerate(results):
        done = succeeded(got["scatter"])
        members, index, per = got["members"], got["index"], got["per"]
        total = sum(results[m]["full"] for m in members)
        expected = total[:, _share(index, per)]
        value = done["value"]
        if value.shape == total[: 4 // len(members)].shape and value.shape != expected.shape:
            raise AssertionError(
                f"rank {rank}: reduce_scatter_sequence returned a tensor shaped "
                f"{tuple(value.shape)}, expected {tuple(expected.shape)} {where}: it scattered "
                "the batch (dim 0), as the reduce-scatter of one tensor does. Each rank gets its "
                "POSITIONS (dim 1): lay the tensor out so that rank r's positions are the r-th "
                "block of dim 0 first"
            )
        if value.shape == expected.shape and torch.equal(value * len(members), expected):
            raise AssertionError(
                f"rank {rank}: reduce_scatter_sequence returned the mean over the group {where}, "
                f"expected the sum: do not divide by the group's size {len(members)}"
            )
        _check_one(rank, done["calls"], "reduce-scatter", "reduce_scatter_sequence", where)
        size = len(members)
        flat = total.reshape(size * 4, per, 3)[index * 4 : (index + 1) * 4]
        if value.shape == expected.shape and torch.equal(value, flat):
            raise AssertionError(
                f"rank {rank}: reduce_scatter_sequence gave a mix of sequences and positions "
                f"{where}: reshaping (batch, sequence, dim) straight to (N * batch, sequence / N, "
                "dim) does not put rank r's positions in block r (it cuts each sequence in N "
                "pieces, batch by batch). View it as (batch, N, sequence / N, dim), move the "
                "ranks' dimension first (transpose(0, 1)), make that contiguous, then "
                "reduce-scatter"
            )
        if value.shape == expected.shape and not torch.equal(value, expected):
            for other in range(len(members)):
                if torch.equal(value, total[:, other * per : (other + 1) * per]):
                    raise AssertionError(
                        f"rank {rank} (rank {index} of its group {members}) holds the sum of "
                        f"positions {other * per}..{(other + 1) * per - 1}, expected "
                        f"{index * per}..{(index + 1) * per - 1} {where}: rank r's positions must "
                        "be the r-th block of the tensor the reduce-scatter splits"
                    )
        assert value.shape == expected.shape and torch.equal(value, expected), (
            f"rank {rank}: reduce_scatter_sequence is not the group's sum of its positions "
            f"{index * per}..{(index + 1) * per - 1} ({gap(value, expected)}) {where}"
        )
        assert not done["changed"], (
            f"rank {rank}: reduce_scatter_sequence changed its input: reduce-scatter a copy"
        )


def _refused(rank, world_size, length):
    kata = load_kata(KATA)
    out = {}
    for name, call in (
        (f"sequence_range({length})", lambda: kata.sequence_range(length, None)),
        (
            f"reduce_scatter_sequence of a (2, {length}, 3) tensor",
            lambda: kata.reduce_scatter_sequence(torch.ones(2, length, 3), None),
        ),
    ):
        try:
            value = call()
        except ValueError as error:
            out[name] = (None, str(error))
        except KataTodo:
            raise
        except Exception as error:
            out[name] = (f"raised {type(error).__name__}: {str(error)[:200]}", None)
        else:
            shown = tuple(value.shape) if hasattr(value, "shape") else value
            out[name] = (f"returned {shown}", None)
    return out


@pytest.mark.step(1)
def test_a_sequence_that_does_not_divide_is_refused(kata):
    for rank, got in enumerate(run_world(_refused, 4, 10)):
        for name, (did, message) in got.items():
            assert did is None, (
                f"rank {rank}: {name} on 4 ranks {did}: 10 positions do not split over 4 ranks "
                "(every rank must hold as many). Raise ValueError saying so, before any "
                "collective"
            )
            assert "10" in message and "4" in message, (
                f"rank {rank}: {name} raised ValueError({message!r}): name the sequence's "
                "length (10) and the group's size (4), and say what to do"
            )


# --------------------------------------------------------------------------- step 2


def _pair(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    out = {"members": members, "index": index, "per": per}
    piece = torch.arange(2 * per * 3, dtype=torch.float32).view(2, per, 3) + 100 * rank
    full = torch.arange(2 * LENGTH * 3, dtype=torch.float32).view(2, LENGTH, 3) - rank
    upstream_full = (rank + 1) * torch.arange(2 * LENGTH * 3, dtype=torch.float32).view(
        2, LENGTH, 3
    )
    upstream_mine = (rank + 1) * torch.arange(2 * per * 3, dtype=torch.float32).view(2, per, 3)
    out.update(piece=piece, full=full, up_full=upstream_full, up_mine=upstream_mine)
    for name, apply, given, upstream in (
        ("gather", kata.gather_from_sequence_parallel_region, piece, upstream_full),
        ("scatter", kata.reduce_scatter_to_sequence_parallel_region, full, upstream_mine),
    ):
        leaf = given.clone().requires_grad_()
        try:
            with recording() as forward:
                y = apply(leaf, group)
            value = y.detach().clone()
        except KataTodo:
            raise
        except Exception as error:
            out[name] = {"failure": _fail(rank, f"the {name} region's forward", error)}
            continue
        out[name] = {
            "failure": None,
            "value": value,
            "forward": _calls(forward, group),
            "backward_failure": None,
        }
        try:
            with recording() as backward:
                y.backward(upstream.clone())
        except KataTodo:
            raise
        except Exception as error:
            failure = _fail(rank, f"the {name} region's backward", error)
            if groups is not None and "invalid gradient" in failure:
                failure += (
                    f" (in the group {members}: did backward use the group forward was given, "
                    "kept in ctx, or the whole world?)"
                )
            out[name]["backward_failure"] = failure
            continue
        out[name]["grad"] = None if leaf.grad is None else leaf.grad.clone()
        out[name]["backward"] = _calls(backward, group)
    return out


_pair_world = shared_run(lambda world: run_world(_pair, *WORLDS[world]))


@pytest.mark.step(2)
@pytest.mark.parametrize("world", list(WORLDS))
def test_gather_region_all_gathers_forward_and_reduce_scatters_backward(kata, world):
    where = _where(world)
    results = _pair_world(world)
    world_size = WORLDS[world][0]
    what = "GatherFromSequenceParallelRegion"
    for rank, got in enumerate(results):
        done = succeeded(got["gather"])
        members, index, per = got["members"], got["index"], got["per"]
        mine = _share(index, per)
        expected = torch.cat([results[m]["piece"] for m in members], dim=1)
        _check_one(rank, done["forward"], "all-gather", f"{what}'s forward", where)
        assert torch.equal(done["value"], expected), (
            f"rank {rank}: {what}'s forward is not every rank's positions in order "
            f"({gap(done['value'], expected)}) {where}: all_gather_sequence"
        )
        if done["backward_failure"]:
            raise AssertionError(done["backward_failure"])
        grad = done["grad"]
        summed = sum(results[m]["up_full"] for m in members)[:, mine]
        if grad is None:
            raise AssertionError(
                f"rank {rank}: this rank's positions got no gradient through {what}"
            )
        if torch.equal(grad, got["up_full"][:, mine]) and not done["backward"]:
            raise AssertionError(
                f"rank {rank}: {what}'s backward kept this rank's positions of its own gradient "
                f"and made no call {where}: every rank's gathered copy used my positions, so their "
                "gradient is the SUM over the group of every copy's gradient at my positions. "
                "Reduce-scatter the gradient (reduce_scatter_sequence)"
            )
        if torch.equal(grad * len(members), summed):
            raise AssertionError(
                f"rank {rank}: {what}'s backward gave the mean over the group {where}, expected "
                f"the sum: every copy's gradient counts whole, do not divide by {len(members)}"
            )
        if world_size != len(members):
            everyone = sum(r["up_full"] for r in results)[:, mine]
            if torch.equal(grad, everyone):
                raise AssertionError(
                    f"rank {rank}: {what}'s backward summed over the whole world {where}, not "
                    f"over its group {members}: keep the group in ctx and pass it on"
                )
        _check_one(rank, done["backward"], "reduce-scatter", f"{what}'s backward", where)
        assert torch.equal(grad, summed), (
            f"rank {rank}: the gradient through {what} is not the group's sum at this rank's "
            f"positions ({gap(grad, summed)}) {where}"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize("world", list(WORLDS))
def test_reduce_scatter_region_reduce_scatters_forward_and_all_gathers_backward(kata, world):
    where = _where(world)
    results = _pair_world(world)
    what = "ReduceScatterToSequenceParallelRegion"
    for rank, got in enumerate(results):
        done = succeeded(got["scatter"])
        members, index, per = got["members"], got["index"], got["per"]
        mine = _share(index, per)
        expected = sum(results[m]["full"] for m in members)[:, mine]
        _check_one(rank, done["forward"], "reduce-scatter", f"{what}'s forward", where)
        assert torch.equal(done["value"], expected), (
            f"rank {rank}: {what}'s forward is not the group's sum at this rank's positions "
            f"({gap(done['value'], expected)}) {where}: reduce_scatter_sequence"
        )
        if done["backward_failure"]:
            raise AssertionError(done["backward_failure"])
        grad = done["grad"]
        gathered = torch.cat([results[m]["up_mine"] for m in members], dim=1)
        if grad is None:
            raise AssertionError(f"rank {rank}: the input got no gradient through {what}")
        if grad.shape == gathered.shape and not done["backward"]:
            zeros = torch.zeros_like(gathered)
            zeros[:, mine] = got["up_mine"]
            if torch.equal(grad, zeros):
                raise AssertionError(
                    f"rank {rank}: {what}'s backward gave this rank's positions its own gradient "
                    f"and zeros elsewhere {where}: every rank's partial contributed to EVERY "
                    "position's sum, so each partial's gradient is the gradient of every "
                    "position, whichever rank holds it. All-gather the gradient "
                    "(all_gather_sequence)"
                )
        _check_one(rank, done["backward"], "all-gather", f"{what}'s backward", where)
        assert torch.equal(grad, gathered), (
            f"rank {rank}: the gradient through {what} is not every rank's gradient gathered in "
            f"order ({gap(grad, gathered)}) {where}"
        )


# --------------------------------------------------------------------------- step 3


def _dense_norm(dim: int = 16, seed: int = 3) -> nn.LayerNorm:
    norm = nn.LayerNorm(dim)
    with torch.no_grad():  # not the ones and zeros of a fresh LayerNorm: gradients tell more
        norm.weight.copy_(1 + 0.1 * _randn(dim, seed=seed))
        norm.bias.copy_(0.1 * _randn(dim, seed=seed + 1))
    return norm


class _NormAndOther(nn.Module):
    """A sequence-parallel LayerNorm and a parameter that is not (its gradient complete)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.other = nn.Parameter(torch.zeros(5))


def _norm_grads(norm) -> tuple:
    """The LayerNorm's weight and bias gradients, copies (None where there is none)."""
    return tuple(None if p.grad is None else p.grad.clone() for p in (norm.weight, norm.bias))


def _norm(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    mine = _share(index, per)
    dense = _dense_norm()
    x = _randn(3, LENGTH, 16, seed=7)
    upstream = _randn(3, LENGTH, 16, seed=8)
    dense(x).backward(upstream)
    try:
        norm = kata.SequenceParallelLayerNorm(copy.deepcopy(dense))
        leaf = x[:, mine].clone().requires_grad_()
        with recording() as forward:
            y = norm(leaf)
        y.backward(upstream[:, mine])
        local = _norm_grads(norm)
        holder = _NormAndOther(norm)
        holder.other.grad = torch.full((5,), float(rank + 1))
        with recording() as synced:
            count = kata.sync_sequence_parallel_grads(holder, group)
    except KataTodo:
        raise
    except Exception as error:
        return {"failure": _fail(rank, "SequenceParallelLayerNorm or the sync", error)}
    return {
        "failure": None,
        "rank": rank,
        "members": members,
        "size": size,
        "output": y.detach().clone(),
        "expected_output": dense(x).detach()[:, mine],
        "x_grad": leaf.grad.clone(),
        "forward": _calls(forward, group),
        "local": local,
        "synced": _norm_grads(norm),
        "expected": (dense.weight.grad.clone(), dense.bias.grad.clone()),
        "other": holder.other.grad.clone(),
        "count": count,
        "calls": _calls(synced, group),
    }


_norm_world = shared_run(lambda world: run_world(_norm, *WORLDS[world]))


@pytest.mark.step(3)
@pytest.mark.parametrize("world", list(WORLDS))
def test_layer_norm_normalizes_my_positions_without_communicating(kata, world):
    where = _where(world)
    for got in _norm_world(world):
        succeeded(got)
        rank = got["rank"]
        assert not got["forward"], (
            f"rank {rank}: SequenceParallelLayerNorm's forward called {_kinds(got['forward'])} "
            f"{where}: a LayerNorm normalizes each position over its own features, so this "
            "rank's positions need nothing from any other rank. Normalize the slice as it is"
        )
        assert _close(got["output"], got["expected_output"]), (
            f"rank {rank}: SequenceParallelLayerNorm's output is not the dense LayerNorm's at "
            f"this rank's positions ({gap(got['output'], got['expected_output'])}) {where}: "
            "normalize over the last dimension (normalized_shape) with its weight and bias "
            "(self.weight, self.bias)"
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("world", list(WORLDS))
def test_sync_sums_the_partial_gradients_in_one_all_reduce(kata, world):
    where = _where(world)
    results = _norm_world(world)
    world_size = WORLDS[world][0]
    for got in results:
        succeeded(got)
        rank, members, size = got["rank"], got["members"], got["size"]
        for i, name in enumerate(("weight", "bias")):
            if any(r["local"][i] is None for r in results):
                raise AssertionError(
                    f"rank {rank}: the LayerNorm's {name} got no gradient in backward {where}: "
                    "SequenceParallelLayerNorm's forward did not use it (self.weight, self.bias: "
                    "F.layer_norm(x, shape, self.weight, self.bias, eps) uses both)"
                )
        local_sum = [sum(results[m]["local"][i] for m in members) for i in range(2)]
        for i, name in enumerate(("weight", "bias")):
            grad, expected = got["synced"][i], got["expected"][i]
            if grad is None:
                raise AssertionError(
                    f"rank {rank}: after sync_sequence_parallel_grads the LayerNorm's {name} has "
                    f"no gradient (.grad None) {where}: the sync leaves every marked parameter "
                    "its gradient, summed over the group"
                )
            if _close(grad, got["local"][i]) and size > 1:
                raise AssertionError(
                    f"rank {rank}: after sync_sequence_parallel_grads the LayerNorm's {name} "
                    f"gradient is still this rank's own share {where}: it was computed from this "
                    f"rank's positions only, a partial sum of the whole gradient. Sum it over the "
                    "group (all-reduce) for every parameter marked sequence_parallel"
                )
            if _close(grad * size, expected):
                raise AssertionError(
                    f"rank {rank}: the LayerNorm's {name} gradient after the sync is the mean of "
                    f"the ranks' shares {where}: each rank's share is a part of one sum, so add "
                    f"them: do not divide by {size}"
                )
            if world_size != size:
                everyone = sum(r["local"][i] for r in results)
                if _close(grad, everyone):
                    raise AssertionError(
                        f"rank {rank}: the LayerNorm's {name} gradient was summed over the whole "
                        f"world {where}, not over its group {members}: pass the group to the "
                        "all-reduce"
                    )
            assert _close(grad, expected) and _close(grad, local_sum[i]), (
                f"rank {rank}: the LayerNorm's {name} gradient after the sync is not the dense "
                f"LayerNorm's ({gap(grad, expected)}) {where}"
            )
        other = got["other"]
        assert torch.equal(other, torch.full((5,), float(rank + 1))), (
            f"rank {rank}: sync_sequence_parallel_grads changed the gradient of a parameter not "
            f"marked sequence_parallel (now {other.tolist()}, it was {float(rank + 1)} each) "
            f"{where}: only the marked parameters' gradients are partial; the others (a "
            "column-parallel shard, a row-parallel weight) are complete already, and summing "
            "them adds up different ranks' gradients. Sum only p.sequence_parallel ones"
        )
        reduces = [c for c in got["calls"] if c[0] == "all-reduce"]
        assert len(reduces) == 1 and len(got["calls"]) == 1, (
            f"rank {rank}: sync_sequence_parallel_grads called {_kinds(got['calls'])} {where} for "
            "2 gradients: one all-reduce for all of them. Every call pays a fixed cost (k13's "
            "buckets): flatten the gradients into one buffer, all-reduce it, copy back"
        )
        _, op, group = reduces[0]
        assert op in (None, "SUM") and group == "the group", (
            f"rank {rank}: the sync's all-reduce ran with op={op} on {group}: a SUM on the group"
        )
        assert got["count"] == 2, (
            f"rank {rank}: sync_sequence_parallel_grads returned {got['count']!r}, expected 2 "
            "(the LayerNorm's weight and bias: the gradients it summed)"
        )


def _without_gradients(members: list[int]) -> list[int]:
    """The ranks a test leaves without gradients: the last of each group."""
    return [members[-1]]


def _norm_partly_unused(rank, world_size, groups):
    """The LayerNorm's partial gradients where the group's last rank has none (its positions took
    no part in this backward: .grad None), the sync, and what it left."""
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    holder = _NormAndOther(kata.SequenceParallelLayerNorm(_dense_norm()))
    holder.other.grad = torch.full((5,), float(rank + 1))
    bare = rank in _without_gradients(members)
    shares = {}  # every rank of the group's share (small integers: the sums are exact)
    for member in members:
        if member not in _without_gradients(members):
            shares[member] = (torch.full((16,), float(member + 1)), torch.arange(16.0) * member)
    if not bare:
        holder.norm.weight.grad, holder.norm.bias.grad = (t.clone() for t in shares[rank])
    try:
        with recording() as synced:
            kata.sync_sequence_parallel_grads(holder, group)
    except KataTodo:
        raise
    except Exception as error:  # its peers wait in the sync: say it now, in the kata's words
        raise AssertionError(
            f"sync_sequence_parallel_grads raised {type(error).__name__}: {str(error)[:300]}"
            + (
                ", on a rank whose LayerNorm has no gradient (.grad None: its positions took no "
                "part in this backward). A missing gradient counts as zeros "
                "(torch.zeros_like(p)): this rank makes the same all-reduce as its peers"
                if bare
                else ""
            )
        ) from error
    expected = [sum(share[i] for share in shares.values()) for i in range(2)]
    grads = (holder.norm.weight.grad, holder.norm.bias.grad)
    return {
        "rank": rank,
        "members": members,
        "bare": bare,
        "grads": [None if g is None else g.clone() for g in grads],
        "expected": expected,
        "other": holder.other.grad.clone(),
        "calls": _calls(synced, group),
    }


@pytest.mark.step(3)
@pytest.mark.parametrize("world", ["2", "4-rows"])
def test_sync_makes_the_same_call_on_a_rank_without_gradients(kata, world):
    where = _where(world)
    world_size, groups = WORLDS[world]
    bare = [m for members in groups or [list(range(world_size))] for m in members[-1:]]
    try:
        results = run_world(_norm_partly_unused, world_size, groups)
    except WorldDeadlock as deadlock:
        stuck = sorted(deadlock.stuck)
        if set(stuck).isdisjoint(bare):
            why = (
                f"{ranks_phrase(bare)}, whose LayerNorm has no gradient (.grad None: its "
                "positions took no part in this backward), returned without the all-reduce that "
                f"{ranks_phrase(stuck)} waited in for ever. Every rank of the group must make "
                "the same call, whatever it holds: count a missing gradient as zeros "
                "(torch.zeros_like(p)) rather than leaving it out"
            )
        else:
            why = (
                f"the ranks waited for each other for ever ({ranks_phrase(bare)} holding no "
                f"gradient, {ranks_phrase(stuck)} stuck)"
            )
        raise AssertionError(f"sync_sequence_parallel_grads {where}: {why}.\n{deadlock}") from None
    for got in results:
        rank, members = got["rank"], got["members"]
        weight, bias = got["grads"]
        if got["bare"] and (weight is None or bias is None):
            raise AssertionError(
                f"rank {rank}: after sync_sequence_parallel_grads {where} the LayerNorm's "
                "gradient is still None on this rank, which had none: its LayerNorm is a replica "
                "like every other rank's, so it needs the group's sum too (or it drifts apart "
                f"from {ranks_phrase([m for m in members if m != rank])}'s). Give it the summed "
                "buffer, as the others"
            )
        for name, grad, expected in zip(("weight", "bias"), (weight, bias), got["expected"]):
            assert grad is not None and torch.equal(grad, expected), (
                f"rank {rank}: after sync_sequence_parallel_grads the LayerNorm's {name} "
                f"gradient is not the group's sum ({gap(grad, expected)}) {where}, where "
                f"{ranks_phrase(bare)} had no gradient: expected the sum of the others' shares "
                "(a missing gradient counts as zeros)"
            )
        assert torch.equal(got["other"], torch.full((5,), float(rank + 1))), (
            f"rank {rank}: sync_sequence_parallel_grads changed the gradient of a parameter not "
            f"marked sequence_parallel {where}: sum only p.sequence_parallel ones"
        )
        assert [c[0] for c in got["calls"]] == ["all-reduce"], (
            f"rank {rank}: sync_sequence_parallel_grads called {_kinds(got['calls'])} {where}, "
            f"where {ranks_phrase(bare)} had no gradient: one all-reduce on every rank, whatever "
            "it holds"
        )


# --------------------------------------------------------------------------- step 4


def _dense(in_features: int, out_features: int, seed: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features)


def _saved_bytes(run, module: nn.Module):
    """``run()``'s result and the bytes of the storages autograd saved meanwhile, params aside."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return result, sum(saved.values())


def _column(rank, world_size, groups, layers):
    """``layers`` column-parallel layers (16 -> 32) reading one slice, through all_gather_linear."""
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    mine, feat = _share(index, per), _share(index, 32 // size)  # its positions, its features
    dense = [_dense(16, 32, seed=3 + i) for i in range(layers)]
    x = _randn(3, LENGTH, 16, seed=7)
    upstream = [_randn(3, LENGTH, 32, seed=8 + i) for i in range(layers)]
    leaf = x.clone().requires_grad_()
    sum((d(leaf) * u).sum() for d, u in zip(dense, upstream)).backward()
    try:
        split = [kata.ColumnParallelLinear(copy.deepcopy(d), group) for d in dense]
        holder = nn.ModuleList(split)
        shard = x[:, mine].clone().requires_grad_()
        with recording() as forward:
            if layers == 1:
                (ys, saved) = _saved_bytes(lambda: (split[0](shard),), holder)
            else:
                (ys, saved) = _saved_bytes(
                    lambda: kata.all_gather_linear(shard, split, group), holder
                )
        with recording() as backward:
            sum((y * u[..., feat]).sum() for y, u in zip(ys, upstream)).backward()
    except KataTodo:
        raise
    except Exception as error:
        return {"failure": _fail(rank, "the column-parallel layer (AllGatherLinear)", error)}
    return {
        "failure": None,
        "rank": rank,
        "size": size,
        "outputs": [y.detach().clone() for y in ys],
        "expected_outputs": [d(x).detach()[..., feat] for d in dense],
        "x_grad": shard.grad,
        "expected_x_grad": leaf.grad[:, mine],
        "grads": [(s.weight.grad, s.bias.grad) for s in split],
        "expected_grads": [(d.weight.grad[feat], d.bias.grad[feat]) for d in dense],
        "forward": _calls(forward, group),
        "backward": _calls(backward, group),
        "saved": saved,
        "slice_bytes": shard.numel() * 4,
        "full_bytes": x.numel() * 4,
    }


def _check_column(world, results, layers):
    where = _where(world)
    what = "AllGatherLinear" + (f" with {layers} layers" if layers > 1 else "")
    for got in results:
        succeeded(got)
        rank = got["rank"]
        _check_one(rank, got["forward"], "all-gather", f"{what}'s forward", where)
        for i, (y, expected) in enumerate(zip(got["outputs"], got["expected_outputs"])):
            assert _close(y, expected), (
                f"rank {rank}: {what}'s output {i} is not the dense layer's output features of "
                f"this rank over the WHOLE sequence ({gap(y, expected)}) {where}: gather the "
                "positions first, then F.linear with this rank's weight and bias"
            )
        kinds = sorted(_kinds(got["backward"]))
        if got["saved"] >= got["full_bytes"] and got["size"] > 1:
            raise AssertionError(
                f"rank {rank}: {what} kept {got['saved']} bytes for backward {where}, the whole "
                f"gathered input ({got['full_bytes']} bytes) where this rank's positions are "
                f"{got['slice_bytes']}: that keeps the full sequence alive until backward, the "
                "memory sequence parallelism is there to save. Save only x (your slice) and "
                "gather it again in backward"
            )
        if kinds == ["reduce-scatter"]:
            raise AssertionError(
                f"rank {rank}: {what}'s backward made a reduce-scatter only {where}: the weight "
                "gradient needs the gathered input, and only the slice was kept: gather it "
                "again in backward (one all-gather), then reduce-scatter the input's gradient"
            )
        assert kinds == ["all-gather", "reduce-scatter"], (
            f"rank {rank}: {what}'s backward called {_kinds(got['backward']) or 'nothing'} "
            f"{where}: one all-gather (the input again) and one reduce-scatter (the input's "
            "gradient, summed over the ranks' features, to each rank's positions)"
            + (", for all the layers together" if layers > 1 and len(got["backward"]) > 2 else "")
        )
        for _, op, group in got["backward"]:
            assert op in (None, "SUM") and group == "the group", (
                f"rank {rank}: {what}'s backward called a collective with op={op} on {group}: "
                "sums, on the layer's group"
            )
        assert got["saved"] == got["slice_bytes"], (
            f"rank {rank}: {what} kept {got['saved']} bytes for backward {where}, expected "
            f"{got['slice_bytes']}: this rank's positions of the input and nothing else (the "
            "weights are parameters, kept anyway)"
        )
        assert _close(got["x_grad"], got["expected_x_grad"]), (
            f"rank {rank}: the input's gradient through {what} is not the dense layer's at this "
            f"rank's positions ({gap(got['x_grad'], got['expected_x_grad'])}) {where}: every "
            "rank's features sent gradient to every position; sum them (reduce-scatter) so each "
            "rank gets its own positions"
        )
        for i, ((wg, bg), (we, be)) in enumerate(zip(got["grads"], got["expected_grads"])):
            assert _close(wg, we), (
                f"rank {rank}: layer {i}'s weight gradient is not the dense layer's rows of this "
                f"rank ({gap(wg, we)}) {where}: grad^T @ the GATHERED input, every position"
            )
            assert _close(bg, be), (
                f"rank {rank}: layer {i}'s bias gradient is not the dense layer's entries of "
                f"this rank ({gap(bg, be)}) {where}: the gradient summed over every position "
                "(batch and sequence)"
            )


_columns = shared_run(lambda world, layers: run_world(_column, *WORLDS[world], layers))


@pytest.mark.step(4)
@pytest.mark.parametrize("world", list(WORLDS))
def test_column_parallel_gathers_once_and_keeps_only_my_positions(kata, world):
    _check_column(world, _columns(world, 1), 1)


@pytest.mark.step(4)
@pytest.mark.parametrize("world", ["2", "4-rows"])
def test_all_gather_linear_serves_several_layers_with_one_gather(kata, world):
    _check_column(world, _columns(world, 3), 3)


def _row(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    mine, feat = _share(index, per), _share(index, 32 // size)  # its positions, its features
    dense = _dense(32, 16, seed=5)
    x = _randn(3, LENGTH, 32, seed=9)
    upstream = _randn(3, LENGTH, 16, seed=10)
    leaf = x.clone().requires_grad_()
    dense(leaf).backward(upstream)
    try:
        layer = kata.RowParallelLinear(copy.deepcopy(dense), group)
        inputs = x[..., feat].clone().requires_grad_()
        with recording() as forward:
            y = layer(inputs)
        with recording() as backward:
            y.backward(upstream[:, mine])
        local_bias = None if layer.bias.grad is None else layer.bias.grad.clone()
        with recording() as synced:
            kata.sync_sequence_parallel_grads(layer, group)
    except KataTodo:
        raise
    except Exception as error:
        return {"failure": _fail(rank, "RowParallelLinear", error)}
    return {
        "failure": None,
        "rank": rank,
        "size": size,
        "output": y.detach().clone(),
        "expected_output": dense(x).detach()[:, mine],
        "bias": dense.bias.detach().clone(),
        "x_grad": inputs.grad,
        "expected_x_grad": leaf.grad[..., feat],
        "weight_grad": layer.weight.grad,
        "expected_weight_grad": dense.weight.grad[:, feat],
        "local_bias_grad": local_bias,
        "bias_grad": layer.bias.grad,
        "expected_bias_grad": dense.bias.grad,
        "forward": _calls(forward, group),
        "backward": _calls(backward, group),
        "synced": _calls(synced, group),
    }


_rows = shared_run(lambda world: run_world(_row, *WORLDS[world]))


@pytest.mark.step(4)
@pytest.mark.parametrize("world", list(WORLDS))
def test_row_parallel_reduce_scatters_and_adds_the_bias_once(kata, world):
    where = _where(world)
    what = "RowParallelLinear(nn.Linear(32, 16))"
    results = _rows(world)
    for got in results:  # every rank's output first, then the gradients
        succeeded(got)
        rank, size = got["rank"], got["size"]
        output, expected, bias = got["output"], got["expected_output"], got["bias"]
        if _close(output, expected + (size - 1) * bias):
            raise AssertionError(
                f"rank {rank}: {what}'s output is the dense output plus {size - 1} extra "
                f"bias(es) {where}: the bias was added to every rank's partial BEFORE the "
                f"reduce-scatter, so the sum counted it {size} times. Add it once, after"
            )
        _check_one(rank, got["forward"], "reduce-scatter", f"{what}'s forward", where)
        assert _close(output, expected), (
            f"rank {rank}: {what}'s output is not the dense layer's at this rank's positions "
            f"({gap(output, expected)}) {where}: F.linear without the bias, the region's "
            "reduce-scatter, then + self.bias on every rank"
        )
    for got in results:
        rank = got["rank"]
        _check_one(rank, got["backward"], "all-gather", f"{what}'s backward", where)
        assert _close(got["x_grad"], got["expected_x_grad"]), (
            f"rank {rank}: the input's gradient through {what} is not the dense layer's "
            f"({gap(got['x_grad'], got['expected_x_grad'])}) {where}"
        )
        assert _close(got["weight_grad"], got["expected_weight_grad"]), (
            f"rank {rank}: {what}'s weight gradient is not the dense layer's columns of this "
            f"rank ({gap(got['weight_grad'], got['expected_weight_grad'])}) {where}"
        )
        assert got["bias_grad"] is not None and _close(
            got["bias_grad"], got["expected_bias_grad"]
        ), (
            f"rank {rank}: {what}'s bias gradient after sync_sequence_parallel_grads is not the "
            f"dense layer's ({gap(got['bias_grad'], got['expected_bias_grad'])}; before the sync "
            f"{gap(got['local_bias_grad'], got['expected_bias_grad'])}) {where}: the bias is "
            "added on this rank's positions only, so its gradient is a partial sum like a "
            "LayerNorm's: RowParallelLinear marks it sequence_parallel; did "
            "sync_sequence_parallel_grads sum every marked parameter (not only the LayerNorms')?"
        )


# --------------------------------------------------------------------------- step 5


def _dense_block(dim: int = 16, seed: int = 5) -> Block:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = Block(dim)
    for norm in (block.attention_norm, block.mlp_norm):  # LayerNorms that are not 1 and 0
        fresh = _dense_norm(dim, seed=seed + 10)
        norm.load_state_dict(fresh.state_dict())
    return block


def _expected_slices(index: int, size: int, dim: int = 16) -> dict[str, tuple[int, slice]]:
    """Each parameter of the split block: (dimension, slice) of the dense one it holds."""
    whole = (0, slice(None))
    out = {}
    for norm in ("attention_norm", "mlp_norm"):
        out[f"{norm}.weight"], out[f"{norm}.bias"] = whole, whole
    for name, width, kind in (
        ("attention.query", dim, "column"),
        ("attention.key", dim, "column"),
        ("attention.value", dim, "column"),
        ("attention.out", dim, "row"),
        ("mlp.up", 4 * dim, "column"),
        ("mlp.down", 4 * dim, "row"),
    ):
        n = width // size
        part = _share(index, n)
        if kind == "column":
            out[f"{name}.weight"], out[f"{name}.bias"] = (0, part), (0, part)
        else:
            out[f"{name}.weight"], out[f"{name}.bias"] = (1, part), whole
    return out


def _take(tensor: torch.Tensor, where: tuple[int, slice]) -> torch.Tensor:
    dim, part = where
    return tensor[part] if dim == 0 else tensor[:, part]


def _block(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members, size, index, per = _place(rank, world_size, groups)
    mine = _share(index, per)
    dense = _dense_block()
    x = _randn(3, LENGTH, 16, seed=11)
    upstream = _randn(3, LENGTH, 16, seed=12)
    leaf = x.clone().requires_grad_()
    dense(leaf).backward(upstream)
    try:
        block = kata.SequenceParallelBlock(copy.deepcopy(dense), group)
        shard = x[:, mine].clone().requires_grad_()
        with recording() as forward:
            y = block(shard)
        with recording() as backward:
            y.backward(upstream[:, mine])
        local = {n: None if p.grad is None else p.grad.clone() for n, p in block.named_parameters()}
        kata.sync_sequence_parallel_grads(block, group)
    except KataTodo:
        raise
    except Exception as error:
        failure = _fail(rank, "SequenceParallelBlock", error)
        if "invalid for input of size" in failure:
            failure += (
                ". The gathered q, k and v hold the WHOLE sequence: take the length from them "
                "(q.shape[1]), not from x (this rank's positions)"
            )
        return {"failure": failure}
    slices = _expected_slices(index, size)
    dense_params = dict(dense.named_parameters())
    return {
        "failure": None,
        "rank": rank,
        "output": y.detach().clone(),
        "expected_output": dense(x).detach()[:, mine],
        "x_grad": shard.grad,
        "expected_x_grad": leaf.grad[:, mine],
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in block.named_parameters()
        },
        "local": local,
        "expected_grads": {n: _take(dense_params[n].grad, s) for n, s in slices.items()},
        "marked": sorted(
            n for n, p in block.named_parameters() if getattr(p, "sequence_parallel", False)
        ),
        "forward": _calls(forward, group),
        "backward": _calls(backward, group),
    }


_blocks = shared_run(lambda world: run_world(_block, *WORLDS[world]))


def _count(calls, kind: str) -> int:
    return sum(1 for c in calls if c[0] == kind)


@pytest.mark.step(5)
@pytest.mark.parametrize("world", list(WORLDS))
def test_block_equals_one_process_forward_and_backward(kata, world):
    where = _where(world)
    for got in _blocks(world):
        succeeded(got)
        rank = got["rank"]
        names = sorted(got["grads"])
        expected_names = sorted(got["expected_grads"])
        assert names == expected_names, (
            f"rank {rank}: SequenceParallelBlock has the parameters {names}, expected "
            f"{expected_names}: attention_norm and mlp_norm SequenceParallelLayerNorm, attention "
            "a SequenceParallelAttention and mlp a SequenceParallelMLP, built from the dense "
            "block's own (with the group)"
        )
        forward = got["forward"]
        gathers, scatters = _count(forward, "all-gather"), _count(forward, "reduce-scatter")
        if gathers == 4 and scatters == 2:
            raise AssertionError(
                f"rank {rank}: SequenceParallelBlock's forward made 4 all-gathers {where}, "
                "expected 2: the attention's query, key and value read the same positions, so "
                "one all-gather serves the three (all_gather_linear with the three layers), not "
                "one each (self.query(x), self.key(x), self.value(x))"
            )
        others = [c[0] for c in forward if c[0] not in ("all-gather", "reduce-scatter")]
        assert gathers == 2 and scatters == 2 and not others, (
            f"rank {rank}: SequenceParallelBlock's forward called {_kinds(forward)} {where}, "
            "expected 2 all-gathers and 2 reduce-scatters (one of each around the attention "
            "and around the MLP), nothing else"
        )
        output, expected = got["output"], got["expected_output"]
        assert _close(output, expected), (
            f"rank {rank}: SequenceParallelBlock's output is not the dense block's at this "
            f"rank's positions ({gap(output, expected)}) {where}: x + attention(norm(x)), then "
            "x + mlp(norm(x)), all on this rank's positions; the attention over the whole "
            "gathered sequence"
        )
        assert _close(got["x_grad"], got["expected_x_grad"]), (
            f"rank {rank}: the input's gradient through SequenceParallelBlock is not the dense "
            f"block's ({gap(got['x_grad'], got['expected_x_grad'])}) {where}"
        )
        for name, expected_grad in got["expected_grads"].items():
            grad = got["grads"][name]
            if (
                name.endswith("norm.weight")
                and _close(got["local"][name], grad)
                and (name not in got["marked"])
            ):
                raise AssertionError(
                    f"rank {rank}: {name} is not marked sequence_parallel, so the sync left its "
                    f"partial gradient as it was {where}: build the norms as "
                    "SequenceParallelLayerNorm (it marks its weight and bias)"
                )
            assert _close(grad, expected_grad), (
                f"rank {rank}: SequenceParallelBlock's {name} gradient (after the sync) is not "
                f"the matching slice of the dense block's ({gap(grad, expected_grad)}) {where}"
            )


def _against_torch(rank, world_size):
    kata = load_kata(KATA)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )
    except ImportError as error:
        return {"skip": f"this torch has no sequence-parallel API: {error}"}
    dense = _dense_block()
    mesh = init_device_mesh("cpu", (world_size,))
    plan = {  # torchtitan's plan for a Llama block, on this block's names
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "attention.query": ColwiseParallel(),
        "attention.key": ColwiseParallel(),
        "attention.value": ColwiseParallel(),
        "attention.out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    theirs = parallelize_module(copy.deepcopy(dense), mesh, plan)
    mine = kata.SequenceParallelBlock(copy.deepcopy(dense), None)
    per = LENGTH // world_size
    positions = slice(rank * per, (rank + 1) * per)
    x = _randn(3, LENGTH, 16, seed=13)[:, positions]
    upstream = _randn(3, LENGTH, 16, seed=14)[:, positions]
    outputs, x_grads, grads = [], [], []
    for module in (mine, theirs):
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        y = y.to_local() if hasattr(y, "to_local") else y
        y.backward(upstream)
        outputs.append(y.detach().clone())
        x_grads.append(None if leaf.grad is None else leaf.grad.clone())
    kata.sync_sequence_parallel_grads(mine, None)
    for module in (mine, theirs):
        found = {}
        for name, param in module.named_parameters():
            grad = param.grad
            if hasattr(grad, "placements"):  # a DTensor: its Partial gradients summed now
                from torch.distributed.tensor import Partial

                if any(isinstance(p, Partial) for p in grad.placements):
                    grad = grad.redistribute(placements=[Replicate()])
                grad = grad.to_local()
            found[name] = None if grad is None else grad.clone()
        grads.append(found)
    placements = {n: str(p.grad.placements) for n, p in theirs.named_parameters() if "norm" in n}
    return {
        "skip": None,
        "outputs": outputs,
        "x_grads": x_grads,
        "grads": grads,
        "placements": placements,
    }


@pytest.mark.step(5)
def test_block_matches_torchs_parallelize_module_with_sequence_parallel(kata):
    results = run_world(_against_torch, 2, deadline=60)
    if results[0]["skip"]:
        pytest.skip(results[0]["skip"])
    for rank, got in enumerate(results):
        mine, theirs = got["outputs"]
        assert _close(mine, theirs), (
            f"rank {rank}: SequenceParallelBlock's output differs from torch's parallelize_module "
            f"(SequenceParallel, ColwiseParallel and RowwiseParallel on Shard(1)) on the same "
            f"mesh: {gap(mine, theirs)}"
        )
        mine, theirs = got["x_grads"]
        assert _close(mine, theirs), (
            f"rank {rank}: the input's gradient differs from torch's: {gap(mine, theirs)}"
        )
        for name, expected in got["grads"][1].items():
            grad = got["grads"][0].get(name)
            assert _close(grad, expected), (
                f"rank {rank}: SequenceParallelBlock's local {name} gradient differs from "
                f"torch's ({'missing' if grad is None else gap(grad, expected)}; torch's "
                f"LayerNorm gradients come as {got['placements']}, summed here)"
            )


# --------------------------------------------------------------------------- step 6

SHAPES = [(3, LENGTH, 16, 4), (2, 16, 32, 4)]  # batch, sequence, dim, heads


def _measured(rank, world_size, shapes):
    kata = load_kata(KATA)
    out = []
    for batch, length, dim, _ in shapes:
        dense = _dense_block(dim)
        block = kata.SequenceParallelBlock(dense, None)
        x = _randn(batch, length, dim, seed=15)
        per = length // world_size
        shard = x[:, rank * per : (rank + 1) * per].clone().requires_grad_()
        _, saved = _saved_bytes(lambda b=block, s=shard: b(s), block)
        out.append(saved)
    return out


def _dense_measured(shapes) -> list[int]:
    out = []
    for batch, length, dim, _ in shapes:
        dense = _dense_block(dim)
        x = _randn(batch, length, dim, seed=15).requires_grad_()
        out.append(_saved_bytes(lambda d=dense, t=x: d(t), dense)[1])
    return out


_memory = shared_run(lambda ranks: run_world(_measured, ranks, SHAPES))


def _explain(got: int, measured: int, batch: int, length: int, dim: int, heads: int, n: int) -> str:
    diff = measured - got
    hints = {
        length * length: "the causal mask masked_fill keeps (one bool per pair of positions)",
        length * length - length * length // n: "the causal mask is whole on every rank: "
        "attention runs over the whole sequence (do not divide it by the ranks)",
        16 * batch * length // n: "the LayerNorms' statistics (a mean and 1/std per position, "
        "two LayerNorms)",
        4 * heads * batch * length * length // n: "softmax's output (batch x heads x s x s)",
    }
    whole = (4 * 4 * batch * length * dim, 4 * (4 * batch * length * dim + 4 * batch * length))
    if n > 1 and any(abs(-diff - w * (1 - 1 / n)) < 8 for w in whole):
        return (
            ": you counted the LayerNorms' inputs and outputs whole (k20's layout); with "
            "sequence parallelism they hold this rank's positions only: divide them by the ranks"
        )
    for amount, why in hints.items():
        if diff == amount:
            return f": the formula lacks {diff} bytes: {why}"
        if diff == -amount:
            return f": the formula counts {amount} bytes too many: {why}"
    return ""


@pytest.mark.step(6)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_activation_bytes_is_what_autograd_saved(kata, ranks):
    measured = _dense_measured(SHAPES) if ranks == 1 else None
    for rank in range(ranks):
        if ranks > 1:
            measured = _memory(ranks)[rank]
        for (batch, length, dim, heads), saved in zip(SHAPES, measured):
            got = kata.activation_bytes(batch, length, dim, heads, ranks)
            what = (
                f"activation_bytes(batch={batch}, length={length}, dim={dim}, heads={heads}, "
                f"ranks={ranks})"
            )
            who = "the dense block on one process" if ranks == 1 else f"rank {rank}'s block"
            why = (
                _explain(got, saved, batch, length, dim, heads, ranks)
                if isinstance(got, int)
                else ": return an int, a number of bytes"
            )
            assert isinstance(got, int) and got == saved, (
                f"{what} is {got!r}, but {who} kept {saved} bytes for backward (measured with "
                "torch.autograd.graph.saved_tensors_hooks: every distinct storage saved, the "
                f"parameters aside){why}"
            )


@pytest.mark.step(6)
def test_program_splits_a_block_along_the_sequence(kata):
    out = run_module_ok(KATA, "--world-size", "2").stdout
    shown = f"`python -m katas.{KATA} --world-size 2`"
    for line, why in (
        (
            "[rank 1] positions 4..7; forward: all-gather 2",
            "rank 1 holds positions 4..7 of 8 and gathers twice forward (before the attention's "
            "q, k and v, and before the MLP's up)",
        ),
        (
            "reduce-scatter 2",
            "two reduce-scatters forward (after the attention's out and after the MLP's down)",
        ),
        (
            "then all-reduce 1",
            "the partial gradients (the LayerNorms', the row-parallel biases') summed in ONE "
            "all-reduce after backward",
        ),
        (
            "every rank's positions and gradients equal the dense block's",
            "its verdict: the split block equals the dense one",
        ),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    dense = _dense_block().to(device)
    block = kata.SequenceParallelBlock(copy.deepcopy(dense), None)
    x = _randn(3, LENGTH, 16, seed=11).to(device)
    per = LENGTH // world_size
    shard = x[:, rank * per : (rank + 1) * per].clone().requires_grad_()
    y = block(shard)
    y.square().sum().backward()
    kata.sync_sequence_parallel_grads(block, None)
    leaf = x.clone().requires_grad_()
    dense(leaf).square().sum().backward()
    return (
        str(y.device),
        y.detach().cpu(),
        dense(x).detach().cpu()[:, rank * per : (rank + 1) * per],
        block.mlp_norm.weight.grad.cpu(),
        dense.mlp_norm.weight.grad.cpu(),
    )


def check_on_cuda(results) -> None:
    for rank, (device, output, expected, grad, expected_grad) in enumerate(results):
        assert device.startswith("cuda"), f"rank {rank}'s output left the GPU: {device}"
        # CUDA matmuls may use TF32 or other kernels: a looser tolerance than on the CPU.
        assert torch.allclose(output, expected, rtol=1e-3, atol=1e-3), (
            f"rank {rank}: SequenceParallelBlock on CUDA differs from the dense block: "
            f"{gap(output, expected)}"
        )
        assert torch.allclose(grad, expected_grad, rtol=1e-3, atol=1e-3), (
            f"rank {rank}: the LayerNorm's gradient on CUDA differs from the dense block's: "
            f"{gap(grad, expected_grad)}"
        )


@pytest.mark.step(5)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    check_on_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


@pytest.mark.step(5)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    check_on_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")))
