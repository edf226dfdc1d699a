"""k28 FSDP x TP: the 2-D mesh's groups, tensor parallel inside a row, FSDP down a column,
training equal to one process with each collective on its own group, and the whole state held
against torch's fully_shard(mesh["dp"]) + parallelize_module(mesh["tp"]) on the same ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec import meshes
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.states import close, gap
from dojo.spec.testing import refusal, run_module_ok, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import make_tokens, make_transformer, transformer_loss

KATA = "k28_fsdp_tp"

# A TP layer adds partial sums in another order than the dense one (k20): close, not bitwise.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
MESHES = ((2, 2), (1, 4), (4, 1))  # (dp, tp) on 4 ranks
PLAN = {
    "attention.query": "column",
    "attention.key": "column",
    "attention.value": "column",
    "attention.out": "row",
    "mlp.up": "column",
    "mlp.down": "row",
}
STEPS, LR = 2, 0.1
# One step's collectives on the 2 x 2 mesh, each with its group, in the order they run.
_AG, _AR, _RS = ("all-gather", "dp"), ("all-reduce", "tp"), ("reduce-scatter", "dp")
ORDER = [_AG, _AG, _AR, _AR, _AG, _AR, _AR, _AG, _RS, _AR, _AR, _RS, _AR, _AR, _RS, _RS]


def _gap(a, b) -> str:
    return "None (no gradient)" if a is None else gap(a, b)


def _close(a, b) -> bool:
    return close(a, b, **TOLERANCE)


GRID = meshes.Grid("Mesh", outer="dp", inner="tp")
_fail, _calls = meshes.failed, GRID.kinds


def _tp_slice(tensor: torch.Tensor, name: str, tp_index: int, tp: int) -> torch.Tensor:
    """The dense block parameter ``name``'s slice that tp rank ``tp_index`` holds."""
    layer, _, kind = name.rpartition(".")
    style = PLAN.get(layer)
    if style is None or (style == "row" and kind == "bias"):
        return tensor
    dim = 1 if style == "row" else 0
    share = tensor.shape[dim] // tp
    return tensor.narrow(dim, tp_index * share, share)


# --------------------------------------------------------------------------- step 1: the mesh


def _meshes(rank, world_size):
    return GRID.facts(load_kata(KATA), rank, MESHES)


@shared_run
def _mesh_world():
    return run_world(_meshes, 4, deadline=60)


@pytest.mark.step(1)
@pytest.mark.parametrize("dp,tp", MESHES)
def test_mesh_groups_are_rows_and_columns(kata, dp, tp):
    GRID.check_groups([result[(dp, tp)] for result in _mesh_world()], dp, tp)


@pytest.mark.step(1)
def test_a_mesh_that_does_not_fit_is_refused(kata):
    GRID.check_refusals(_mesh_world()[0]["refused"])


# --------------------------------------------------------------------------- step 2: TP in the row


def _tp_block(rank, world_size):
    kata = load_kata(KATA)
    mesh = kata.make_mesh(2, 2)
    linear = nn.Linear(16, 64)
    slices = {}
    for style in ("column", "row"):
        try:
            weight, bias = kata.tp_shard(linear, style, mesh)
        except KataTodo:
            raise
        except Exception as error:
            raise AssertionError(
                _fail(rank, f"tp_shard(Linear(16, 64), {style!r})", error)
            ) from None
        slices[style] = (weight.detach().clone(), bias.detach().clone(), linear.weight.detach())
    out = {
        "indices": (mesh.dp_index, mesh.tp_index),
        "slices": slices,
        "linear": (linear.weight.detach().clone(), linear.bias.detach().clone()),
    }
    try:
        out.update(_run_block(kata, mesh))
    except KataTodo:
        raise
    except Exception as error:  # a wrong slice breaks the block: the slice test names it first
        out["block error"] = _fail(rank, "TensorParallelBlock", error)
    return out


