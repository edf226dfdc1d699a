"""k25's mistakes catalogue: real mistakes in sequence parallelism (collectives along the
sequence, the conjugate pair, the LayerNorm's partial gradients, the gathering and scattering
linears, the block, its activation bytes), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises.

Autograd functions and layers are whole classes (subclasses of the reference with one method
done the way a learner might): the catalogue swaps whole classes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k25_sequence_parallel as reference

all_gather_into = reference.all_gather_into
reduce_scatter_into = reference.reduce_scatter_into
sequence_range = reference.sequence_range
all_gather_sequence = reference.all_gather_sequence
reduce_scatter_sequence = reference.reduce_scatter_sequence


# --------------------------------------------------------------------------- step 1


def sequence_range_world_rank(length, group=None):
    size, rank = dist.get_world_size(group), dist.get_rank()  # the world's rank
    if length % size:
        raise ValueError(f"{length} positions do not split over {size} ranks")
    share = length // size
    return rank * share, (rank + 1) * share


def sequence_range_unchecked(length, group=None):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = length // size  # 10 // 4 = 2: two positions silently dropped
    return rank * share, (rank + 1) * share


def sequence_range_with_chunks(length, group=None):
    """Right: the bounds of torch.chunk's pieces, the check first."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if length % size:
        raise ValueError(
            f"cannot give {size} ranks equal parts of {length} positions: pad the sequence to "
            f"a multiple of {size}"
        )
    piece = torch.arange(length).chunk(size)[rank]
    return int(piece[0]), int(piece[-1]) + 1


def gather_along_batch(x, group=None):
    size = dist.get_world_size(group)
    gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(gathered, x.contiguous(), group)
    return gathered  # "all_gather_into_tensor gathers it": along dim 0, the batch


def gather_reshape_mixes(x, group=None):
    size = dist.get_world_size(group)
    gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(gathered, x.contiguous(), group)
    return gathered.reshape(x.shape[0], size * x.shape[1], *x.shape[2:])  # no transpose


def gather_with_a_list(x, group=None):
    """Right: dist.all_gather into a list, concatenated along the sequence."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=1)


def scatter_along_batch(x, group=None):
    size = dist.get_world_size(group)
    sequence_range(x.shape[1], group)
    mine = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(mine, x.contiguous(), group)  # dim 0: the batch split, not the sequence
    return mine


def scatter_without_transpose(x, group=None):
    size = dist.get_world_size(group)
    sequence_range(x.shape[1], group)
    share = x.shape[1] // size
    mine = torch.empty((x.shape[0], share, *x.shape[2:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(mine, x.reshape(size * x.shape[0], share, *x.shape[2:]), group)
    return mine


def scatter_by_all_reduce(x, group=None):
    start, end = sequence_range(x.shape[1], group)
    total = x.clone()
    dist.all_reduce(total, group=group)  # every position's sum to every rank
    return total[:, start:end].contiguous()


def scatter_averages(x, group=None):
    return reduce_scatter_sequence(x, group) / dist.get_world_size(group)


def scatter_through_movedim(x, group=None):
    """Right: the sequence moved to dim 0, reduce-scattered there, moved back."""
    size = dist.get_world_size(group)
    sequence_range(x.shape[1], group)
    front = x.movedim(1, 0).contiguous()  # (sequence, batch, ...)
    mine = torch.empty((front.shape[0] // size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(mine, front, group)
    return mine.movedim(0, 1).contiguous()


def scatter_from_a_list(x, group=None):
    """Right: dist.reduce_scatter from a list of every rank's positions."""
    size = dist.get_world_size(group)
    sequence_range(x.shape[1], group)  # the check, before any collective
    pieces = [piece.contiguous() for piece in x.chunk(size, dim=1)]
    mine = torch.empty_like(pieces[0])
    dist.reduce_scatter(mine, pieces, group=group)
    return mine


# --------------------------------------------------------------------------- step 2

