"""k20's mistakes catalogue: real mistakes in tensor parallelism (f and g, column- and
row-parallel linears, the MLP and attention split over ranks), and right answers written another
way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

f and g entries are whole autograd functions; layer entries are subclasses of the reference with
one method done the way a learner might (the catalogue swaps whole classes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k20_tensor_parallel as reference

copy_to_parallel_region = reference.copy_to_parallel_region
reduce_from_parallel_region = reference.reduce_from_parallel_region
shard_range = reference.shard_range


# --------------------------------------------------------------------------- f and g


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FLikeG(_Reduce):
    """f written as g: all-reduce forward, identity backward (f and g swapped)."""


class GLikeF(torch.autograd.Function):
    """g written as f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FWithoutAllReduce(_Identity):
    """ "the identity both ways": the gradient of x stays this rank's own."""


class FBackwardAverages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None  # "as DDP does": but this is a sum


class FOnTheWorld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)  # the group forgotten

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # the whole world
        return grad, None


class GAverages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)  # the caller's tensor now holds the sum
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GBackwardAllReduces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # "a collective forward, so one backward too"
        return grad, None


class FReturnsX(torch.autograd.Function):
    """Right (as Megatron-LM writes it): forward returns x itself; backward all-reduces in place."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class GFromADetachedCopy(torch.autograd.Function):
    """Right: the copy made with detach().clone(), the op and group passed by position."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.detach().clone()
        dist.all_reduce(total, dist.ReduceOp.SUM, group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --------------------------------------------------------------------------- column parallel


def shard_range_world_rank(features, group, what):
    # the rank in the world: right only while the group is the world
    size, rank = dist.get_world_size(group), dist.get_rank()
    if features % size:
        raise ValueError(f"{what}: {features} features over {size} ranks")
    share = features // size
    return rank * share, (rank + 1) * share


def shard_range_unchecked(features, group, what):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = features // size  # 64 // 3 = 21: one feature silently dropped
    return rank * share, (rank + 1) * share


def shard_range_with_chunks(features, group, what):
    """Right: the bounds of torch.chunk's pieces."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if features % size:
        raise ValueError(
            f"{what}: {features} features cannot be split equally between {size} ranks; pick "
            "sizes that divide"
        )
    bounds = torch.arange(features).chunk(size)[rank]
    return int(bounds[0]), int(bounds[-1]) + 1


_Column = reference.ColumnParallelLinear
_Row = reference.RowParallelLinear


class ColumnSlicesColumns(_Column):
    def _shard(self, linear):
        start, end = shard_range(linear.out_features, self.process_group, "column")
        n = linear.in_features // dist.get_world_size(self.process_group)
        rank = dist.get_rank(self.process_group)
        with torch.no_grad():  # "weight[:, mine]": the transposed picture, y = x @ W
            weight = linear.weight[:, rank * n : (rank + 1) * n].clone()
            return weight, linear.bias[start:end].clone()


class ColumnKeepsAView(_Column):
    def _shard(self, linear):
        start, end = shard_range(linear.out_features, self.process_group, "column")
        return linear.weight.detach()[start:end], linear.bias.detach()[start:end]  # views


class ColumnWithoutF(_Column):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)  # "x is the same everywhere: nothing to do"


class ColumnWithG(_Column):
    def forward(self, x):
        return F.linear(reduce_from_parallel_region(x, self.process_group), self.weight, self.bias)


class ColumnWithChunk(_Column):
    """Right: torch.chunk's piece of this rank, made contiguous (a copy)."""

    def _shard(self, linear):
        shard_range(linear.out_features, self.process_group, "ColumnParallelLinear")  # the check
        size, rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        weight = linear.weight.detach().chunk(size, dim=0)[rank].clone()
        bias = None if linear.bias is None else linear.bias.detach().chunk(size)[rank].clone()
        return weight, bias


# --------------------------------------------------------------------------- row parallel


class RowSlicesRows(_Row):
    def _shard(self, linear):
        start, end = shard_range(linear.in_features, self.process_group, "row")
        n = linear.out_features // dist.get_world_size(self.process_group)
        rank = dist.get_rank(self.process_group)
        with torch.no_grad():
            return linear.weight[rank * n : (rank + 1) * n].clone(), linear.bias.clone()


class RowBiasSharded(_Row):
    def _shard(self, linear):
        start, end = shard_range(linear.in_features, self.process_group, "row")
        n = linear.out_features // dist.get_world_size(self.process_group)
        rank = dist.get_rank(self.process_group)
        with torch.no_grad():  # "each rank keeps its part of everything"
            return (
                linear.weight[:, start:end].clone(),
                linear.bias[rank * n : (rank + 1) * n].clone(),
            )


class RowBiasOnEveryRank(_Row):
    def forward(self, x):
        partial = F.linear(x, self.weight, self.bias)  # the bias in every partial product
        return reduce_from_parallel_region(partial, self.process_group)


class RowBiasOnRankZero(_Row):
    def forward(self, x):
        partial = F.linear(x, self.weight)
        if dist.get_rank(self.process_group) == 0:
            partial = partial + self.bias  # counted once, but only rank 0's copy ever trains
        return reduce_from_parallel_region(partial, self.process_group)


class RowBiasLivesOnRankZero(_Row):
    """A tensor-parallel repository's layer: the bias kept on the group's rank 0 only and added
    there before the sum. The output is right (the sum counts it once), and the design is right
    elsewhere, but this kata keeps the whole bias on every rank, as Megatron-LM does."""

    def _shard(self, linear):
        start, end = shard_range(linear.in_features, self.process_group, "RowParallelLinear")
        keeps = dist.get_rank(self.process_group) == 0 and linear.bias is not None
        with torch.no_grad():
            return linear.weight[:, start:end].clone(), linear.bias.clone() if keeps else None

    def forward(self, x):
        partial = F.linear(x, self.weight, self.bias)  # the bias only where it lives
        return reduce_from_parallel_region(partial, self.process_group)


class RowWithoutG(_Row):
    def forward(self, x):
        return F.linear(x, self.weight) + self.bias  # the partial product taken for the output


class RowWithTensorSplit(_Row):
    """Right: tensor_split along the input features, made contiguous (a copy)."""

    def _shard(self, linear):
        shard_range(linear.in_features, self.process_group, "RowParallelLinear")  # the check
        size, rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        weight = torch.tensor_split(linear.weight.detach(), size, dim=1)[rank].contiguous()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return weight, bias


class RowBiasViaAddmm(_Row):
    """Right: the bias added by torch.addmm after the sum, on a flattened view."""

    def forward(self, x):
        total = reduce_from_parallel_region(F.linear(x, self.weight), self.process_group)
        flat = total.reshape(-1, total.shape[-1])
        ones = torch.ones(flat.shape[0], 1, dtype=flat.dtype, device=flat.device)
        return torch.addmm(flat, ones, self.bias.unsqueeze(0)).view_as(total)


# --------------------------------------------------------------------------- the MLP


class MLPWithItsOwnFAndG(reference.ParallelMLP):
    def forward(self, x):
        # f and g as in the lesson's picture, on top of the layers' own: twice each
        x = copy_to_parallel_region(x, self.up.process_group)
        y = self.down(torch.relu(self.up(x)))
        return reduce_from_parallel_region(y, self.down.process_group)


class MLPReluAfterTheSum(reference.ParallelMLP):
    def forward(self, x):
        return torch.relu(self.down(self.up(x)))  # relu moved: it no longer sits between them


class MLPOnTheWorld(reference.ParallelMLP):
    def __init__(self, mlp, process_group=None):
        nn.Module.__init__(self)
        self.up = reference.ColumnParallelLinear(mlp.up)  # the group dropped: the whole world
        self.down = reference.RowParallelLinear(mlp.down)


class MLPWithExplicitRegions(reference.ParallelMLP):
    """Right: f and g written in the MLP, with the layers' weights used directly."""

    def forward(self, x):
        group = self.up.process_group
        hidden = torch.relu(
            F.linear(copy_to_parallel_region(x, group), self.up.weight, self.up.bias)
        )
        total = reduce_from_parallel_region(F.linear(hidden, self.down.weight), group)
        return total + self.down.bias


# --------------------------------------------------------------------------- attention


class AttentionSplitsFeatures(reference.ParallelAttention):
    def forward(self, x):
        batch, length, _ = x.shape
        x = copy_to_parallel_region(x, self.process_group)
        heads = self.local_heads * dist.get_world_size(self.process_group)

        def split(t):  # every head, each cut to this rank's share of its features
            return t.view(batch, length, heads, -1).transpose(1, 2)

        q = split(F.linear(x, self.query.weight, self.query.bias))
        k = split(F.linear(x, self.key.weight, self.key.bias))
        v = split(F.linear(x, self.value.weight, self.value.bias))
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class AttentionFPerProjection(reference.ParallelAttention):
    def forward(self, x):
        batch, length, _ = x.shape

        def heads(t):
            return t.view(batch, length, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))  # three f's
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class AttentionScaledByLocalWidth(reference.ParallelAttention):
    def forward(self, x):
        batch, length, _ = x.shape
        x = copy_to_parallel_region(x, self.process_group)

        def heads(t):
            return t.view(batch, length, self.local_heads, self.head_dim).transpose(1, 2)

        q = heads(F.linear(x, self.query.weight, self.query.bias))
        k = heads(F.linear(x, self.key.weight, self.key.bias))
        v = heads(F.linear(x, self.value.weight, self.value.bias))
        width = self.local_heads * self.head_dim  # the rank's features, not a head's
        scores = q @ k.transpose(-2, -1) / width**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class AttentionNoHeadsCheck(reference.ParallelAttention):
    def __init__(self, attention, process_group=None):
        nn.Module.__init__(self)
        self.process_group = process_group
        self.head_dim = attention.head_dim
        size = dist.get_world_size(process_group)
        # "the features divide, so the heads do": the column layers check only the features
        self.local_heads = max(1, attention.query.out_features // attention.head_dim // size)
        self.query = reference.ColumnParallelLinear(attention.query, process_group)
        self.key = reference.ColumnParallelLinear(attention.key, process_group)
        self.value = reference.ColumnParallelLinear(attention.value, process_group)
        self.out = reference.RowParallelLinear(attention.out, process_group)


class AttentionWithSDPA(reference.ParallelAttention):
    """Right: torch's fused attention on this rank's heads (another order of sums: close)."""

    def forward(self, x):
        batch, length, _ = x.shape
        x = copy_to_parallel_region(x, self.process_group)

        def heads(t):
            return t.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2)

        q = heads(F.linear(x, self.query.weight, self.query.bias))
        k = heads(F.linear(x, self.key.weight, self.key.bias))
        v = heads(F.linear(x, self.value.weight, self.value.bias))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).flatten(2))