def _run_block(kata, mesh):
    dense = make_transformer(3).blocks[0]
    block = kata.TensorParallelBlock(copy.deepcopy(dense), mesh)
    # The rows of a row read the same activations; each row its own.
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 + mesh.dp_index))
    mine = x.clone().requires_grad_()
    with recording() as forward_calls:
        y = block(mine)
    with recording() as backward_calls:
        y.square().sum().backward()
    leaf = x.clone().requires_grad_()
    expected = dense(leaf)
    expected.square().sum().backward()
    grads = {n: p.grad for n, p in block.named_parameters()}
    dense_grads = {n: _tp_slice(p.grad, n, mesh.tp_index, 2) for n, p in dense.named_parameters()}
    return {
        "calls": (_calls(forward_calls, mesh), _calls(backward_calls, mesh)),
        "output": (y.detach(), expected.detach()),
        "input grad": (mine.grad, leaf.grad),
        "grads": (grads, dense_grads),
    }


@shared_run
def _tp_world():
    return run_world(_tp_block, 4, deadline=60)


@pytest.mark.step(2)
def test_tp_shard_takes_the_row_rank_s_slice(kata):
    for rank, result in enumerate(_tp_world()):
        dp_index, tp_index = result["indices"]
        weight, bias = result["linear"]
        for style, (got_w, got_b, _) in result["slices"].items():
            if style == "column":
                want_w, want_b = (
                    weight[tp_index * 32 : (tp_index + 1) * 32],
                    bias[tp_index * 32 :][:32],
                )
                wrong = {
                    "your dp_index": weight[dp_index * 32 : (dp_index + 1) * 32],
                    "the columns (a row-parallel slice)": weight[
                        :, tp_index * 8 : (tp_index + 1) * 8
                    ],
                }
            else:
                want_w, want_b = weight[:, tp_index * 8 : (tp_index + 1) * 8], bias
                wrong = {
                    "your dp_index": weight[:, dp_index * 8 : (dp_index + 1) * 8],
                    "the rows (a column-parallel slice)": weight[
                        tp_index * 32 : (tp_index + 1) * 32
                    ],
                }
            where = f"rank {rank} (dp {dp_index}, tp {tp_index})"
            if not torch.equal(got_w, want_w):
                why = next(
                    (
                        f": that is the slice of {w}"
                        for w, t in wrong.items()
                        if torch.equal(got_w, t)
                    ),
                    "",
                )
                raise AssertionError(
                    f"{where}: tp_shard(Linear(16, 64), {style!r})'s weight is "
                    f"{_gap(got_w, want_w)} from the slice of tp_index {tp_index}{why}. A "
                    f"{style}-parallel layer keeps the "
                    + (
                        "rows (output features)"
                        if style == "column"
                        else "columns (input features)"
                    )
                    + " of its rank IN THE ROW, mesh.tp_index, not of the global rank"
                )
            assert torch.equal(got_b, want_b), (
                f"{where}: tp_shard(Linear(16, 64), {style!r})'s bias is {_gap(got_b, want_b)}: "
                + (
                    "a column-parallel bias is split like the rows"
                    if style == "column"
                    else "a row-parallel layer keeps the WHOLE bias (added once, after the sum)"
                )
            )


@pytest.mark.step(2)
def test_tp_shard_refuses_features_that_do_not_divide(kata):
    mesh = kata.Mesh(dp=1, tp=4, dp_index=0, tp_index=1)
    for style, linear in (("column", nn.Linear(16, 6)), ("row", nn.Linear(6, 16))):
        try:
            kata.tp_shard(linear, style, mesh)
        except ValueError:
            continue
        raise AssertionError(
            f"tp_shard(Linear({linear.in_features}, {linear.out_features}), {style!r}) with tp "
            "= 4 returned a slice: 6 features do not split over 4 ranks (some rank would hold "
            "a different share, or none): raise ValueError saying tp must divide them"
        )


@pytest.mark.step(2)
def test_tp_block_all_reduces_on_the_row_only(kata):
    for rank, result in enumerate(_tp_world()):
        assert "block error" not in result, result.get("block error")
        forward, backward = result["calls"]
        for what, calls in (("forward", forward), ("backward", backward)):
            off = [c for c in calls if c[1] != "tp"]
            assert not off, (
                f"rank {rank}: TensorParallelBlock's {what} called {off}: every TP collective "
                "runs on mesh.tp_group. A column's ranks hold the SAME slice and read DIFFERENT "
                "batches: summing partial products over the world (or a column) adds numbers "
                "that belong to different inputs. Pass mesh.tp_group to f and g"
            )
            assert calls == [("all-reduce", "tp")] * 2, (
                f"rank {rank}: TensorParallelBlock's {what} called {calls or 'nothing'}: "
                "expected exactly two all-reduces on the tp group (attention's and the MLP's: "
                + (
                    "g in out and in down"
                    if what == "forward"
                    else "f's backward entering each, the input's gradient summed over the row"
                )
                + ")"
            )


