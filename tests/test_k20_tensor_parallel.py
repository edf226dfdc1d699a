"""k20 tensor parallel: f and g, column- and row-parallel linears, the MLP and attention split."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec import collectives
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import ranks_phrase, run_module_ok, shared_run, succeeded
from dojo.todo import KataTodo
from dojo.toy_models import MLP, Attention

KATA = "k20_tensor_parallel"

# Exactness. A column-parallel output is the dense layer's dot products, but a row-parallel
# output adds the ranks' partial sums (32 products each, then the all-reduce) where the dense
# layer adds all 64 at once: floating-point addition depends on the order, so outputs and the
# gradients that flow through such a sum are compared to a close tolerance, not bit for bit.
# torch's parallelize_module adds the bias in its own order too (a share per rank).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

# Worlds: the whole world of 2 or 4 ranks, or 4 ranks as two groups [0, 1] and [2, 3] (a grid's
# rows, k17): a layer must read rank and size from its group, never from the world.
WORLDS = {"2": (2, None), "4": (4, None), "4-rows": (4, [[0, 1], [2, 3]])}


def _calls(calls, group) -> list[tuple[str, str | None, str]]:
    """Each recorded call: its name, its op, and whether it used the layer's group."""
    return [(c.name, c.op, collectives.which_group(c.group, group)) for c in calls]


def _where(world: str) -> str:
    return collectives.where(*WORLDS[world])


def _close(a, b) -> bool:
    return close(a, b, **TOLERANCE)


def _fail(rank: int, what: str, error: Exception) -> str:
    return f"rank {rank}: {what} raised {type(error).__name__}: {str(error).strip()[:300]}"


# --------------------------------------------------------------------------- step 1: f and g


def _f_and_g(rank, world_size, groups):
    kata = load_kata(KATA)
    group, members = collectives.rank_group(rank, world_size, groups)
    out = {"members": members}
    x = torch.arange(6.0).view(2, 3) + 10 * rank
    upstream = (rank + 1) * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    for name, apply in (
        ("f", kata.copy_to_parallel_region),
        ("g", kata.reduce_from_parallel_region),
    ):
        leaf = x.clone().requires_grad_()
        before = leaf.detach().clone()
        try:
            with recording() as forward:
                y = apply(leaf, group)
            value = y.detach().clone()
            with recording() as backward:
                y.backward(upstream.clone())
        except KataTodo:
            raise
        except Exception as error:
            out[name] = {"failure": _fail(rank, f"{name} (forward or backward)", error)}
            continue
        out[name] = {
            "failure": None,
            "value": value,
            "changed": not torch.equal(leaf.detach(), before),
            "grad": None if leaf.grad is None else leaf.grad.clone(),
            "forward": _calls(forward, group),
            "backward": _calls(backward, group),
        }
    out["x"], out["upstream"] = x, upstream
    return out


_f_and_g_world = shared_run(lambda world: run_world(_f_and_g, *WORLDS[world]))


def _reduces(calls) -> list:
    return [c for c in calls if c[0] == "all_reduce"]


def _check_reduce_call(rank: int, calls, what: str, where: str) -> None:
    names = [c[0] for c in calls]
    assert len(calls) == 1 and names == ["all_reduce"], (
        f"rank {rank}: {what} called {names or 'nothing'} {where}: exactly one dist.all_reduce"
    )
    _, op, group = calls[0]
    assert op in (None, "SUM"), (
        f"rank {rank}: {what} all-reduced with op={op}: it is a sum (ReduceOp.SUM, the default)"
    )
    assert group == "the group", (
        f"rank {rank}: {what} all-reduced on {group} {where}: pass the layer's group "
        "(group=ctx.group in backward, kept in ctx by forward)"
    )


