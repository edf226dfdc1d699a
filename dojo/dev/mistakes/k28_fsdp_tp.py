"""k28's mistakes catalogue: real mistakes on a 2-D mesh (the grid's groups, tensor parallel in
the row, FSDP down the column, the batch split, the state put back together), and right answers
written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

Method entries are subclasses of the reference with one method done the way a learner might
(the catalogue swaps whole classes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.toy_models import transformer_loss
from solutions import k28_fsdp_tp as reference

Mesh = reference.Mesh
TP_PLAN = reference.TP_PLAN
all_gather_flat = reference.all_gather_flat
reduce_scatter_flat = reference.reduce_scatter_flat
f = reference.CopyToParallelRegion.apply
g = reference.ReduceFromParallelRegion.apply


# --------------------------------------------------------------------------- step 1: the mesh


def _mesh(dp, tp, dp_index, tp_index, rows, columns, transpose_groups=False):
    row_groups = [dist.new_group(r) for r in rows]
    column_groups = [dist.new_group(c) for c in columns]
    tp_group, dp_group = row_groups[dp_index], column_groups[tp_index]
    if transpose_groups:
        tp_group, dp_group = dp_group, tp_group
    return Mesh(dp, tp, dp_index, tp_index, tp_group, dp_group, rows[dp_index], columns[tp_index])


def _grid(dp, tp):
    world = dist.get_world_size()
    rows = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    columns = [list(range(t, world, tp)) for t in range(tp)]
    return world, rows, columns


def _checked(dp, tp):
    world = dist.get_world_size()
    if dp < 1 or tp < 1 or dp * tp != world:
        raise ValueError(f"a {dp} x {tp} mesh does not fit a world of {world}")


def mesh_transposed(dp, tp):
    """The grid read down the columns: dp_index = rank % dp (rank = tp_index * dp + dp_index)."""
    _checked(dp, tp)
    world, rows, columns = _grid(dp, tp)
    rank = dist.get_rank()
    return _mesh(dp, tp, rank % dp, rank // dp, rows, columns)


def mesh_as_two_groups(dp, tp):
    """The right groups, returned as a pair rather than the Mesh written for the learner."""
    _checked(dp, tp)
    world, rows, columns = _grid(dp, tp)
    dp_index, tp_index = divmod(dist.get_rank(), tp)
    mesh = _mesh(dp, tp, dp_index, tp_index, rows, columns)
    return mesh.tp_group, mesh.dp_group


def mesh_groups_swapped(dp, tp):
    """The row's group kept as dp_group and the column's as tp_group."""
    _checked(dp, tp)
    world, rows, columns = _grid(dp, tp)
    dp_index, tp_index = divmod(dist.get_rank(), tp)
    return _mesh(dp, tp, dp_index, tp_index, rows, columns, transpose_groups=True)


def mesh_checks_only_too_big(dp, tp):
    """Refuses a mesh larger than the world, but builds one that is too small."""
    world = dist.get_world_size()
    if dp * tp > world:
        raise ValueError(f"a {dp} x {tp} mesh needs {dp * tp} ranks, the world has {world}")
    world, rows, columns = _grid(dp, tp)
    dp_index, tp_index = divmod(dist.get_rank(), tp)
    return _mesh(dp, tp, dp_index, tp_index, rows, columns)


def mesh_vague_error(dp, tp):
    """Refuses, but does not say what the world is."""
    if dp < 1 or tp < 1 or dp * tp != dist.get_world_size():
        raise ValueError("bad mesh")
    world, rows, columns = _grid(dp, tp)
    dp_index, tp_index = divmod(dist.get_rank(), tp)
    return _mesh(dp, tp, dp_index, tp_index, rows, columns)


def mesh_columns_first(dp, tp):
    """Right: the columns' groups first, then the rows' (the same order on every rank)."""
    _checked(dp, tp)
    world, rows, columns = _grid(dp, tp)
    dp_index, tp_index = divmod(dist.get_rank(), tp)
    column_groups = [dist.new_group(c) for c in columns]
    row_groups = [dist.new_group(r) for r in rows]
    return Mesh(
        dp,
        tp,
        dp_index,
        tp_index,
        row_groups[dp_index],
        column_groups[tp_index],
        rows[dp_index],
        columns[tp_index],
    )


# --------------------------------------------------------------------------- step 2: TP in the row


def _slice(linear, style, index, parts, whole_row_bias=True):
    features = linear.out_features if style == "column" else linear.in_features
    if features % parts:
        raise ValueError(f"{features} features do not split over {parts}")
    n = features // parts
    s, e = index * n, (index + 1) * n
    with torch.no_grad():
        if style == "column":
            return linear.weight[s:e].clone(), linear.bias[s:e].clone()
        bias = linear.bias.clone() if whole_row_bias else linear.bias[s:e].clone()
        return linear.weight[:, s:e].clone(), bias


def shard_by_global_rank(linear, style, mesh):
    """The slice of the global rank, not of the rank in the row."""
    return _slice(linear, style, dist.get_rank(), mesh.tp)


def shard_by_dp_index(linear, style, mesh):
    """The slice of the rank in the column."""
    return _slice(linear, style, mesh.dp_index, mesh.tp)


def shard_rows_for_both(linear, style, mesh):
    """Row-parallel written like column-parallel: the weight's rows, not its columns."""
    return _slice(linear, "column", mesh.tp_index, mesh.tp)