@pytest.mark.step(2)
def test_tp_block_equals_the_dense_block(kata):
    for rank, result in enumerate(_tp_world()):
        assert "block error" not in result, result.get("block error")
        for what in ("output", "input grad"):
            got, want = result[what]
            assert _close(got, want), (
                f"rank {rank}: TensorParallelBlock's {what} differs from the dense block's: "
                f"{_gap(got, want)}. Each row-parallel layer adds its bias once, AFTER the "
                "sum over the row; f enters attention and the MLP (after their LayerNorm)"
            )
        grads, dense_grads = result["grads"]
        for name, want in dense_grads.items():
            why = (
                ": a LayerNorm's gradient is whole only when f sits AFTER it (f's backward sums "
                "the row's slices before the LayerNorm's backward reads them)"
                if "norm" in name
                else ""
            )
            assert _close(grads.get(name), want), (
                f"rank {rank}: the gradient of {name} differs from the dense block's slice: "
                f"{_gap(grads.get(name), want)}{why}"
            )


# --------------------------------------------------------------------------- step 3: FSDP down the column


@pytest.mark.step(3)
def test_shard_of_pads_and_takes_the_column_rank_s_piece(kata):
    flat = torch.arange(10.0)
    for dp, dp_index, tp_index, want in (
        (3, 2, 0, [8.0, 9.0, 0.0, 0.0]),
        (2, 0, 1, [0.0, 1.0, 2.0, 3.0, 4.0]),
        (2, 1, 0, [5.0, 6.0, 7.0, 8.0, 9.0]),
    ):
        mesh = kata.Mesh(dp=dp, tp=2, dp_index=dp_index, tp_index=tp_index)
        got = kata.shard_of(flat, mesh)
        assert got.tolist() == want, (
            f"shard_of(arange(10)) for dp = {dp}, dp_index {dp_index}, tp_index {tp_index} is "
            f"{got.tolist()}, expected {want}: pad with zeros to a multiple of dp, then take "
            "piece mesh.dp_index (the rank in the COLUMN, which shards the unit)"
        )
        assert got.data_ptr() != flat.data_ptr(), "shard_of must return a new tensor (clone it)"


def _gather(rank, world_size):
    kata = load_kata(KATA)
    mesh = kata.make_mesh(2, 2)
    shard = torch.tensor([10.0 * rank, 10.0 * rank + 1]).requires_grad_()
    with recording() as forward_calls:
        full = kata.GatherFromColumn.apply(shard, mesh)
    upstream = torch.arange(4.0) + 100.0 * rank
    with recording() as backward_calls:
        full.backward(upstream)
    return {
        "mesh": (mesh.dp_index, mesh.tp_index, list(mesh.dp_ranks)),
        "full": full.detach(),
        "grad": shard.grad,
        "calls": (_calls(forward_calls, mesh), _calls(backward_calls, mesh)),
    }


@shared_run
def _gather_world():
    return run_world(_gather, 4, deadline=60)


@pytest.mark.step(3)
def test_the_gather_runs_down_the_column(kata):
    for rank, result in enumerate(_gather_world()):
        forward, backward = result["calls"]
        assert forward == [("all-gather", "dp")], (
            f"rank {rank}: GatherFromColumn's forward called {forward or 'nothing'}: expected one "
            "all-gather on mesh.dp_group. The column shares one slice: only its ranks hold the "
            "other pieces of this rank's shard (the row holds different slices)"
        )
        assert backward == [("reduce-scatter", "dp")], (
            f"rank {rank}: GatherFromColumn's backward called {backward or 'nothing'}: expected "
            "one reduce-scatter on mesh.dp_group (each rank gets only its piece's sum: half an "
            "all-reduce's bytes)"
        )