_Gather = reference.GatherFromSequenceParallelRegion
_Scatter = reference.ReduceScatterToSequenceParallelRegion


class GatherBackwardSlices(_Gather):
    @staticmethod
    def backward(ctx, grad):
        start, end = sequence_range(grad.shape[1], ctx.group)
        return grad[:, start:end].contiguous(), None  # "my positions' gradient": mine alone


class GatherBackwardAverages(_Gather):
    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        return reduce_scatter_sequence(grad, ctx.group) / size, None  # "as DDP does"


class GatherOnTheWorld(_Gather):
    @staticmethod
    def forward(ctx, x, group):
        return all_gather_sequence(x, group)  # the group not kept

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, None), None  # the whole world


class GatherForwardScatters(_Gather):
    """The pair swapped: the gather region written as the reduce-scatter one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class ScatterBackwardZerosElsewhere(_Scatter):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.length = group, x.shape[1]
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        start, end = sequence_range(ctx.length, ctx.group)
        full = grad.new_zeros(grad.shape[0], ctx.length, *grad.shape[2:])
        full[:, start:end] = grad  # "my positions came from me"
        return full, None


# --------------------------------------------------------------------------- step 3


class NormGathersFirst(reference.SequenceParallelLayerNorm):
    def forward(self, x):
        # "a norm needs the whole sequence": gathered, normalized, then my positions of it
        full = reference.gather_from_sequence_parallel_region(x, None)
        start, end = sequence_range(full.shape[1], None)
        normed = F.layer_norm(full, self.normalized_shape, self.weight, self.bias, self.eps)
        return normed[:, start:end]


class NormWithoutWeightAndBias(reference.SequenceParallelLayerNorm):
    def forward(self, x):
        # "a LayerNorm normalizes": its weight and bias forgotten, so they get no gradient
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)


class NormByHand(reference.SequenceParallelLayerNorm):
    """Right: the LayerNorm written out (biased variance, as nn.LayerNorm's)."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, correction=0)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def _marked(module):
    return [
        p.grad
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]


def sync_averages(module, group=None):
    grads = _marked(module)
    for grad in grads:
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)  # "average the gradients" (DDP's habit)
    return len(grads)


def sync_per_parameter(module, group=None):
    grads = _marked(module)
    for grad in grads:
        dist.all_reduce(grad, group=group)  # right sums, one call per tensor
    return len(grads)


def sync_every_parameter(module, group=None):
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # the complete gradients summed too
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return len(grads)


def _zero_filled(params):
    """Their gradients, a missing one made zeros (every rank then makes the same call)."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return [param.grad for param in params]


def sync_only_layer_norms(module, group=None):
    grads = _zero_filled(
        [
            p
            for m in module.modules()
            if isinstance(m, reference.SequenceParallelLayerNorm)
            for p in m.parameters()
        ]
    )  # "the LayerNorms are the sequence-parallel part": the row-parallel biases forgotten
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return len(grads)


def sync_forgets_to_copy_back(module, group=None):
    grads = _marked(module)
    flat = torch.cat([g.reshape(-1) for g in grads])  # a new tensor, not a view of the grads
    dist.all_reduce(flat, group=group)
    return len(grads)


def sync_on_the_world(module, group=None):
    grads = _marked(module)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # the group dropped: the whole world
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return len(grads)


def sync_returns_early_without_gradients(module, group=None):
    """Real code: the gradients a rank has, and nothing to do where it has none."""
    grads = _marked(module)
    if not grads:
        return 0  # "nothing to sum here": but the peers wait in their all-reduce for this rank
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return len(grads)


def sync_skips_missing_gradients(module, group=None):
    grads = _marked(module)  # where a rank has none: torch.cat of nothing
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return len(grads)


def sync_zeros_kept_to_itself(module, group=None):
    params = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # the same call everywhere: right
    offset = 0
    for param, grad in zip(params, grads):
        if param.grad is not None:  # but the rank without a gradient never gets the sum
            param.grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return len(grads)


def sync_with_flatten_utils(module, group=None):
    """Right: torch's own flatten and unflatten helpers (what DDP's buckets use)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = _zero_filled([p for p in module.parameters() if getattr(p, "sequence_parallel", False)])
    if not grads:
        return 0
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, dist.ReduceOp.SUM, group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)
    return len(grads)