# --------------------------------------------------------------------------- the catalogue

_F = "test_f_is_identity_forward_and_all_reduce_backward"
_G = "test_g_is_all_reduce_forward_and_identity_backward"
_COLUMN_SHARD = "test_column_parallel_keeps_its_output_features"
_COLUMN = "test_column_parallel_equals_the_dense_layer"
_ROW_SHARD = "test_row_parallel_keeps_its_input_features_and_the_whole_bias"
_ROW = "test_row_parallel_equals_the_dense_layer"
_MLP = "test_parallel_mlp_equals_the_dense_mlp_with_one_all_reduce_each_way"
_ATTENTION = "test_parallel_attention_splits_whole_heads"

MISTAKES = [
    Mistake(
        "FLikeG",
        replaces="CopyToParallelRegion",
        also={"ReduceFromParallelRegion": "GLikeF"},
        fails=[f"{_F}[2]", f"{_G}[2]"],
        says=["f and g are swapped"],
    ),
    Mistake(
        "FWithoutAllReduce",
        replaces="CopyToParallelRegion",
        fails=[f"{_F}[2]", f"{_COLUMN}[4]"],
        says=["made no all-reduce", "x's gradient is the sum"],
    ),
    Mistake(
        "FBackwardAverages",
        replaces="CopyToParallelRegion",
        fails=[_F],
        says=["the gradient's mean over the group", "not divided by the group's size"],
    ),
    Mistake(
        "FOnTheWorld",
        replaces="CopyToParallelRegion",
        fails=[f"{_F}[4-rows]"],
        says=["summed the gradient over the whole world", "group=ctx.group"],
    ),
    Mistake(
        "GAverages",
        replaces="ReduceFromParallelRegion",
        fails=[_G, f"{_ROW}[2]"],
        says=["divide"],
    ),
    Mistake(
        "GInPlace",
        replaces="ReduceFromParallelRegion",
        fails=[f"{_G}[2]"],
        says=["g changed its input in place", "x.clone()"],
    ),
    Mistake(
        "GBackwardAllReduces",
        replaces="ReduceFromParallelRegion",
        fails=[f"{_G}[2]", f"{_ROW}[4]"],
        says=["backward", "identity"],
    ),
    Mistake(
        "shard_range_world_rank",
        replaces="shard_range",
        fails=[f"{_COLUMN_SHARD}[4-rows]", f"{_ROW_SHARD}[4-rows]"],
        says=["dist.get_rank(self.process_group)"],
    ),
    Mistake(
        "shard_range_unchecked",
        replaces="shard_range",
        fails=[
            "test_column_parallel_refuses_features_that_do_not_divide",
            "test_row_parallel_refuses_features_that_do_not_divide",
        ],
        says=["returned a layer", "Raise ValueError saying so"],
    ),
    Mistake(
        "ColumnSlicesColumns",
        replaces="ColumnParallelLinear",
        fails=[f"{_COLUMN_SHARD}[2]", f"{_COLUMN_SHARD}[4]"],
        says=["holds columns (input features) of the dense weight", "keeps ROWS"],
    ),
    Mistake(
        "ColumnKeepsAView",
        replaces="ColumnParallelLinear",
        fails=[f"{_COLUMN_SHARD}[2]"],
        says=["is a view of the dense layer's", "clone() the slice"],
    ),
    Mistake(
        "ColumnWithoutF",
        replaces="ColumnParallelLinear",
        fails=[f"{_COLUMN}[2]"],
        says=["made no all-reduce in backward", "copy_to_parallel_region"],
    ),
    Mistake(
        "ColumnWithG",
        replaces="ColumnParallelLinear",
        fails=[_COLUMN],
        says=["all-reduced in forward", "not g"],
    ),
    Mistake(
        "RowSlicesRows",
        replaces="RowParallelLinear",
        fails=[f"{_ROW_SHARD}[2]", f"{_ROW_SHARD}[4]"],
        says=["holds rows (output features) of the dense weight", "keeps COLUMNS"],
    ),
    Mistake(
        "RowBiasSharded",
        replaces="RowParallelLinear",
        fails=[f"{_ROW_SHARD}[2]"],
        says=["expected the whole dense bias", "every rank keeps all of it"],
    ),
    Mistake(
        "RowBiasOnEveryRank",
        replaces="RowParallelLinear",
        fails=[f"{_ROW}[2]", f"{_ROW}[4]"],
        says=["added the bias on every rank BEFORE the all-reduce", "Add it once"],
    ),
    Mistake(
        "RowBiasOnRankZero",
        replaces="RowParallelLinear",
        fails=[f"{_ROW}[2]", f"{_ROW}[4-rows]"],
        says=["bias", "add the bias on every rank, after the all-reduce"],
    ),
    Mistake(
        "RowBiasLivesOnRankZero",
        replaces="RowParallelLinear",
        fails=[f"{_ROW_SHARD}[2]", f"{_ROW_SHARD}[4-rows]"],
        says=["rank 1", "has no bias", "keep", "Megatron-LM", "right elsewhere"],
    ),
    Mistake(
        "RowWithoutG",
        replaces="RowParallelLinear",
        fails=[_ROW],
        says=["made no all-reduce in forward", "reduce_from_parallel_region"],
    ),
    Mistake(
        "MLPWithItsOwnFAndG",
        replaces="ParallelMLP",
        fails=[f"{_MLP}[2]"],
        says=["made 2 all-reduces in forward", "The layers hold f and g already"],
    ),
    Mistake(
        "MLPReluAfterTheSum",
        replaces="ParallelMLP",
        fails=[_MLP],
        says=["the ReLU came after the down projection's sum", "down(relu(up(x)))"],
    ),
    Mistake(
        "MLPOnTheWorld",
        replaces="ParallelMLP",
        fails=[f"{_MLP}[4-rows]"],
        says=["the whole world"],
    ),
    Mistake(
        "AttentionSplitsFeatures",
        replaces="ParallelAttention",
        fails=[f"{_ATTENTION}[2]", f"{_ATTENTION}[4-rows]"],
        says=["whole heads of its own", "not all the heads cut into smaller ones"],
    ),
    Mistake(
        "AttentionFPerProjection",
        replaces="ParallelAttention",
        fails=[f"{_ATTENTION}[2]"],
        says=["made 3 all-reduces in backward", "pass it through f once"],
    ),
    Mistake(
        "AttentionScaledByLocalWidth",
        replaces="ParallelAttention",
        fails=[f"{_ATTENTION}[2]", f"{_ATTENTION}[4-rows]"],
        says=["scaled the scores by 1/sqrt(8)", "1/sqrt(self.head_dim)"],
    ),
    Mistake(
        "AttentionNoHeadsCheck",
        replaces="ParallelAttention",
        fails=["test_parallel_attention_refuses_heads_that_do_not_divide"],
        says=["2 heads do not split over 4 ranks", "Raise ValueError"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("FReturnsX", replaces="CopyToParallelRegion"),
    RightAnswer("GFromADetachedCopy", replaces="ReduceFromParallelRegion"),
    RightAnswer("shard_range_with_chunks", replaces="shard_range", steps=(2, 3)),
    RightAnswer("ColumnWithChunk", replaces="ColumnParallelLinear", steps=(2, 4)),
    RightAnswer("RowWithTensorSplit", replaces="RowParallelLinear", steps=(3, 4)),
    RightAnswer("RowBiasViaAddmm", replaces="RowParallelLinear", steps=(3, 4)),
    RightAnswer("MLPWithExplicitRegions", replaces="ParallelMLP", steps=(4,)),
    RightAnswer("AttentionWithSDPA", replaces="ParallelAttention", steps=(5,)),
]