@pytest.mark.step(3)
def test_the_gather_and_its_mean(kata):
    for rank, result in enumerate(_gather_world()):
        _, _, column = result["mesh"]
        want = torch.tensor([v for r in column for v in (10.0 * r, 10.0 * r + 1)])
        assert torch.equal(result["full"], want), (
            f"rank {rank}: GatherFromColumn gave {result['full'].tolist()}, expected the "
            f"column {column}'s shards end to end, {want.tolist()}"
        )
        piece = column.index(rank)
        total = sum(torch.arange(4.0) + 100.0 * r for r in column)[2 * piece : 2 * piece + 2]
        got = result["grad"]
        if got is not None and torch.allclose(got, total):
            raise AssertionError(
                f"rank {rank}: the shard's gradient is {got.tolist()}, the SUM over the column: "
                f"divide by mesh.dp ({len(column)}): each column rank read a different part of "
                "the batch, and the gradient of the whole batch's mean loss is their mean"
            )
        assert got is not None and torch.allclose(got, total / len(column)), (
            f"rank {rank}: the shard's gradient is {None if got is None else got.tolist()}, "
            f"expected the mean over the column {column} of this rank's piece, "
            f"{(total / len(column)).tolist()}"
        )


# --------------------------------------------------------------------------- step 4: training


def _unit_locals(unit, mesh) -> dict[str, torch.Tensor]:
    """A unit's tensor-parallel parameters, gathered down the column by the test itself."""
    import torch.distributed as dist

    shard = unit.shard.detach().contiguous()
    pieces = [torch.empty_like(shard) for _ in range(mesh.dp)]
    dist.all_gather(pieces, shard, group=mesh.dp_group)
    full = torch.cat(pieces)[: unit.numel]
    return {n: t.clone() for n, t in unit.unit_parameters(full).items()}


def _train(rank, world_size, dp, tp):
    kata = load_kata(KATA)
    mesh = kata.make_mesh(dp, tp)
    dense = make_transformer(5)
    model = kata.FsdpTpTransformer(dense, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    alone = copy.deepcopy(dense)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=LR)
    losses, expected_losses, calls = [], [], None
    for step in range(STEPS):
        tokens, targets = make_tokens(8, 40 + step)
        share = 8 // dp
        mine = slice(mesh.dp_index * share, (mesh.dp_index + 1) * share)
        with torch.no_grad():
            expected_losses.append(transformer_loss(alone(tokens[mine]), targets[mine]).item())
        with recording() as recorded:
            losses.append(kata.train_step(model, optimizer, tokens, targets, mesh))
        calls = calls or _calls(recorded, mesh)
        transformer_loss(alone(tokens), targets).backward()
        alone_optimizer.step()
        alone_optimizer.zero_grad()
    mine_params = {}
    for prefix, unit in [("embedding.", model.embedding), ("head.", model.head)] + [
        (f"blocks.{i}.", u) for i, u in enumerate(model.blocks)
    ]:
        for name, t in _unit_locals(unit, mesh).items():
            if prefix == "head.":
                name = name.replace("0.", "norm.", 1).replace("1.", "output.", 1)
                prefix_ = ""
            else:
                prefix_ = prefix
            mine_params[prefix_ + name] = t
    expected = {
        n: (
            _tp_slice(p.detach(), n.split(".", 2)[2], mesh.tp_index, tp)
            if n.startswith("blocks.")
            else p.detach()
        )
        for n, p in alone.named_parameters()
    }
    return {
        "mesh": (mesh.dp_index, mesh.tp_index),
        "losses": (losses, expected_losses),
        "calls": calls,
        "params": (mine_params, expected),
    }


@shared_run
def _train_world(dp, tp):
    return run_world(_train, 4, dp, tp, deadline=90)


@pytest.mark.step(4)
@pytest.mark.parametrize("dp,tp", MESHES)
def test_each_row_reads_its_part_of_the_batch(kata, dp, tp):
    for rank, result in enumerate(_train_world(dp, tp)):
        dp_index, tp_index = result["mesh"]
        got, want = result["losses"]
        for step, (g, w) in enumerate(zip(got, want)):
            assert isinstance(g, float), (
                f"rank {rank}: train_step returned {g!r}: the loss, a float"
            )
            assert abs(g - w) < 1e-5, (
                f"rank {rank} (dp {dp_index}, tp {tp_index}) of a {dp} x {tp} mesh: step "
                f"{step}'s loss is {g:.6f}, expected {w:.6f}, one process's loss on rows "
                f"{dp_index * 8 // dp}..{(dp_index + 1) * 8 // dp} of the batch of 8. Each ROW reads "
                "part dp_index (the ranks of a row the SAME part: tensor parallelism splits the "
                "layers, not the data); slice by mesh.dp_index, not by the global rank"
                + ("; and zero the gradients after each step" if step else "")
            )