def shard_row_bias_split(linear, style, mesh):
    """The row-parallel bias split like its weight's columns."""
    return _slice(linear, style, mesh.tp_index, mesh.tp, whole_row_bias=False)


def shard_without_check(linear, style, mesh):
    """No check that the features divide: the last ranks get a short slice or none."""
    features = linear.out_features if style == "column" else linear.in_features
    n = max(1, features // mesh.tp)
    s, e = mesh.tp_index * n, (mesh.tp_index + 1) * n
    with torch.no_grad():
        if style == "column":
            return linear.weight[s:e].clone(), linear.bias[s:e].clone()
        return linear.weight[:, s:e].clone(), linear.bias.clone()


def shard_with_chunk(linear, style, mesh):
    """Right: torch.chunk along the split dimension."""
    features = linear.out_features if style == "column" else linear.in_features
    if features % mesh.tp:
        raise ValueError(f"{features} features do not split over tp = {mesh.tp}")
    with torch.no_grad():
        dim = 0 if style == "column" else 1
        weight = linear.weight.chunk(mesh.tp, dim=dim)[mesh.tp_index].clone()
        bias = linear.bias.chunk(mesh.tp)[mesh.tp_index] if style == "column" else linear.bias
        return weight, bias.clone()


class RowOnTheWorld(reference.RowParallelLinear):
    """g over the whole world: the column's partials (other data) summed in too."""

    def forward(self, x):
        return g(F.linear(x, self.weight), None) + self.bias


class RowOnTheColumn(reference.RowParallelLinear):
    """g over the dp group: the same slice of other data summed."""

    def forward(self, x):
        return g(F.linear(x, self.weight), self.mesh.dp_group) + self.bias


class RowBiasBeforeTheSum(reference.RowParallelLinear):
    """The bias inside the partial product: added once per rank of the row."""

    def forward(self, x):
        return g(F.linear(x, self.weight, self.bias), self.mesh.tp_group)


class BlockWithoutF(reference.TensorParallelBlock):
    """No f: the input's gradient is only this rank's slice's share."""

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class BlockFOnTheWorld(reference.TensorParallelBlock):
    """f over the whole world: the gradient summed with the column's (other data)."""

    def forward(self, x):
        x = x + self.attention(f(self.attention_norm(x), None))
        return x + self.mlp(f(self.mlp_norm(x), None))


class BlockFBeforeTheNorm(reference.TensorParallelBlock):
    """f before the LayerNorm: the LayerNorm's gradient is computed from a partial one."""

    def forward(self, x):
        group = self.mesh.tp_group
        x = x + self.attention(self.attention_norm(f(x, group)))
        return x + self.mlp(self.mlp_norm(f(x, group)))


# --------------------------------------------------------------------------- step 3: FSDP down the column


def _pad_pick(flat, parts, index):
    chunk = -(-flat.numel() // parts)
    padded = torch.zeros(chunk * parts, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    return padded[index * chunk : (index + 1) * chunk].clone()


def shard_of_by_tp_index(flat, mesh):
    """The piece of the rank in the row."""
    return _pad_pick(flat, mesh.dp, mesh.tp_index)


def shard_of_without_padding(flat, mesh):
    """No padding: floor division drops the tail."""
    chunk = flat.numel() // mesh.dp
    return flat[mesh.dp_index * chunk : (mesh.dp_index + 1) * chunk].clone()


def shard_of_with_tensor_split(flat, mesh):
    """Right: pad with torch.nn.functional.pad, then chunk."""
    chunk = -(-flat.numel() // mesh.dp)
    padded = F.pad(flat, (0, chunk * mesh.dp - flat.numel()))
    return padded.chunk(mesh.dp)[mesh.dp_index].clone()


class _Gather(torch.autograd.Function):
    group_of = staticmethod(lambda mesh: mesh.dp_group)
    divide_by = staticmethod(lambda mesh: mesh.dp)

    @classmethod
    def forward(cls, ctx, shard, mesh):
        ctx.mesh = mesh
        group = cls.group_of(mesh)
        full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype)
        all_gather_flat(full, shard.detach().contiguous(), group)
        return full

    @classmethod
    def backward(cls, ctx, grad_full):
        mesh = ctx.mesh
        group = cls.group_of(mesh)
        grad = torch.empty(grad_full.numel() // dist.get_world_size(group), dtype=grad_full.dtype)
        reduce_scatter_flat(grad, grad_full.contiguous(), group)
        return grad / cls.divide_by(mesh), None


class GatherOnTheRow(_Gather):
    """The shard gathered across the row (the other slices' shards)."""

    group_of = staticmethod(lambda mesh: mesh.tp_group)
    divide_by = staticmethod(lambda mesh: mesh.tp)


class GatherSums(_Gather):
    """The gradient's sum over the column, not its mean."""

    divide_by = staticmethod(lambda mesh: 1)


class GatherDividesByTheWorld(_Gather):
    """The mean taken over the whole world (dp x tp), not the column."""

    divide_by = staticmethod(lambda mesh: mesh.dp * mesh.tp)


class GatherAllReducesBack(_Gather):
    """Backward all-reduces the whole vector and keeps its own piece: twice a reduce-scatter's
    bytes."""

    @staticmethod
    def backward(ctx, grad_full):
        mesh = ctx.mesh
        total = grad_full.clone()
        dist.all_reduce(total, group=mesh.dp_group)
        piece = total.numel() // mesh.dp
        return total[mesh.dp_index * piece : (mesh.dp_index + 1) * piece] / mesh.dp, None


class GatherWithLists(torch.autograd.Function):
    """Right: all_gather into a list of pieces; backward reduce-scatters and divides."""

    @staticmethod
    def forward(ctx, shard, mesh):
        ctx.mesh = mesh
        pieces = [torch.empty_like(shard) for _ in range(mesh.dp)]
        dist.all_gather(pieces, shard.detach().contiguous(), group=mesh.dp_group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad_full):
        mesh = ctx.mesh
        grad = torch.empty(grad_full.numel() // mesh.dp, dtype=grad_full.dtype)
        reduce_scatter_flat(grad, grad_full.contiguous(), mesh.dp_group)
        return grad.div_(mesh.dp), None


# --------------------------------------------------------------------------- step 4: training


def _step(model, optimizer, tokens, targets, part, zero=True):
    loss = transformer_loss(model(tokens[part]), targets[part])
    loss.backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad()
    return loss.item()


def step_by_global_rank(model, optimizer, tokens, targets, mesh):
    """The batch split by the global rank: the ranks of a row read different data."""
    share = tokens.shape[0] // (mesh.dp * mesh.tp)
    rank = dist.get_rank()
    return _step(model, optimizer, tokens, targets, slice(rank * share, (rank + 1) * share))


def step_by_tp_index(model, optimizer, tokens, targets, mesh):
    """The batch split by the rank in the row."""
    share = tokens.shape[0] // mesh.dp
    part = slice(mesh.tp_index * share, (mesh.tp_index + 1) * share)
    return _step(model, optimizer, tokens, targets, part)


def step_whole_batch(model, optimizer, tokens, targets, mesh):
    """Every row reads the whole batch: the right weights, dp times the work, the wrong loss."""
    return _step(model, optimizer, tokens, targets, slice(None))


def step_without_zero_grad(model, optimizer, tokens, targets, mesh):
    """Gradients never zeroed: each step adds the last one's."""
    share = tokens.shape[0] // mesh.dp
    part = slice(mesh.dp_index * share, (mesh.dp_index + 1) * share)
    return _step(model, optimizer, tokens, targets, part, zero=False)


def step_with_chunk(model, optimizer, tokens, targets, mesh):
    """Right: torch.chunk the batch by dp and take this row's piece."""
    if tokens.shape[0] % mesh.dp:
        raise ValueError(f"a batch of {tokens.shape[0]} does not split over dp = {mesh.dp}")
    mine = tokens.chunk(mesh.dp)[mesh.dp_index], targets.chunk(mesh.dp)[mesh.dp_index]
    optimizer.zero_grad()
    loss = transformer_loss(model(mine[0]), mine[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


# --------------------------------------------------------------------------- step 5: the whole state


def _state(model, mesh, dim_of, gathers_row=True):
    units = [("embedding.", model.embedding)]
    units += [(f"blocks.{i}.", unit) for i, unit in enumerate(model.blocks)]
    units += [("", model.head)]
    out = {}
    with torch.no_grad():
        for prefix, unit in units:
            full = torch.empty(unit.shard.numel() * mesh.dp, dtype=unit.shard.dtype)
            all_gather_flat(full, unit.shard.detach().contiguous(), mesh.dp_group)
            for name, local in unit.unit_parameters(full[: unit.numel]).items():
                layer, _, kind = name.rpartition(".")
                style = TP_PLAN.get(layer) if prefix.startswith("blocks.") else None
                if unit is model.head:
                    name = name.replace("0.", "norm.", 1).replace("1.", "output.", 1)
                dim = dim_of(style, kind)
                if dim is None or not gathers_row:
                    out[prefix + name] = local.clone()
                    continue
                pieces = [torch.empty_like(local) for _ in range(mesh.tp)]
                dist.all_gather(pieces, local.contiguous(), group=mesh.tp_group)
                out[prefix + name] = torch.cat(pieces, dim=dim)
    return out


def state_joins_everything_on_rows(model, mesh):
    """Every split weight joined on dim 0: the row-parallel weights come out stacked wrongly."""
    return _state(
        model,
        mesh,
        lambda style, kind: None if style is None or kind == "bias" and style == "row" else 0,
    )


def state_gathers_row_biases(model, mesh):
    """The row-parallel bias (whole on every rank) gathered across the row too."""
    return _state(
        model,
        mesh,
        lambda style, kind: (
            None if style is None else 1 if style == "row" and kind == "weight" else 0
        ),
    )


def state_gathered_by_the_row_s_first_rank(model, mesh):
    """Real code: only the row's first rank joins the gather across the row ("it writes the
    checkpoint"); the others keep their slices and go on. Its peers never join it."""
    return _state(model, mesh, _dim_split, gathers_row=mesh.tp_index == 0)


def _dim_split(style, kind):
    """The dimension a TP parameter was split along; None for a replicated one."""
    if style is None or (style == "row" and kind == "bias"):
        return None
    return 1 if style == "row" else 0


def state_as_a_list(model, mesh):
    """The right tensors, in the model's order, without their names."""
    return list(_state(model, mesh, _dim_split).values())


def state_never_gathers_the_row(model, mesh):
    """Only the column gathered: each rank's TP slices returned as if they were whole."""
    return _state(model, mesh, lambda style, kind: None)


def state_with_flat_gathers(model, mesh):
    """Right: every gather flat (all_gather_flat), the row's pieces stacked and moved into
    place with movedim and reshape instead of torch.cat."""
    units = [("embedding.", model.embedding)]
    units += [(f"blocks.{i}.", unit) for i, unit in enumerate(model.blocks)]
    units += [("", model.head)]
    names = {"0.": "norm.", "1.": "output."}
    out = {}
    with torch.no_grad():
        for prefix, unit in units:
            full = torch.empty(unit.shard.numel() * mesh.dp, dtype=unit.shard.dtype)
            all_gather_flat(full, unit.shard.detach().contiguous(), mesh.dp_group)
            for name, local in unit.unit_parameters(full[: unit.numel]).items():
                if unit is model.head:
                    name = names[name[:2]] + name[2:]
                layer, _, kind = name.rpartition(".")
                style = TP_PLAN.get(layer) if prefix else None
                if style is None or (style, kind) == ("row", "bias"):
                    out[prefix + name] = local.clone()
                    continue
                stacked = torch.empty(mesh.tp * local.numel(), dtype=local.dtype)
                all_gather_flat(stacked, local.reshape(-1).contiguous(), mesh.tp_group)
                stacked = stacked.view(mesh.tp, *local.shape)
                if style == "row":  # (tp, out, in/tp) -> (out, tp, in/tp) -> (out, in)
                    out[prefix + name] = stacked.movedim(0, 1).reshape(local.shape[0], -1)
                else:
                    out[prefix + name] = stacked.reshape(-1, *local.shape[1:])
    return out


_MESH = "test_mesh_groups_are_rows_and_columns"
_REFUSED = "test_a_mesh_that_does_not_fit_is_refused"
_SLICE = "test_tp_shard_takes_the_row_rank_s_slice"
_DIVIDE = "test_tp_shard_refuses_features_that_do_not_divide"
_ROW_ONLY = "test_tp_block_all_reduces_on_the_row_only"
_DENSE = "test_tp_block_equals_the_dense_block"
_PIECE = "test_shard_of_pads_and_takes_the_column_rank_s_piece"
_COLUMN = "test_the_gather_runs_down_the_column"
_MEAN = "test_the_gather_and_its_mean"
_PART = "test_each_row_reads_its_part_of_the_batch"
_ONE = "test_training_equals_one_process"
_STATE = "test_full_state_equals_one_process"

MISTAKES = [
    Mistake(
        "mesh_as_two_groups",
        replaces="make_mesh",
        fails=[f"{_MESH}[2-2]"],
        says=["make_mesh(2, 2) returned (", "return the Mesh written for you"],
    ),
    Mistake(
        "mesh_transposed",
        replaces="make_mesh",
        fails=[f"{_MESH}[2-2]"],
        says=["(dp_index, tp_index) =", "dp_index = rank // tp"],
    ),
    Mistake(
        "mesh_groups_swapped",
        replaces="make_mesh",
        fails=[f"{_MESH}[2-2]"],
        says=["an all-reduce of the ranks over tp_group", "the groups do not hold those ranks"],
    ),
    Mistake(
        "mesh_checks_only_too_big",
        replaces="make_mesh",
        fails=[_REFUSED],
        says=["make_mesh(2, 1) on 4 ranks returned a mesh", "raise ValueError"],
    ),
    Mistake(
        "mesh_vague_error",
        replaces="make_mesh",
        fails=[_REFUSED],
        says=["name the world size"],
    ),
    Mistake(
        "shard_by_global_rank",
        replaces="tp_shard",
        fails=[_SLICE],
        says=["mesh.tp_index, not of the global rank"],
    ),
    Mistake(
        "shard_by_dp_index",
        replaces="tp_shard",
        fails=[_SLICE],
        says=["that is the slice of your dp_index"],
    ),
    Mistake(
        "shard_rows_for_both",
        replaces="tp_shard",
        fails=[_SLICE],
        says=["that is the slice of the rows (a column-parallel slice)"],
    ),
    Mistake(
        "shard_row_bias_split",
        replaces="tp_shard",
        fails=[_SLICE],
        says=["a row-parallel layer keeps the WHOLE bias"],
    ),
    Mistake(
        "shard_without_check",
        replaces="tp_shard",
        fails=[_DIVIDE],
        says=["returned a slice", "raise ValueError"],
    ),
    Mistake(
        "RowOnTheWorld",
        replaces="RowParallelLinear",
        fails=[_ROW_ONLY],
        says=["TensorParallelBlock's forward called", "runs on mesh.tp_group"],
    ),
    Mistake(
        "RowOnTheColumn",
        replaces="RowParallelLinear",
        fails=[_ROW_ONLY],
        says=["TensorParallelBlock's forward called", "runs on mesh.tp_group"],
    ),
    Mistake(
        "RowBiasBeforeTheSum",
        replaces="RowParallelLinear",
        fails=[_DENSE],
        says=["output differs from the dense block's", "adds its bias once, AFTER the sum"],
    ),
    Mistake(
        "BlockWithoutF",
        replaces="TensorParallelBlock",
        fails=[_ROW_ONLY],
        says=["TensorParallelBlock's backward called nothing"],
    ),
    Mistake(
        "BlockFOnTheWorld",
        replaces="TensorParallelBlock",
        fails=[_ROW_ONLY],
        says=["TensorParallelBlock's backward called", "runs on mesh.tp_group"],
    ),
    Mistake(
        "BlockFBeforeTheNorm",
        replaces="TensorParallelBlock",
        fails=[_DENSE],
        says=["attention_norm", "only when f sits AFTER it"],
    ),
    Mistake(
        "shard_of_by_tp_index",
        replaces="shard_of",
        fails=[_PIECE],
        says=["take piece mesh.dp_index"],
    ),
    Mistake(
        "shard_of_without_padding",
        replaces="shard_of",
        fails=[_PIECE],
        says=["pad with zeros to a multiple of dp"],
    ),
    Mistake(
        "GatherOnTheRow",
        replaces="GatherFromColumn",
        fails=[_COLUMN],
        says=["expected one all-gather on mesh.dp_group"],
    ),
    Mistake(
        "GatherSums",
        replaces="GatherFromColumn",
        fails=[_MEAN],
        says=["the SUM over the column", "divide by mesh.dp"],
    ),
    Mistake(
        "GatherDividesByTheWorld",
        replaces="GatherFromColumn",
        fails=[_MEAN],
        says=["expected the mean over the column"],
    ),
    Mistake(
        "GatherAllReducesBack",
        replaces="GatherFromColumn",
        fails=[_COLUMN],
        says=["backward called [('all-reduce', 'dp')]", "one reduce-scatter"],
    ),
    Mistake(
        "step_by_global_rank",
        replaces="train_step",
        fails=[f"{_PART}[2-2]"],
        says=["slice by mesh.dp_index, not by the global rank"],
    ),
    Mistake(
        "step_by_tp_index",
        replaces="train_step",
        fails=[f"{_PART}[2-2]"],
        says=["the ranks of a row the SAME part"],
    ),
    Mistake(
        "step_whole_batch",
        replaces="train_step",
        fails=[f"{_PART}[2-2]"],
        says=["Each ROW reads part dp_index"],
    ),
    Mistake(
        "step_without_zero_grad",
        replaces="train_step",
        fails=[f"{_ONE}[2-2]"],
        says=["Zero the gradients after each step"],
    ),
    Mistake(
        "state_joins_everything_on_rows",
        replaces="full_state",
        fails=[_STATE],
        says=["attention.out.weight differs from one process's", "dim 1 for row-parallel"],
    ),
    Mistake(
        "state_gathers_row_biases",
        replaces="full_state",
        fails=[_STATE],
        says=["attention.out.bias differs", "replicated parameters need no gather"],
    ),
    Mistake(
        "state_gathered_by_the_row_s_first_rank",
        replaces="full_state",
        fails=[_STATE],
        says=[
            "deadlock: rank(s) 0, 2",  # stalled or straggling: which one depends on the load
            "wait in all_gather",
            "1, 3 returned",
        ],
    ),
    Mistake(
        "state_as_a_list",
        replaces="full_state",
        fails=[_STATE],
        says=["full_state returned list", "return a dict"],
    ),
    Mistake(
        "state_never_gathers_the_row",
        replaces="full_state",
        fails=[_STATE],
        says=["differs from one process's", "then a TP weight across the row"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("mesh_columns_first", replaces="make_mesh"),
    RightAnswer("shard_with_chunk", replaces="tp_shard"),
    RightAnswer("shard_of_with_tensor_split", replaces="shard_of"),
    RightAnswer("GatherWithLists", replaces="GatherFromColumn", steps=(3, 5)),
    RightAnswer("step_with_chunk", replaces="train_step"),
    RightAnswer("state_with_flat_gathers", replaces="full_state"),
]