# --------------------------------------------------------------------------- step 4

_Linear = reference.AllGatherLinear


class LinearKeepsTheGathered(_Linear):
    @staticmethod
    def forward(ctx, x, group, *params):
        ctx.group = group
        weights, biases = params[0::2], params[1::2]
        ctx.has_bias = [b is not None for b in biases]
        full = all_gather_sequence(x, group)
        ctx.save_for_backward(full, *weights)  # "backward needs the full input: keep it"
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        inputs = full.reshape(-1, full.shape[-1])
        grad_full, param_grads = 0, []
        for weight, has_bias, grad in zip(weights, ctx.has_bias, grads):
            flat = grad.reshape(-1, grad.shape[-1])
            grad_full = grad_full + flat @ weight
            param_grads += [flat.t() @ inputs, flat.sum(0) if has_bias else None]
        grad_x = reduce_scatter_sequence(grad_full.view(*full.shape[:-1], -1), ctx.group)
        return (grad_x, None, *param_grads)


class LinearBackwardSlices(_Linear):
    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group)
        inputs = full.reshape(-1, full.shape[-1])
        grad_full, param_grads = 0, []
        for weight, has_bias, grad in zip(weights, ctx.has_bias, grads):
            flat = grad.reshape(-1, grad.shape[-1])
            grad_full = grad_full + flat @ weight
            param_grads += [flat.t() @ inputs, flat.sum(0) if has_bias else None]
        start, end = sequence_range(full.shape[1], ctx.group)
        grad_full = grad_full.view(*full.shape[:-1], -1)  # my positions, my features only
        return (grad_full[:, start:end].contiguous(), None, *param_grads)


class LinearWeightFromMyPositions(_Linear):
    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        start, end = sequence_range(grads[0].shape[1], ctx.group)
        mine = x.reshape(-1, x.shape[-1])
        grad_full, param_grads = 0, []
        for weight, has_bias, grad in zip(weights, ctx.has_bias, grads):
            flat = grad.reshape(-1, grad.shape[-1])
            grad_full = grad_full + flat @ weight
            local = grad[:, start:end].reshape(-1, grad.shape[-1])  # "x is what I saved"
            param_grads += [local.t() @ mine, flat.sum(0) if has_bias else None]
        grad_x = reduce_scatter_sequence(grad_full.view(*grads[0].shape[:-1], -1), ctx.group)
        return (grad_x, None, *param_grads)


class LinearScatterPerLayer(_Linear):
    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group)
        inputs = full.reshape(-1, full.shape[-1])
        grad_x, param_grads = 0, []
        for weight, has_bias, grad in zip(weights, ctx.has_bias, grads):
            flat = grad.reshape(-1, grad.shape[-1])
            through = (flat @ weight).view(*full.shape[:-1], -1)
            grad_x = grad_x + reduce_scatter_sequence(through, ctx.group)  # one per layer
            param_grads += [flat.t() @ inputs, flat.sum(0) if has_bias else None]
        return (grad_x, None, *param_grads)


class LinearWithEinsum(_Linear):
    """Right: einsum over (batch, sequence), the gradients only where autograd asks for them."""

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group)
        grad_full = sum(torch.einsum("bso,oi->bsi", g, w) for g, w in zip(grads, weights))
        out = []
        for i, (has_bias, grad) in enumerate(zip(ctx.has_bias, grads)):
            wanted = ctx.needs_input_grad[2 + 2 * i]
            out.append(torch.einsum("bso,bsi->oi", grad, full) if wanted else None)
            out.append(grad.sum((0, 1)) if has_bias else None)
        return (reduce_scatter_sequence(grad_full, ctx.group), None, *out)