@pytest.mark.step(4)
@pytest.mark.parametrize("dp,tp", MESHES)
def test_training_equals_one_process(kata, dp, tp):
    for rank, result in enumerate(_train_world(dp, tp)):
        mine, expected = result["params"]
        for name, want in expected.items():
            assert _close(mine.get(name), want), (
                f"rank {rank} of a {dp} x {tp} mesh: after {STEPS} SGD steps {name} (this rank's "
                f"slice) differs from one process's trained on the whole batch: "
                f"{_gap(mine.get(name), want)}. Zero the gradients after each step"
            )


@pytest.mark.step(4)
def test_a_batch_that_does_not_split_over_the_rows_is_refused(kata):
    mesh = kata.Mesh(dp=3, tp=1, dp_index=0, tp_index=0)
    tokens, targets = make_tokens(8, 1)
    did = refusal(lambda: kata.train_step(None, None, tokens, targets, mesh))
    assert did is None, (
        f"train_step with a batch of 8 on dp = 3 rows {did}: check the batch first and raise "
        "ValueError (8 rows do not split over 3)"
    )


@pytest.mark.step(4)
def test_one_step_s_collectives_per_group_in_order(kata):
    for rank, result in enumerate(_train_world(2, 2)):
        calls = result["calls"]
        dp_calls = [k for k, g in calls if g == "dp"]
        tp_calls = [k for k, g in calls if g == "tp"]
        off = [c for c in calls if c[1] not in ("dp", "tp")]
        assert not off, f"rank {rank}: one train_step on the 2 x 2 mesh also called {off}"
        assert dp_calls == ["all-gather"] * 4 + ["reduce-scatter"] * 4, (
            f"rank {rank}: one train_step's calls on the dp group were {dp_calls}: expected "
            "4 all-gathers (embedding, 2 blocks, head) then 4 reduce-scatters in backward"
        )
        assert tp_calls == ["all-reduce"] * 8, (
            f"rank {rank}: one train_step's calls on the tp group were {tp_calls}: expected 8 "
            "all-reduces (2 per block forward, 2 per block backward)"
        )
        assert calls == ORDER, (
            f"rank {rank}: one train_step's collectives ran in the order {calls}, expected "
            f"{ORDER}: forward gathers each unit down the column just before it runs (the "
            "embedding, a block, its two row all-reduces, the next block, the head); backward "
            "reduce-scatters each unit's gradient once its backward is done (the head first, "
            "each block after its two row all-reduces, the embedding last)"
        )


# --------------------------------------------------------------------------- step 5: the whole state