@pytest.mark.step(1)
@pytest.mark.parametrize("world", list(WORLDS))
def test_f_is_identity_forward_and_all_reduce_backward(kata, world):
    results = _f_and_g_world(world)
    where = _where(world)
    world_size = WORLDS[world][0]
    everyone = sum(r["upstream"] for r in results)
    for rank, result in enumerate(results):
        got = succeeded(result["f"])
        members = result["members"]
        x, upstream = result["x"], result["upstream"]
        summed = sum(results[m]["upstream"] for m in members)
        group_x = sum(results[m]["x"] for m in members)
        if torch.equal(got["value"], group_x) and got["forward"]:
            raise AssertionError(
                f"rank {rank}: f's forward returned the sum of x over the group {where}: f is the "
                "identity forward (it enters the parallel region: every rank reads all of x) and "
                "all-reduces backward. You wrote g's forward: f and g are swapped"
            )
        assert torch.equal(got["value"], x), (
            f"rank {rank}: f's forward returned {got['value'].tolist()}, expected x itself "
            f"{x.tolist()}: f is the identity forward"
        )
        assert not got["forward"], (
            f"rank {rank}: f's forward called {[c[0] for c in got['forward']]}: it communicates "
            "nothing forward (the identity); its all-reduce belongs to backward"
        )
        assert not got["changed"], f"rank {rank}: f changed its input x in place"
        grad = got["grad"]
        if grad is None:
            raise AssertionError(f"rank {rank}: x got no gradient through f")
        if torch.equal(grad, upstream) and not got["backward"]:
            raise AssertionError(
                f"rank {rank}: f's backward returned this rank's gradient alone "
                f"{grad.tolist()} and made no all-reduce {where}: x feeds every rank's slice, so "
                "x's gradient is the sum over the group of what each slice sends back. "
                "All-reduce the gradient (a sum) in backward"
            )
        if torch.allclose(grad, summed / len(members)):
            raise AssertionError(
                f"rank {rank}: f's backward gave the gradient's mean over the group "
                f"{grad.tolist()}, expected its sum {summed.tolist()}: the gradient of x is the sum "
                f"of every slice's contribution, not divided by the group's size {len(members)}"
            )
        if world_size != len(members) and torch.equal(grad, everyone):
            raise AssertionError(
                f"rank {rank}: f's backward summed the gradient over the whole world {where}, "
                f"not over its group {members}: pass group=ctx.group to dist.all_reduce (keep "
                "the group in ctx in forward)"
            )
        _check_reduce_call(rank, got["backward"], "f's backward", where)
        assert torch.equal(grad, summed), (
            f"rank {rank}: x's gradient through f is {grad.tolist()}, expected the sum over the "
            f"group {members} of the gradients, {summed.tolist()}"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("world", list(WORLDS))
def test_g_is_all_reduce_forward_and_identity_backward(kata, world):
    results = _f_and_g_world(world)
    where = _where(world)
    world_size = WORLDS[world][0]
    everyone = sum(r["x"] for r in results)
    for rank, result in enumerate(results):
        got = succeeded(result["g"])
        members = result["members"]
        x, upstream = result["x"], result["upstream"]
        summed = sum(results[m]["x"] for m in members)
        value = got["value"]
        if torch.equal(value, x) and not got["forward"]:
            raise AssertionError(
                f"rank {rank}: g's forward returned x unchanged and made no all-reduce {where}: g "
                "leaves the parallel region, its forward is the sum over the group of every "
                "rank's partial result (and its backward the identity). You wrote f's forward: "
                "f and g are swapped"
            )
        if torch.allclose(value, summed / len(members)):
            raise AssertionError(
                f"rank {rank}: g's forward returned the mean over the group {value.tolist()}, "
                f"expected the sum {summed.tolist()}: a layer's output is the SUM of the partial "
                f"products, do not divide by the group's size {len(members)}"
            )
        if world_size != len(members) and torch.equal(value, everyone):
            raise AssertionError(
                f"rank {rank}: g's forward summed over the whole world {where}, not over its "
                f"group {members}: pass group=group to dist.all_reduce"
            )
        _check_reduce_call(rank, got["forward"], "g's forward", where)
        assert torch.equal(value, summed), (
            f"rank {rank}: g's forward returned {value.tolist()}, expected the sum over the group "
            f"{members}, {summed.tolist()}"
        )
        assert not got["changed"], (
            f"rank {rank}: g changed its input in place (it now holds the sum): an autograd "
            "function must not change its inputs (the caller's tensor, perhaps saved for "
            "backward). All-reduce a copy (x.clone()) and return that"
        )
        grad = got["grad"]
        if grad is None:
            raise AssertionError(f"rank {rank}: x got no gradient through g")
        if got["backward"]:
            raise AssertionError(
                f"rank {rank}: g's backward called {[c[0] for c in got['backward']]} and gave "
                f"{grad.tolist()}: the sum's gradient reaches every partial unchanged, so g's "
                "backward is the identity (return the gradient as it came, and None for the group)"
            )
        assert torch.equal(grad, upstream), (
            f"rank {rank}: x's gradient through g is {grad.tolist()}, expected the incoming "
            f"gradient unchanged {upstream.tolist()}"
        )


# --------------------------------------------------------------------------- layers, one by one


def _dense(in_features: int, out_features: int, seed: int = 3) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layer(rank, world_size, groups, kind, in_features, out_features):
    """One ColumnParallelLinear or RowParallelLinear from a dense layer: shard, forward, backward."""
    import torch.distributed as dist

    kata = load_kata(KATA)
    group, members = collectives.rank_group(rank, world_size, groups)
    size, index = len(members), members.index(rank)
    dense = _dense(in_features, out_features)
    x = _randn(3, 5, in_features, seed=7)
    upstream = _randn(3, 5, out_features, seed=8)
    leaf = x.clone().requires_grad_()
    dense(leaf).backward(upstream)
    split = in_features if kind == "row" else out_features
    share = split // size
    mine = slice(index * share, (index + 1) * share)
    cls = kata.ColumnParallelLinear if kind == "column" else kata.RowParallelLinear
    try:
        layer = cls(copy.deepcopy(dense), group)
    except KataTodo:
        raise
    except Exception as error:
        return {
            "failure": _fail(
                rank, f"{cls.__name__}(nn.Linear({in_features}, {out_features}))", error
            )
        }
    weight, bias = layer.weight.detach().clone(), getattr(layer, "bias", None)
    out = {
        "failure": None,
        "rank": rank,
        "index": index,
        "size": size,
        "members": members,
        "names": sorted(n for n, _ in layer.named_parameters()),
        "weight": weight,
        "weight_bytes": layer.weight.untyped_storage().nbytes(),
        "bias": None if bias is None else bias.detach().clone(),
        "dense_weight": dense.weight.detach().clone(),
        "dense_bias": dense.bias.detach().clone(),
        "mine": (mine.start, mine.stop),
    }
    mine_in = x[..., mine].clone().requires_grad_() if kind == "row" else x.clone().requires_grad_()
    try:
        with recording() as forward:
            y = layer(mine_in)
        with recording() as backward:
            y.backward(upstream[..., mine] if kind == "column" else upstream)
    except KataTodo:
        raise
    except Exception as error:
        out["failure"] = _fail(rank, f"{cls.__name__}'s forward or backward", error)
        return out
    dense_out = dense(x).detach()
    out.update(
        {
            "output": y.detach().clone(),
            "expected_output": dense_out[..., mine] if kind == "column" else dense_out,
            "x_grad": mine_in.grad,
            "expected_x_grad": leaf.grad[..., mine] if kind == "row" else leaf.grad,
            "weight_grad": layer.weight.grad,
            "expected_weight_grad": (
                dense.weight.grad[mine] if kind == "column" else dense.weight.grad[:, mine]
            ),
            "bias_grad": None if bias is None else bias.grad,
            "expected_bias_grad": (dense.bias.grad[mine] if kind == "column" else dense.bias.grad),
            "forward": _calls(forward, group),
            "backward": _calls(backward, group),
            "world_rank": dist.get_rank(),
        }
    )
    return out


# Why a row-parallel layer keeps the whole bias on every rank, for the messages that meet a
# bias kept on one rank only: a way that is right elsewhere, but not this kata's.
BIAS_RULE = (
    "This kata keeps the whole bias on every rank and adds it once, after the all-reduce, as "
    "Megatron-LM's RowParallelLinear does: every rank then holds the same parameters and computes "
    "the same bias gradient, so the copies stay equal under any optimizer and each rank's layer "
    "is whole. A bias kept on one rank only, and added there before the sum, gives the same "
    "output and is right elsewhere (one copy, nothing to keep equal), but not here"
)


def _check_names(got: dict, what: str, results: list[dict], kind: str) -> None:
    """The layer's parameters are ``weight`` and ``bias``; otherwise say what was observed, and
    a cause only where the names show it."""
    names = got["names"]
    if names == ["bias", "weight"]:
        return
    rank = got["rank"]
    nested = [n for n in names if "." in n]
    if nested:
        raise AssertionError(
            f"rank {rank}: {what} has the parameters {names}, expected ['bias', 'weight']: "
            f"{nested} belong to a submodule. Keep only this rank's slices as parameters "
            "(nn.Parameter), not the dense layer itself (a submodule would keep, and train, the "
            "whole matrix on every rank)"
        )
    if "weight" in names and "bias" not in names:
        keep = "the whole bias" if kind == "row" else "this rank's entries of the bias"
        if got["bias"] is not None:
            raise AssertionError(
                f"rank {rank}: {what} has a bias that is not a parameter (its parameters: "
                f"{names}): a plain tensor is never trained. Keep {keep} as an nn.Parameter"
            )
        holders = [r["rank"] for r in results if "bias" in r.get("names", ())]
        if holders and kind == "row":
            raise AssertionError(
                f"rank {rank}: {what} has no bias (its parameters: {names}), while "
                f"{ranks_phrase(holders)} {'keeps' if len(holders) == 1 else 'keep'} one: the "
                f"bias lives on some ranks only. {BIAS_RULE}: keep a copy of the whole bias on "
                "every rank"
            )
        seen = f"while {ranks_phrase(holders)} keep one" if holders else "nor does any rank"
        raise AssertionError(
            f"rank {rank}: {what} has no bias (its parameters: {names}), {seen}, and the dense "
            f"layer has one of {got['dense_bias'].numel()} entries: every rank keeps {keep} as an "
            "nn.Parameter (None only for a layer without a bias)"
        )
    raise AssertionError(
        f"rank {rank}: {what} has the parameters {names}, expected ['bias', 'weight']: name "
        "this rank's slices weight and bias, as nn.Linear does (the tests and the blocks built "
        "on the layer read layer.weight and layer.bias)"
    )


def _check_weight_shard(got: dict, kind: str, what: str) -> None:
    rank, weight, full = got["rank"], got["weight"], got["dense_weight"]
    size, index = got["size"], got["index"]
    start, stop = got["mine"]
    expected = full[start:stop] if kind == "column" else full[:, start:stop]
    if torch.equal(weight, expected):
        if got["weight_bytes"] > weight.numel() * weight.element_size():
            raise AssertionError(
                f"rank {rank}: {what}'s weight is a view of the dense layer's: its storage holds "
                f"{got['weight_bytes']} bytes for {weight.numel()} elements, so the whole matrix "
                "stays in memory on every rank (the point of splitting it is that it does not). "
                "clone() the slice"
            )
        return
    other = "columns (input features)" if kind == "column" else "rows (output features)"
    keeps = "ROWS (output features)" if kind == "column" else "COLUMNS (input features)"
    for candidate in range(max(size, 4)):
        n = (full.shape[1 if kind == "column" else 0]) // size
        wrong = (
            full[:, candidate * n : (candidate + 1) * n]
            if kind == "column"
            else full[candidate * n : (candidate + 1) * n]
        )
        if weight.shape == wrong.shape and torch.equal(weight, wrong):
            raise AssertionError(
                f"rank {rank}: {what}'s weight is shaped {tuple(weight.shape)}: it holds "
                f"{other} of the dense weight. nn.Linear's weight is out_features x in_features, "
                f"and a {kind}-parallel layer keeps {keeps}: "
                + (
                    "weight[rank * n:(rank + 1) * n]"
                    if kind == "column"
                    else "weight[:, rank * n:(rank + 1) * n]"
                )
            )
    if weight.numel() == 0:
        raise AssertionError(
            f"rank {rank} (rank {index} of its group {got['members']}): {what}'s weight is empty "
            f"({tuple(weight.shape)}): its slice starts past the end of the dense weight. Take "
            "the slice of this rank's rank IN THE GROUP, dist.get_rank(self.process_group) (the "
            "world rank is another number in a subgroup)"
        )
    n = stop - start
    for candidate in range(8):
        wrong = (
            full[candidate * n : (candidate + 1) * n]
            if kind == "column"
            else full[:, candidate * n : (candidate + 1) * n]
        )
        if wrong.numel() and weight.shape == wrong.shape and torch.equal(weight, wrong):
            raise AssertionError(
                f"rank {rank} (rank {index} of its group {got['members']}) holds slice "
                f"{candidate} of the dense weight, expected slice {index}: take the slice of "
                "this rank's rank IN THE GROUP, dist.get_rank(self.process_group) (the world "
                "rank is another number in a subgroup)"
            )
    raise AssertionError(
        f"rank {rank}: {what}'s weight ({tuple(weight.shape)}) is not slice {index} of the dense "
        f"weight ({tuple(full.shape)}) along its {keeps}, expected shape {tuple(expected.shape)}"
    )


def _check_gradients(got: dict, what: str, where: str, extra: str = "") -> None:
    rank = got["rank"]
    for name in ("x_grad", "weight_grad", "bias_grad"):
        value, expected = got[name], got[f"expected_{name}"]
        label = {"x_grad": "the input's", "weight_grad": "weight's", "bias_grad": "bias's"}[name]
        if value is None:
            raise AssertionError(
                f"rank {rank}: {what}: the {label} gradient is None {where}"
                + (
                    ": add the bias on every rank, after the all-reduce, so that every copy "
                    "gets the same gradient (a bias added on one rank only trains there only)"
                    if name == "bias_grad"
                    else ""
                )
            )
        if name == "bias_grad" and torch.equal(value, torch.zeros_like(value)):
            raise AssertionError(
                f"rank {rank}: {what}'s bias got a zero gradient {where}: add the bias on every "
                "rank, after the all-reduce (adding it on one rank only gives the others' copies "
                "no gradient: they would drift apart)"
            )
        assert _close(value, expected), (
            f"rank {rank}: {what}: {label} gradient is not the matching slice of the dense "
            f"layer's ({gap(value, expected)}) {where}{extra}"
        )


def _column_world(world):
    world_size, groups = WORLDS[world]
    return run_world(_layer, world_size, groups, "column", 16, 64)


def _row_world(world):
    world_size, groups = WORLDS[world]
    return run_world(_layer, world_size, groups, "row", 64, 16)


_columns = shared_run(_column_world)
_rows = shared_run(_row_world)


@pytest.mark.step(2)
@pytest.mark.parametrize("world", list(WORLDS))
def test_column_parallel_keeps_its_output_features(kata, world):
    results = _columns(world)
    for got in results:
        if got["failure"] and "weight" not in got:
            raise AssertionError(got["failure"])
        _check_names(got, "ColumnParallelLinear(nn.Linear(16, 64))", results, "column")
        _check_weight_shard(got, "column", "ColumnParallelLinear(nn.Linear(16, 64))")
        start, stop = got["mine"]
        expected = got["dense_bias"][start:stop]
        assert got["bias"] is not None and torch.equal(got["bias"], expected), (
            f"rank {got['rank']}: ColumnParallelLinear's bias is "
            f"{None if got['bias'] is None else tuple(got['bias'].shape)}, expected entries "
            f"{start}..{stop - 1} of the dense bias (those of this rank's output features)"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize("world", list(WORLDS))
def test_column_parallel_equals_the_dense_layer(kata, world):
    where = _where(world)
    what = "ColumnParallelLinear(nn.Linear(16, 64))"
    for got in _columns(world):
        succeeded(got)
        rank = got["rank"]
        forward, backward = got["forward"], got["backward"]
        if _reduces(forward):
            raise AssertionError(
                f"rank {rank}: {what} all-reduced in forward {where}: entering a column-parallel "
                "layer is f (identity forward, all-reduce backward), not g. Every rank already "
                "holds all of x"
            )
        assert _close(got["output"], got["expected_output"]), (
            f"rank {rank}: {what}'s output is not the dense layer's output features "
            f"{got['mine'][0]}..{got['mine'][1] - 1} ({gap(got['output'], got['expected_output'])}) "
            f"{where}"
        )
        if not _reduces(backward):
            raise AssertionError(
                f"rank {rank}: {what} made no all-reduce in backward {where}: x feeds every "
                "rank's slice, so x's gradient is the sum of every rank's contribution. Pass x "
                "through f (copy_to_parallel_region) before the matmul"
            )
        _check_reduce_call(rank, backward, f"{what}'s backward", where)
        _check_gradients(got, what, where)


# --------------------------------------------------------------------------- step 3: row parallel


@pytest.mark.step(3)
@pytest.mark.parametrize("world", list(WORLDS))
def test_row_parallel_keeps_its_input_features_and_the_whole_bias(kata, world):
    results = _rows(world)
    for got in results:
        if got["failure"] and "weight" not in got:
            raise AssertionError(got["failure"])
        _check_names(got, "RowParallelLinear(nn.Linear(64, 16))", results, "row")
        _check_weight_shard(got, "row", "RowParallelLinear(nn.Linear(64, 16))")
        bias = got["bias"]
        assert bias is not None and torch.equal(bias, got["dense_bias"]), (
            f"rank {got['rank']}: RowParallelLinear's bias is "
            f"{None if bias is None else tuple(bias.shape)}, expected the whole dense bias "
            f"({tuple(got['dense_bias'].shape)}): the bias belongs to the sum, and every rank "
            "keeps all of it"
        )


@pytest.mark.step(3)
@pytest.mark.parametrize("world", list(WORLDS))
def test_row_parallel_equals_the_dense_layer(kata, world):
    where = _where(world)
    what = "RowParallelLinear(nn.Linear(64, 16))"
    for got in _rows(world):
        succeeded(got)
        rank, size = got["rank"], got["size"]
        forward, backward = got["forward"], got["backward"]
        if not _reduces(forward):
            raise AssertionError(
                f"rank {rank}: {what} made no all-reduce in forward {where}: each rank's product "
                "covers only its input features, a partial result. Sum the partials over the "
                "group with g (reduce_from_parallel_region)"
            )
        _check_reduce_call(rank, forward, f"{what}'s forward", where)
        output, expected = got["output"], got["expected_output"]
        bias = got["dense_bias"]
        if _close(output, expected + (size - 1) * bias):
            raise AssertionError(
                f"rank {rank}: {what}'s output is the dense output plus {size - 1} extra bias(es) "
                f"{where}: you added the bias on every rank BEFORE the all-reduce, so the sum "
                f"counted it {size} times. Add it once, after the all-reduce"
            )
        if _close(output, (expected - bias) / size + bias) or _close(output, expected / size):
            raise AssertionError(
                f"rank {rank}: {what}'s output is the dense output divided by {size} {where}: the "
                "all-reduce is a sum of partial products, do not divide it"
            )
        assert _close(output, expected), (
            f"rank {rank}: {what}'s output is not the dense layer's ({gap(output, expected)}) "
            f"{where}"
        )
        assert not _reduces(backward), (
            f"rank {rank}: {what} all-reduced in backward {where}: leaving the region is g, whose "
            "backward is the identity (each rank's partial gets the output's gradient as it is)"
        )
        _check_gradients(got, what, where)


def _refused(rank, world_size, cls_name, in_features, out_features):
    kata = load_kata(KATA)
    cls = getattr(kata, cls_name)
    try:
        cls(_dense(in_features, out_features), None)
    except ValueError as error:
        return None, str(error)
    except KataTodo:
        raise
    except Exception as error:
        return f"raised {type(error).__name__}: {error}", None
    return "returned a layer", None


@pytest.mark.step(2)
def test_column_parallel_refuses_features_that_do_not_divide(kata):
    check_refused("ColumnParallelLinear", 3, 16, 64, 64)


@pytest.mark.step(3)
def test_row_parallel_refuses_features_that_do_not_divide(kata):
    check_refused("RowParallelLinear", 3, 64, 16, 64)


def check_refused(cls_name, world_size, in_features, out_features, features) -> None:
    results = run_world(_refused, world_size, cls_name, in_features, out_features)
    for rank, (did, message) in enumerate(results):
        assert did is None, (
            f"rank {rank}: {cls_name}(nn.Linear({in_features}, {out_features})) on {world_size} "
            f"ranks {did}: {features} features do not split evenly over {world_size} ranks. "
            "Raise ValueError saying so"
        )
        assert str(features) in message and str(world_size) in message, (
            f"rank {rank}: {cls_name} raised ValueError({message!r}): name the {features} "
            f"features and the group's size {world_size}, and say what to do"
        )


# --------------------------------------------------------------------------- steps 4-5: blocks


def _module(name: str):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return MLP() if name == "mlp" else Attention()


def _slices(name: str, index: int, size: int) -> dict[str, tuple[int, slice]]:
    """Each parameter of the split module: (dimension, slice) of the dense one it holds."""
    if name == "mlp":
        columns, rows = ("up",), ("down",)
        width = {"up": 64, "down": 64}
    else:
        columns, rows = ("query", "key", "value"), ("out",)
        width = {n: 16 for n in ("query", "key", "value", "out")}
    out = {}
    for layer in columns + rows:
        n = width[layer] // size
        part = slice(index * n, (index + 1) * n)
        if layer in columns:
            out[f"{layer}.weight"], out[f"{layer}.bias"] = (0, part), (0, part)
        else:
            out[f"{layer}.weight"], out[f"{layer}.bias"] = (1, part), (0, slice(None))
    return out


def _take(tensor: torch.Tensor, where: tuple[int, slice]) -> torch.Tensor:
    dim, part = where
    return tensor[part] if dim == 0 else tensor[:, part]


def _attend(q, k, v, width: int, scale: float) -> torch.Tensor:
    """Causal attention of (batch, length, features) in heads of ``width`` features each."""
    batch, length, _ = q.shape

    def heads(t):
        return t.reshape(batch, length, -1, width).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-2, -1) / scale**0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ heads(v)
    return attended.transpose(1, 2).reshape(batch, length, -1)


def _mistaken(name: str, dense: nn.Module, x: torch.Tensor, size: int) -> dict:
    """What the likely mistakes would output, computed from the dense module: the broad check
    names the one the learner's output matches (and only then a cause)."""
    with torch.no_grad():
        if name == "mlp":
            return {
                "relu after the sum": (
                    torch.relu(dense.down(dense.up(x))),
                    "ParallelMLP's output is relu(down(up(x))): the ReLU came after the down "
                    "projection's sum. The MLP is down(relu(up(x))): apply the ReLU between the "
                    "layers, on this rank's slice of up's output (it acts on each feature alone, "
                    "so it splits with them), before the row-parallel layer",
                ),
            }
        q, k, v = dense.query(x), dense.key(x), dense.value(x)
        features, head_dim = q.shape[-1], dense.head_dim
        width, heads = features // size, features // head_dim
        out = {
            "scaled by the rank's width": (
                dense.out(_attend(q, k, v, head_dim, width)),
                f"ParallelAttention scaled the scores by 1/sqrt({width}), the rank's width "
                "(local_heads * head_dim): a head's scores are scaled by 1/sqrt(self.head_dim), "
                "the width of one head, as in the dense attention, on every rank alike",
            )
        }
        if width % heads == 0 and size > 1:  # every head cut into size pieces
            total = dense.out.bias.clone()
            for index in range(size):
                part = slice(index * width, (index + 1) * width)
                cut = _attend(q[..., part], k[..., part], v[..., part], width // heads, head_dim)
                total = total + cut @ dense.out.weight[:, part].T
            out["heads cut"] = (
                total,
                "ParallelAttention's output is what all the heads cut into smaller ones give: "
                "each rank must attend with whole heads of its own, viewed as (batch, length, "
                "self.local_heads, self.head_dim), not all the heads cut into smaller ones",
            )
        return out


def _block(rank, world_size, groups, name):
    kata = load_kata(KATA)
    group, members = collectives.rank_group(rank, world_size, groups)
    dense = _module(name)
    x = _randn(3, 8, 16, seed=11)
    upstream = _randn(3, 8, 16, seed=12)
    leaf = x.clone().requires_grad_()
    dense(leaf).backward(upstream)
    cls = kata.ParallelMLP if name == "mlp" else kata.ParallelAttention
    mine = x.clone().requires_grad_()
    try:
        layer = cls(copy.deepcopy(dense), group)
        with recording() as forward:
            y = layer(mine)
        with recording() as backward:
            y.backward(upstream)
    except KataTodo:
        raise
    except Exception as error:
        return {"failure": _fail(rank, f"{cls.__name__}", error)}
    slices = _slices(name, members.index(rank), len(members))
    params = dict(layer.named_parameters())
    dense_params = dict(dense.named_parameters())
    return {
        "failure": None,
        "rank": rank,
        "output": y.detach().clone(),
        "expected_output": dense(x).detach(),
        "x_grad": mine.grad,
        "expected_x_grad": leaf.grad,
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params.items()},
        "expected_grads": {n: _take(dense_params[n].grad, s) for n, s in slices.items()},
        "forward": _calls(forward, group),
        "backward": _calls(backward, group),
        "mistaken": _mistaken(name, dense, x, len(members)),
    }


def check_block(name: str, world: str, results) -> None:
    where = _where(world)
    what = "ParallelMLP" if name == "mlp" else "ParallelAttention"
    for got in results:
        succeeded(got)
        rank = got["rank"]
        output, expected = got["output"], got["expected_output"]
        names = sorted(got["grads"])
        assert names == sorted(got["expected_grads"]), (
            f"rank {rank}: {what} has the parameters {names}, expected "
            f"{sorted(got['expected_grads'])}: build it from the dense module's layers "
            + (
                "(self.up a ColumnParallelLinear, self.down a RowParallelLinear)"
                if name == "mlp"
                else "(self.query, self.key, self.value column-parallel, self.out row-parallel)"
            )
        )
        for phase in ("forward", "backward"):
            reduces = _reduces(got[phase])
            assert len(reduces) == 1, (
                f"rank {rank}: {what} made {len(reduces)} all-reduces in {phase} {where}, "
                f"expected exactly one: one parallel region, one f and one g"
                + (
                    ". The three projections read the same x: pass it through f once and use "
                    "each projection's weight and bias (F.linear), since calling self.query(x), "
                    "self.key(x) and self.value(x) gives three f's, three all-reduces backward"
                    if name == "attention" and phase == "backward" and len(reduces) == 3
                    else ". The layers hold f and g already: adding your own adds all-reduces "
                    "(and multiplies the gradients)"
                    if len(reduces) > 1
                    else ""
                )
            )
            _check_reduce_call(rank, reduces, f"{what}'s {phase}", where)
        if not _close(output, expected):
            for candidate, why in got["mistaken"].values():
                if _close(output, candidate):
                    raise AssertionError(f"rank {rank}, {what} {where}: {why}")
            raise AssertionError(
                f"rank {rank}: {what}'s output is not the dense {name}'s "
                f"({gap(output, expected)}) {where}"
                + (
                    ": each rank attends with whole heads of its own (self.local_heads heads of "
                    "self.head_dim features, scores scaled by 1/sqrt(self.head_dim)), and the "
                    "row-parallel out projection sums the ranks' parts"
                    if name == "attention"
                    else ": each rank computes down(relu(up(x))) with its slices, and the "
                    "row-parallel down projection sums the ranks' parts"
                )
            )
        assert _close(got["x_grad"], got["expected_x_grad"]), (
            f"rank {rank}: the input's gradient through {what} is not the dense {name}'s "
            f"({gap(got['x_grad'], got['expected_x_grad'])}) {where}"
        )
        for param, expected_grad in got["expected_grads"].items():
            grad = got["grads"][param]
            assert grad is not None and _close(grad, expected_grad), (
                f"rank {rank}: {what}'s {param} gradient is not the matching slice of the dense "
                f"{name}'s "
                f"({'None' if grad is None else gap(grad, expected_grad)}) {where}"
            )


@pytest.mark.step(4)
@pytest.mark.parametrize("world", list(WORLDS))
def test_parallel_mlp_equals_the_dense_mlp_with_one_all_reduce_each_way(kata, world):
    check_block("mlp", world, run_world(_block, *WORLDS[world], "mlp"))


@pytest.mark.step(5)
@pytest.mark.parametrize("world", list(WORLDS))
def test_parallel_attention_splits_whole_heads(kata, world):
    check_block("attention", world, run_world(_block, *WORLDS[world], "attention"))


def _heads_refused(rank, world_size, dim, heads):
    kata = load_kata(KATA)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        attention = Attention(dim, heads)
    try:
        kata.ParallelAttention(attention, None)
    except ValueError as error:
        return None, str(error)
    except KataTodo:
        raise
    except Exception as error:
        return f"raised {type(error).__name__}: {error}", None
    return "returned a layer", None


@pytest.mark.step(5)
def test_parallel_attention_refuses_heads_that_do_not_divide(kata):
    # 16 features divide by 4, but 2 heads of 8 features do not: half a head per rank.
    for rank, (did, message) in enumerate(run_world(_heads_refused, 4, 16, 2)):
        assert did is None, (
            f"rank {rank}: ParallelAttention(Attention(dim=16, heads=2)) on 4 ranks {did}: 2 heads "
            "do not split over 4 ranks (each would hold half a head, and attention cannot be "
            "split inside a head). Raise ValueError unless the group's size divides the heads"
        )
        assert "2" in message and "4" in message and "head" in message, (
            f"rank {rank}: ParallelAttention raised ValueError({message!r}): name the heads (2) "
            "and the group's size (4)"
        )


# --------------------------------------------------------------------------- against torch


def _against_torch(rank, world_size, name):
    kata = load_kata(KATA)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    except ImportError as error:
        return {"skip": f"this torch has no tensor parallel API: {error}"}
    dense = _module(name)
    mesh = init_device_mesh("cpu", (world_size,))
    if name == "mlp":
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        mine = kata.ParallelMLP(copy.deepcopy(dense), None)
    else:
        plan = {n: ColwiseParallel() for n in ("query", "key", "value")}
        plan["out"] = RowwiseParallel()
        mine = kata.ParallelAttention(copy.deepcopy(dense), None)
    theirs = parallelize_module(copy.deepcopy(dense), mesh, plan)
    x = _randn(3, 8, 16, seed=13)
    upstream = _randn(3, 8, 16, seed=14)
    outputs, grads = [], []
    for module in (mine, theirs):
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        y.backward(upstream)
        outputs.append(torch.as_tensor(y.detach()).clone())
        grads.append(
            {
                n: None
                if p.grad is None
                else (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                for n, p in module.named_parameters()
            }
        )
    return {"skip": None, "outputs": outputs, "grads": grads}


def check_against_torch(name: str, results) -> None:
    what = "ParallelMLP" if name == "mlp" else "ParallelAttention"
    if results[0]["skip"]:
        pytest.skip(results[0]["skip"])
    for rank, got in enumerate(results):
        mine, theirs = got["outputs"]
        assert _close(mine, theirs), (
            f"rank {rank}: {what}'s output differs from torch's parallelize_module "
            f"(ColwiseParallel/RowwiseParallel) on the same mesh: {gap(mine, theirs)}"
        )
        for param, expected in got["grads"][1].items():
            grad = got["grads"][0].get(param)
            assert grad is not None and _close(grad, expected), (
                f"rank {rank}: {what}'s local {param} gradient differs from torch's "
                f"parallelize_module's local shard ("
                f"{'missing' if grad is None else gap(grad, expected)})"
            )


@pytest.mark.step(4)
def test_parallel_mlp_matches_torchs_parallelize_module(kata):
    check_against_torch("mlp", run_world(_against_torch, 2, "mlp", deadline=60))


@pytest.mark.step(5)
def test_parallel_attention_matches_torchs_parallelize_module(kata):
    check_against_torch("attention", run_world(_against_torch, 2, "attention", deadline=60))


@pytest.mark.step(5)
def test_program_splits_a_block_and_counts_its_all_reduces(kata):
    out = run_module_ok(KATA, "--world-size", "2").stdout
    shown = f"`python -m katas.{KATA} --world-size 2`"
    for line, why in (
        ("mlp: each rank keeps up.weight (32, 16)", "half of up's 64 output features each"),
        ("[rank 1] mlp: 1 all-reduce forward, 1 backward", "the MLP's one g and one f"),
        ("[rank 0] attention: 1 all-reduce forward, 1 backward", "attention's one g and one f"),
        (
            "every rank's output and input gradient equal the dense block's",
            "its verdict: the split layers equal the dense ones",
        ),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    dense = _module("mlp").to(device)
    mlp = kata.ParallelMLP(copy.deepcopy(dense), None)
    x = _randn(3, 8, 16, seed=11).to(device)
    y = mlp(x)
    return str(y.device), y.detach().cpu(), dense(x).detach().cpu()


def check_on_cuda(results) -> None:
    for rank, (device, output, expected) in enumerate(results):
        assert device.startswith("cuda"), f"rank {rank}'s output left the GPU: {device}"
        # CUDA matmuls may use TF32 or other kernels: a looser tolerance than on the CPU.
        assert torch.allclose(output, expected, rtol=1e-3, atol=1e-3), (
            f"rank {rank}: ParallelMLP on CUDA differs from the dense MLP: {gap(output, expected)}"
        )


@pytest.mark.step(4)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    check_on_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    check_on_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")))