_Row = reference.RowParallelLinear


class RowBiasBeforeScatter(_Row):
    def forward(self, x):
        partial = F.linear(x, self.weight, self.bias)  # the bias in every rank's partial
        return reference.reduce_scatter_to_sequence_parallel_region(partial, self.process_group)


class RowWithAllReduce(_Row):
    def forward(self, x):
        # k20's g, then my positions: right values, every position's sum sent to every rank
        total = F.linear(x, self.weight).clone()
        dist.all_reduce(total, group=self.process_group)
        start, end = sequence_range(total.shape[1], self.process_group)
        return total[:, start:end] + self.bias


class RowBiasOnRankZero(_Row):
    def forward(self, x):
        partial = F.linear(x, self.weight)
        mine = reference.reduce_scatter_to_sequence_parallel_region(partial, self.process_group)
        if dist.get_rank(self.process_group) == 0:  # "the bias once": on one rank's positions
            mine = mine + self.bias
        return mine


# --------------------------------------------------------------------------- step 5


class AttentionGathersPerProjection(reference.SequenceParallelAttention):
    def forward(self, x):
        batch = x.shape[0]
        q, k, v = self.query(x), self.key(x), self.value(x)  # three all-gathers
        length = q.shape[1]

        def heads(t):
            return t.view(batch, length, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class AttentionLengthOfMyPositions(reference.SequenceParallelAttention):
    def forward(self, x):
        batch, length, _ = x.shape  # k20's line: but x holds this rank's positions only
        q, k, v = reference.all_gather_linear(
            x, [self.query, self.key, self.value], self.process_group
        )

        def heads(t):
            return t.view(batch, length, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class AttentionWithSDPA(reference.SequenceParallelAttention):
    """Right: torch's fused attention on this rank's heads (another order of sums: close)."""

    def forward(self, x):
        q, k, v = reference.all_gather_linear(
            x, [self.query, self.key, self.value], self.process_group
        )

        def heads(t):
            return t.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.out(attended.transpose(1, 2).flatten(2))


class BlockWithPlainNorms(reference.SequenceParallelBlock):
    def __init__(self, block, process_group=None):
        nn.Module.__init__(self)
        self.process_group = process_group
        self.attention_norm = block.attention_norm  # "a LayerNorm works on a slice as it is"
        self.attention = reference.SequenceParallelAttention(block.attention, process_group)
        self.mlp_norm = block.mlp_norm
        self.mlp = reference.SequenceParallelMLP(block.mlp, process_group)


class BlockResidualsByName(reference.SequenceParallelBlock):
    """Right: the residual stream named step by step."""

    def forward(self, x):
        attended = self.attention(self.attention_norm(x))
        middle = x + attended
        return middle + self.mlp(self.mlp_norm(middle))


# --------------------------------------------------------------------------- step 6


def formula_tp_layout(batch, length, dim, heads, ranks):
    b, s, h, a, n = batch, length, dim, heads, ranks
    whole = 4 * b * s * h + 4 * b * s  # the LayerNorms' tensors counted as k20 keeps them
    split = 8 * b * s * h + a * b * s * s
    return 4 * (whole + split // n) + s * s


def formula_without_mask(batch, length, dim, heads, ranks):
    floats = 12 * batch * length * dim + heads * batch * length * length + 4 * batch * length
    return 4 * floats // ranks


def formula_mask_divided(batch, length, dim, heads, ranks):
    floats = 12 * batch * length * dim + heads * batch * length * length + 4 * batch * length
    return (4 * floats + length * length) // ranks  # "everything shrinks by N"


def formula_without_statistics(batch, length, dim, heads, ranks):
    floats = 12 * batch * length * dim + heads * batch * length * length
    return 4 * floats // ranks + length * length


def formula_in_floats(batch, length, dim, heads, ranks):
    floats = 12 * batch * length * dim + heads * batch * length * length + 4 * batch * length
    return 4 * floats / ranks + length * length  # a float: / where // was meant


def formula_term_by_term(batch, length, dim, heads, ranks):
    """Right: each saved tensor counted by its own line."""
    per_rank = length // ranks
    terms = [
        2 * 4 * batch * per_rank * dim,  # the LayerNorms' inputs
        2 * 4 * batch * per_rank * dim,  # their outputs (the column layers' saved slices)
        2 * 2 * 4 * batch * per_rank,  # their means and 1/stds
        3 * 4 * batch * length * (dim // ranks),  # q, k, v (the matmuls' copies)
        4 * batch * (heads // ranks) * length * length,  # softmax's output
        4 * batch * length * (dim // ranks),  # attention's output, out's input
        4 * batch * length * (4 * dim // ranks),  # relu's output
        length * length,  # the causal mask
    ]
    return sum(terms)


# --------------------------------------------------------------------------- the catalogue

_RANGE = "test_sequence_range_gives_each_rank_its_positions_in_group_order"
_GATHER = "test_all_gather_sequence_puts_every_rank_s_positions_in_order"
_SCATTER = "test_reduce_scatter_sequence_gives_each_rank_the_sum_of_its_positions"
_REFUSED = "test_a_sequence_that_does_not_divide_is_refused"
_GATHER_REGION = "test_gather_region_all_gathers_forward_and_reduce_scatters_backward"
_SCATTER_REGION = "test_reduce_scatter_region_reduce_scatters_forward_and_all_gathers_backward"
_NORM = "test_layer_norm_normalizes_my_positions_without_communicating"
_SYNC = "test_sync_sums_the_partial_gradients_in_one_all_reduce"
_SYNC_BARE = "test_sync_makes_the_same_call_on_a_rank_without_gradients"
_COLUMN = "test_column_parallel_gathers_once_and_keeps_only_my_positions"
_SEVERAL = "test_all_gather_linear_serves_several_layers_with_one_gather"
_ROW = "test_row_parallel_reduce_scatters_and_adds_the_bias_once"
_BLOCK = "test_block_equals_one_process_forward_and_backward"
_MEMORY = "test_activation_bytes_is_what_autograd_saved"

MISTAKES = [
    Mistake(
        "sequence_range_world_rank",
        replaces="sequence_range",
        fails=[f"{_RANGE}[4-rows]"],
        says=["ranks IN THE GROUP", "dist.get_rank(group)"],
    ),
    Mistake(
        "sequence_range_unchecked",
        replaces="sequence_range",
        fails=[_REFUSED],
        says=["10 positions do not split over 4 ranks", "Raise ValueError"],
    ),
    Mistake(
        "gather_along_batch",
        replaces="all_gather_sequence",
        fails=[_GATHER],
        says=["gathered along the batch (dim 0)", "end to end along dim 1"],
    ),
    Mistake(
        "gather_reshape_mixes",
        replaces="all_gather_sequence",
        fails=[f"{_GATHER}[2]", f"{_GATHER}[4]"],
        says=["mixed the batch and the ranks", "transpose(0, 1)"],
    ),
    Mistake(
        "scatter_along_batch",
        replaces="reduce_scatter_sequence",
        fails=[_SCATTER],
        says=["scattered the batch (dim 0)", "POSITIONS (dim 1)"],
    ),
    Mistake(
        "scatter_without_transpose",
        replaces="reduce_scatter_sequence",
        fails=[f"{_SCATTER}[2]", f"{_SCATTER}[4]"],
        says=["a mix of sequences and positions", "transpose(0, 1)"],
    ),
    Mistake(
        "scatter_by_all_reduce",
        replaces="reduce_scatter_sequence",
        fails=[_SCATTER],
        says=["all-reduced and kept its own positions", "Reduce-scatter instead"],
    ),
    Mistake(
        "scatter_averages",
        replaces="reduce_scatter_sequence",
        fails=[_SCATTER],
        says=["the mean over the group", "do not divide"],
    ),
    Mistake(
        "GatherBackwardSlices",
        replaces="GatherFromSequenceParallelRegion",
        fails=[f"{_GATHER_REGION}[2]", f"{_GATHER_REGION}[4]"],
        says=["kept this rank's positions of its own gradient", "Reduce-scatter the gradient"],
    ),
    Mistake(
        "GatherBackwardAverages",
        replaces="GatherFromSequenceParallelRegion",
        fails=[_GATHER_REGION],
        says=["the mean over the group", "do not divide"],
    ),
    Mistake(
        "GatherOnTheWorld",
        replaces="GatherFromSequenceParallelRegion",
        fails=[f"{_GATHER_REGION}[4-rows]"],
        says=["invalid gradient", "or the whole world?"],
    ),
    Mistake(
        "GatherForwardScatters",
        replaces="GatherFromSequenceParallelRegion",
        fails=[f"{_GATHER_REGION}[2]"],
        says=["called ['reduce-scatter']", "exactly one all-gather"],
    ),
    Mistake(
        "ScatterBackwardZerosElsewhere",
        replaces="ReduceScatterToSequenceParallelRegion",
        fails=[_SCATTER_REGION],
        says=["zeros elsewhere", "All-gather the gradient"],
    ),
    Mistake(
        "NormGathersFirst",
        replaces="SequenceParallelLayerNorm",
        fails=[_NORM],
        says=["forward called ['all-gather']", "need nothing from any other rank"],
    ),
    Mistake(
        "NormWithoutWeightAndBias",
        replaces="SequenceParallelLayerNorm",
        fails=[_NORM, _SYNC],
        says=["LayerNorm", "(self.weight, self.bias"],
    ),
    Mistake(
        "sync_averages",
        replaces="sync_sequence_parallel_grads",
        fails=[_SYNC],
        says=["the mean of the ranks' shares", "do not divide"],
    ),
    Mistake(
        "sync_per_parameter",
        replaces="sync_sequence_parallel_grads",
        fails=[_SYNC],
        says=["one all-reduce for all of them", "flatten the gradients into one buffer"],
    ),
    Mistake(
        "sync_every_parameter",
        replaces="sync_sequence_parallel_grads",
        fails=[_SYNC],
        says=["changed the gradient of a parameter not marked sequence_parallel"],
    ),
    Mistake(
        "sync_only_layer_norms",
        replaces="sync_sequence_parallel_grads",
        fails=[_ROW],
        says=["its gradient is a partial sum like a LayerNorm's", "every marked parameter"],
    ),
    Mistake(
        "sync_returns_early_without_gradients",
        replaces="sync_sequence_parallel_grads",
        fails=[_SYNC_BARE],
        says=[
            "has no gradient",
            "returned without the all-reduce",
            "count a missing gradient as zeros",
        ],
    ),
    Mistake(
        "sync_skips_missing_gradients",
        replaces="sync_sequence_parallel_grads",
        fails=[f"{_SYNC_BARE}[2]"],
        says=["raised", "on a rank whose LayerNorm has no gradient", "counts as zeros"],
    ),
    Mistake(
        "sync_zeros_kept_to_itself",
        replaces="sync_sequence_parallel_grads",
        fails=[_SYNC_BARE],
        says=["still None on this rank, which had none", "needs the group's sum too"],
    ),
    Mistake(
        "sync_forgets_to_copy_back",
        replaces="sync_sequence_parallel_grads",
        fails=[f"{_SYNC}[2]", f"{_SYNC}[4]"],
        says=["still this rank's own share", "partial sum"],
    ),
    Mistake(
        "sync_on_the_world",
        replaces="sync_sequence_parallel_grads",
        fails=[f"{_SYNC}[4-rows]"],
        says=["summed over the whole world", "pass the group"],
    ),
    Mistake(
        "LinearKeepsTheGathered",
        replaces="AllGatherLinear",
        fails=[f"{_COLUMN}[2]", f"{_COLUMN}[4]"],
        says=["the whole gathered input", "gather it again in backward"],
    ),
    Mistake(
        "LinearBackwardSlices",
        replaces="AllGatherLinear",
        fails=[_COLUMN],
        says=["called ['all-gather']", "one reduce-scatter (the input's gradient, summed"],
    ),
    Mistake(
        "LinearWeightFromMyPositions",
        replaces="AllGatherLinear",
        fails=[_COLUMN],
        says=["made a reduce-scatter only", "gather it again in backward"],
    ),
    Mistake(
        "LinearScatterPerLayer",
        replaces="AllGatherLinear",
        fails=[_SEVERAL],
        says=["for all the layers together"],
    ),
    Mistake(
        "RowBiasBeforeScatter",
        replaces="RowParallelLinear",
        fails=[_ROW],
        says=["BEFORE the reduce-scatter", "Add it once, after"],
    ),
    Mistake(
        "RowWithAllReduce",
        replaces="RowParallelLinear",
        fails=[_ROW],
        says=["all-reduced and kept its own positions", "Reduce-scatter instead"],
    ),
    Mistake(
        "RowBiasOnRankZero",
        replaces="RowParallelLinear",
        fails=[_ROW],
        says=["rank 1", "then + self.bias on every rank"],
    ),
    Mistake(
        "AttentionGathersPerProjection",
        replaces="SequenceParallelAttention",
        fails=[_BLOCK],
        says=["made 4 all-gathers", "one all-gather serves the three"],
    ),
    Mistake(
        "AttentionLengthOfMyPositions",
        replaces="SequenceParallelAttention",
        fails=[_BLOCK],
        says=["hold the WHOLE sequence", "q.shape[1]"],
    ),
    Mistake(
        "BlockWithPlainNorms",
        replaces="SequenceParallelBlock",
        fails=[_BLOCK],
        says=["is not marked sequence_parallel", "SequenceParallelLayerNorm"],
    ),
    Mistake(
        "formula_tp_layout",
        replaces="activation_bytes",
        fails=[f"{_MEMORY}[2]", f"{_MEMORY}[4]"],
        says=["counted the LayerNorms' inputs and outputs whole"],
    ),
    Mistake(
        "formula_without_mask",
        replaces="activation_bytes",
        fails=[_MEMORY],
        says=["the formula lacks", "the causal mask"],
    ),
    Mistake(
        "formula_mask_divided",
        replaces="activation_bytes",
        fails=[f"{_MEMORY}[2]", f"{_MEMORY}[4]"],
        says=["the causal mask is whole on every rank"],
    ),
    Mistake(
        "formula_without_statistics",
        replaces="activation_bytes",
        fails=[_MEMORY],
        says=["the LayerNorms' statistics"],
    ),
    Mistake(
        "formula_in_floats",
        replaces="activation_bytes",
        fails=[_MEMORY],
        says=["return an int"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("sequence_range_with_chunks", replaces="sequence_range"),
    # into a list and from one: every step that gathers or scatters, the program's counts too
    RightAnswer("gather_with_a_list", replaces="all_gather_sequence", steps=(1, 2, 4, 5, 6)),
    RightAnswer("scatter_from_a_list", replaces="reduce_scatter_sequence", steps=(1, 2, 4, 5, 6)),
    RightAnswer("scatter_through_movedim", replaces="reduce_scatter_sequence", steps=(1, 2)),
    RightAnswer("NormByHand", replaces="SequenceParallelLayerNorm"),
    RightAnswer("sync_with_flatten_utils", replaces="sync_sequence_parallel_grads", steps=(3, 4)),
    RightAnswer("LinearWithEinsum", replaces="AllGatherLinear"),
    RightAnswer("AttentionWithSDPA", replaces="SequenceParallelAttention"),
    RightAnswer("BlockResidualsByName", replaces="SequenceParallelBlock"),
    RightAnswer("formula_term_by_term", replaces="activation_bytes"),
]