def _against_torch(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    kata = load_kata(KATA)
    mesh = kata.make_mesh(2, 2)
    dense = make_transformer(7)
    model = kata.FsdpTpTransformer(dense, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    alone = copy.deepcopy(dense)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=LR)
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = copy.deepcopy(dense)
    plan = {n: ColwiseParallel() if s == "column" else RowwiseParallel() for n, s in PLAN.items()}
    for block in theirs.blocks:
        parallelize_module(block, device_mesh["tp"], plan)
        fully_shard(block, mesh=device_mesh["dp"])
    fully_shard(theirs, mesh=device_mesh["dp"])
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, targets = make_tokens(8, 60 + step)
        losses.append(kata.train_step(model, optimizer, tokens, targets, mesh))
        part = slice(4 * mesh.dp_index, 4 * mesh.dp_index + 4)
        their_loss = transformer_loss(theirs(tokens[part]), targets[part])
        their_loss.backward()
        their_optimizer.step()
        their_optimizer.zero_grad()
        losses[-1] = (losses[-1], their_loss.item())
        transformer_loss(alone(tokens), targets).backward()
        alone_optimizer.step()
        alone_optimizer.zero_grad()
    # torch's whole state first: a call of full_state's that its peers never make then leaves
    # them waiting in full_state alone, where the report shows them, not in torch's gathers
    their_state = {n: p.full_tensor().detach().clone() for n, p in theirs.named_parameters()}
    with recording() as recorded:
        state = kata.full_state(model, mesh)
    if not isinstance(state, dict):
        raise AssertionError(
            f"full_state returned {type(state).__name__}: return a dict, the dense model's "
            "parameter names to their whole tensors"
        )
    return {
        "state": {n: t.detach().clone() for n, t in state.items()},
        "alone": {n: p.detach().clone() for n, p in alone.named_parameters()},
        "theirs": their_state,
        "losses": losses,
        "calls": _calls(recorded, mesh),
    }


@shared_run
def _torch_world():
    return run_world(_against_torch, 4, deadline=120)


@pytest.mark.step(5)
def test_full_state_equals_one_process(kata):
    for rank, result in enumerate(_torch_world()):
        state, alone = result["state"], result["alone"]
        missing = sorted(set(alone) - set(state))
        assert not missing, f"rank {rank}: full_state lacks {missing[:4]}: every dense parameter"
        for name, want in alone.items():
            got = state[name]
            assert _close(got, want), (
                f"rank {rank}: full_state's {name} differs from one process's: {_gap(got, want)}. "
                "Gather the unit down the column first (mesh.dp_group, then drop the padding), "
                "then a TP weight across the row (mesh.tp_group), joined on the dimension it was "
                "split: dim 0 for column-parallel weights and biases, dim 1 for row-parallel "
                "weights; replicated parameters need no gather across the row"
            )
        off = [c for c in result["calls"] if c[1] not in ("dp", "tp")]
        assert not off, (
            f"rank {rank}: full_state called {off}: gather down mesh.dp_group and across "
            "mesh.tp_group only"
        )


@pytest.mark.step(5)
def test_against_torchs_fully_shard_and_parallelize_module(kata):
    for rank, result in enumerate(_torch_world()):
        for step, (mine, theirs) in enumerate(result["losses"]):
            assert abs(mine - theirs) < 1e-5, (
                f"rank {rank}: step {step}'s loss {mine:.6f} differs from torch's fully_shard x "
                f"parallelize_module on the same mesh, {theirs:.6f}"
            )
        for name, want in result["theirs"].items():
            got = result["state"].get(name)
            assert _close(got, want), (
                f"rank {rank}: after {STEPS} steps {name} differs from torch's "
                "fully_shard(mesh['dp']) over parallelize_module(mesh['tp']) of one "
                f"init_device_mesh('cpu', (2, 2)): {_gap(got, want)}"
            )


@pytest.mark.step(5)
def test_program_trains_like_one_process(kata):
    args = ("--dp", "2", "--tp", "2", "--steps", "2")
    out = run_module_ok(KATA, *args).stdout
    shown = f"`python -m katas.{KATA} {' '.join(args)}`"
    for line, why in (
        ("[rank 3] dp 1, tp 1", "rank 3 = dp_index 1 * tp 2 + tp_index 1"),
        (
            "tp: all-reduce 8; dp: all-gather 4, reduce-scatter 4; world: nothing",
            "one step's collectives, each on its own group",
        ),
        (
            "every rank's whole model equals one process's",
            "its verdict: the trained model equals one process's",
        ),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    mesh = kata.make_mesh(1, 1)
    dense = make_transformer(9).to(device)
    model = kata.FsdpTpTransformer(dense, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    alone = copy.deepcopy(dense)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=LR)
    for step in range(STEPS):
        tokens, targets = (t.to(device) for t in make_tokens(4, 80 + step))
        kata.train_step(model, optimizer, tokens, targets, mesh)
        transformer_loss(alone(tokens), targets).backward()
        alone_optimizer.step()
        alone_optimizer.zero_grad()
    state = kata.full_state(model, mesh)
    return (
        str(model.embedding.shard.device),
        {n: t.cpu() for n, t in state.items()},
        {n: p.detach().cpu() for n, p in alone.named_parameters()},
    )


@pytest.mark.step(5)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    device, state, alone = run_world(_on_cuda, 1, **on_cuda(1, "nccl", deadline=90))[0]
    assert device.startswith("cuda"), f"the shards left the GPU: {device}"
    for name, want in alone.items():
        # CUDA matmuls may use TF32 or other kernels: a looser tolerance than on the CPU.
        assert torch.allclose(state[name], want, rtol=1e-3, atol=1e-3), (
            f"{name} on CUDA after {STEPS} steps differs from one process's: {_gap(state[name], want)}"
        )
